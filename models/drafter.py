"""`Eagle3Drafter`: the layout-A EAGLE-3 drafter and its training-time-test (TTT) unroll.

Parameter names are the exported layout-A names (serving-contract.md §3), so a state dict minus
`embed_tokens.weight` is the export:

    fc.weight                                   [H, 3·tH]   fuses [h_a | h_b | h_c]
    input_norm.weight [3·tH], fc_norm.{0,1,2}.weight [tH]  EAGLE-3.1 aux norms, when configured
    midlayer.input_layernorm.weight             [H]         RMSNorm on the token embedding
    midlayer.hidden_norm.weight                 [H]         RMSNorm on fc(aux) / the fed-back hidden
    midlayer.self_attn.{q,k,v}_proj.weight      [heads·hd, 2H]   input cat(norm(embed), norm(g))
    midlayer.self_attn.o_proj.weight            [H, nh·hd]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight [I, H],  midlayer.mlp.down_proj.weight [H, I]
    norm.weight [H],  lm_head.weight [Vd, H]
    buffers: d2t [Vd] int64 (offsets: target id = i + d2t[i]),  t2d [V] bool
    embed_tokens.weight [V, H]: the target's embedding, frozen, never exported

One step computes exactly serving-contract §4 (`models.serving.reference` re-derives it independently):

    x = cat(input_layernorm(embed(tok)), hidden_norm(g))     # [T, 2H], embedding FIRST
    h = g + o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x))   # residual = g, un-normed
    p = h + mlp(post_attention_layernorm(h))                  # pre-norm output, fed back as next g
    hidden = norm(p)                                          # lm_head input (the loss applies lm_head)

Norms and softmax run in fp32; parameters may be bf16.

Speed (GPU): with `compile_layer` the two halves of a step around the attention kernel,
`attention_inputs` (norms, cat, q/k/v projections, RoPE) and `layer_output` (o_proj, residuals,
post-attention norm, SwiGLU MLP, final norm), are each one torch.compile graph: the element-wise
work fuses into a few kernels around the cuBLAS GEMMs, and the backward keeps the GEMM inputs
instead of every fp32 intermediate. Eager and compiled paths run the same Python functions.
`checkpoint_mlp` recomputes the MLP of each step in the backward (saves 2·T·I bf16 per step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from eyas.data.vocab_map import VocabMap
from eyas.models.attention import ATTENTION_KINDS, TTTAttention
from eyas.models.config import Eagle3Config
from eyas.models.rope import apply_rope, rope_inv_freq, rope_parameters  # noqa: F401 (re-export)
from eyas.models.ttt import embedding_ids, step_positions, structural_valid

log = logging.getLogger(__name__)


@dataclass
class DrafterOutput:
    """Result of the TTT unroll over a packed batch of T tokens and K steps."""

    hidden: Tensor
    """[K, T, H] final-norm outputs (the lm_head input) of every step"""
    prenorm: Optional[Tensor]
    """[K, T, H] pre-norm outputs p (fed back as the next step's hidden); None unless requested"""
    valid: Tensor
    """[K, T] bool structural validity (models.ttt.structural_valid)"""


# ---------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    """y = weight · x / sqrt(mean(x²) + eps), normalised in fp32 (Llama/vLLM convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight · x / sqrt(mean(x²) + eps): fp32 statistics, rounded to x's dtype before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Attention(nn.Module):
    """The projections of the drafter's attention (the step functions below apply them)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if type(self.down_proj) is not nn.Linear:    # e.g. a float8 training linear
            return self.down_proj(F.silu(gate) * up)
        if torch.compiler.is_compiling():
            # compiled, a checkpointed region is recomputed in the backward only as far as the
            # backward needs it: silu(gate)·up, not the GEMM. (SwiGLUDown's own recompute would
            # be merged with the forward's product, which would then be kept.)
            return torch.utils.checkpoint.checkpoint(swiglu_down, gate, up,
                                                     self.down_proj.weight, use_reentrant=False)
        return SwiGLUDown.apply(gate, up, self.down_proj.weight)


def swiglu_down(gate: Tensor, up: Tensor, weight: Tensor) -> Tensor:
    """down(silu(gate) · up) with the down projection's weight [H, I]."""
    return F.linear(F.silu(gate) * up, weight)


class SwiGLUDown(torch.autograd.Function):
    """down(silu(gate) · up) that keeps gate and up for the backward, not the product too
    (the eager path; compiled steps get the same from a checkpointed region, `MLP.forward`).

    The product a = silu(gate)·up [T, I] is the down projection's input; autograd would keep
    it beside gate and up for the weight gradient. Here the backward recomputes it from gate
    and up (element-wise): one [T, I] tensor less per TTT step, at no GEMM cost. Same values
    as the unfused expression."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up, weight)
        return swiglu_down(gate, up, weight)

    @staticmethod
    def backward(ctx, dy: Tensor):
        gate, up, weight = ctx.saved_tensors
        d_act = dy @ weight                                              # [.., I]
        d_gate = d_up = d_weight = None
        if ctx.needs_input_grad[2]:
            act = F.silu(gate) * up
            d_weight = dy.reshape(-1, dy.shape[-1]).t() @ act.reshape(-1, act.shape[-1])
        acc = torch.promote_types(gate.dtype, torch.float32)         # fp32 (fp64 stays fp64)
        gf, uf, df = gate.to(acc), up.to(acc), d_act.to(acc)
        sig = torch.sigmoid(gf)
        if ctx.needs_input_grad[0]:
            d_gate = (df * uf * sig * (1 + gf * (1 - sig))).to(gate.dtype)
        if ctx.needs_input_grad[1]:
            d_up = (df * gf * sig).to(up.dtype)
        return d_gate, d_up, d_weight


class Midlayer(nn.Module):
    """The single EAGLE-3 decoder layer: attention input is cat(norm(embed), norm(g)), residual g."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, cfg.intermediate_size)


# ---------------------------------------------------------------------- one step, in pieces
# The drafter's unroll runs a step as attention_inputs -> TTTAttention -> layer_output:
#   x = cat(input_layernorm(embeds), hidden_norm(g)); h = g + o_proj(attn(q, k, v));
#   p = h + mlp(post_attention_layernorm(h)); the lm_head reads norm(p), the next step takes p.
# The pieces are what torch.compile fuses.
def attention_inputs(layer: Midlayer, embeds: Tensor, g: Tensor, positions: Tensor,
                     inv_freq: Tensor, rope_factor: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """q [nh,T,d], k [nkv,T,d] (RoPE applied, cos/sin × rope_factor) and v [nkv,T,d] of one step."""
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(g)], dim=-1)     # [T, 2H]
    a = layer.self_attn
    return _heads(a, a.q_proj(x), a.k_proj(x), a.v_proj(x), positions, inv_freq, rope_factor)


def embedding_qkv(layer: Midlayer, table: Tensor, weights: tuple[Tensor, ...]
                  ) -> tuple[Tensor, ...]:
    """The embedding half of q, k and v for every row of the unroll's table [T+K, H]:
    input_layernorm(table) @ W[:, :H]ᵀ for W = q/k/v_proj.weight (`weights`: those halves).
    Step k uses rows 1+k .. k+T, so one GEMM per projection serves all K steps."""
    x = layer.input_layernorm(table)
    return tuple(F.linear(x, w) for w in weights)


def attention_inputs_split(layer: Midlayer, embed_qkv: tuple[Tensor, ...], g: Tensor,
                           weights: tuple[Tensor, ...], positions: Tensor, inv_freq: Tensor,
                           rope_factor: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """`attention_inputs` with the embedding half given (`embedding_qkv`, this step's rows):
    q = embed_q + hidden_norm(g) @ Wq[:, H:]ᵀ (`weights`: the hidden halves), likewise k, v.
    The same function as the concatenated input; in bf16 the two halves are rounded before
    their sum."""
    x = layer.hidden_norm(g)
    q, k, v = (e + F.linear(x, w) for e, w in zip(embed_qkv, weights))
    return _heads(layer.self_attn, q, k, v, positions, inv_freq, rope_factor)


def _heads(a: Attention, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, inv_freq: Tensor,
           rope_factor: float) -> tuple[Tensor, Tensor, Tensor]:
    """[T, n·d] projections → q [nh,T,d], k [nkv,T,d] with RoPE, v [nkv,T,d]."""
    T = q.shape[0]
    q = q.view(T, a.nh, a.hd).transpose(0, 1)
    k = k.view(T, a.nkv, a.hd).transpose(0, 1)
    v = v.view(T, a.nkv, a.hd).transpose(0, 1)
    return (apply_rope(q, positions, inv_freq, rope_factor),
            apply_rope(k, positions, inv_freq, rope_factor), v)


def attention_residual(layer: Midlayer, attn_out: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """h = g + o_proj(attention) and the MLP input post_attention_layernorm(h), both [T, H]."""
    T = g.shape[0]
    h = g + layer.self_attn.o_proj(attn_out.transpose(0, 1).reshape(T, -1))
    return h, layer.post_attention_layernorm(h)


def mlp_residual(layer: Midlayer, h: Tensor, x: Tensor, final_norm: RMSNorm
                 ) -> tuple[Tensor, Tensor]:
    """p = h + mlp(x) (fed back as the next step's g) and the lm_head input final_norm(p)."""
    p = h + layer.mlp(x)
    return p, final_norm(p)


def layer_output(layer: Midlayer, attn_out: Tensor, g: Tensor, final_norm: RMSNorm
                 ) -> tuple[Tensor, Tensor]:
    """(p, final_norm(p)) of one step from the attention output attn_out [nh,T,d]."""
    h, x = attention_residual(layer, attn_out, g)
    return mlp_residual(layer, h, x, final_norm)


_COMPILED: dict[str, Callable] = {}


def compiled(fn: Callable) -> Callable:
    """torch.compile(fn), one per function for the whole process.

    Static shapes for the first batch length T; a second T switches to a symbolic T (torch's
    automatic dynamic shapes), so varying T costs one more compile, not one per length."""
    c = _COMPILED.get(fn.__name__)
    if c is None:
        c = _COMPILED[fn.__name__] = torch.compile(fn, dynamic=None)
    return c


# ---------------------------------------------------------------------- the drafter
class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter (layout A) with the TTT unroll as its forward.

    attention: "flex" (GPU training; compiled when `compile_flex` and on CUDA), "eager" (dense
    fp32 reference; CPU training) or "lse-eager" (see models.attention).
    compile_layer: torch.compile the element-wise work of each step on CUDA (default: follows
    `compile_flex`). checkpoint_mlp: recompute each step's MLP in the backward (less memory).
    embedding_qkv_once: project the embedding half of q/k/v once for the whole unroll
    (`embedding_qkv`; step k reads rows shifted by k) instead of once per step.
    """

    def __init__(self, config: Eagle3Config, *, attention: str = "flex", compile_flex: bool = True,
                 flex_block_size: int = 128, compile_layer: bool | None = None,
                 checkpoint_mlp: bool = False, embedding_qkv_once: bool = True):
        super().__init__()
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={attention!r}; choose one of {ATTENTION_KINDS} "
                             f"(flex: GPU training, eager: CPU)")
        self.config, self.attention = config, attention
        self.compile_flex, self.flex_block_size = compile_flex, flex_block_size
        self.compile_layer = compile_flex if compile_layer is None else bool(compile_layer)
        self.checkpoint_mlp = bool(checkpoint_mlp)
        self.embedding_qkv_once = bool(embedding_qkv_once)
        self._rope_cache: dict[tuple, tuple[Tensor, float]] = {}
        H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)
        tH = config.target_hidden_size
        # EAGLE-3.1 norms on the aux states (config.norm_before_fc / fc_norm), engine names
        self.input_norm = RMSNorm(3 * tH, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(tH, config.rms_norm_eps) for _ in range(3)]) \
            if config.fc_norm else None
        self.fc = nn.Linear(3 * tH, H, bias=False)
        self.midlayer = Midlayer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[:Vd] = True                                                   # consistent with d2t = 0
        self.register_buffer("t2d", t2d)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Linear weights ~ N(0, std) (HF Llama's initializer_range), norms = 1. Embedding untouched."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # ------------------------------------------------------------------ TTT unroll
    def forward(self, input_ids: Tensor, aux: Tensor, doc_ids: Tensor, positions: Tensor,
                ttt_steps: int | None = None, *, return_prenorm: bool = False,
                embeds: Tensor | None = None) -> DrafterOutput:
        """Run K = ttt_steps (default config.ttt_steps) draft steps over a packed batch.

        input_ids [T] int64, aux [T, 3·tH], doc_ids [T] int (-1 = padding), positions [T] int64.
        Row t at step k uses aux[t] (step 0) or the step k-1 pre-norm output (k >= 1), token
        input_ids[t+1+k] and position positions[t]+k (models.ttt). Returns hidden [K, T, H]
        (normed), optionally prenorm [K, T, H], and valid [K, T]. embeds [T+K, H] (optional):
        the embedding rows of `models.ttt.embedding_ids(input_ids, K)`, looked up by the caller
        (e.g. on the host, `train.step.TrainingModule`); by default `embed_tokens` looks them up.
        """
        K = int(ttt_steps if ttt_steps is not None else self.config.ttt_steps)
        T = input_ids.shape[0]
        if aux.shape != (T, 3 * self.config.target_hidden_size):
            raise ValueError(f"aux has shape {tuple(aux.shape)}, expected ({T}, "
                             f"{3 * self.config.target_hidden_size}) = [T, 3·target_hidden_size]")
        if doc_ids.shape != (T,) or positions.shape != (T,):
            raise ValueError(f"doc_ids {tuple(doc_ids.shape)} and positions "
                             f"{tuple(positions.shape)} must both be [T]=[{T}]")
        valid = structural_valid(doc_ids, K)                                # [K, T]
        fused = self.compile_layer and input_ids.is_cuda
        attn = TTTAttention(doc_ids, self.attention, head_dim=self.config.head_dim,
                            compile_flex=self.compile_flex, block_size=self.flex_block_size,
                            compile_merge=fused)
        c = self.config
        inv_freq, rope_factor = self._rope_on(input_ids.device)
        pre = compiled(attention_inputs) if fused else attention_inputs
        post = compiled(layer_output) if fused else layer_output
        g = self.fc(self._fc_input(aux).to(self.fc.weight.dtype))          # [T, H]
        # one lookup for all steps: step k reads rows 1+k .. k+T (its tokens input_ids[t+1+k])
        table = (self._embed(embedding_ids(input_ids, K)) if embeds is None else embeds)
        if table.shape != (T + K, self.config.hidden_size):
            raise ValueError(f"embeds has shape {tuple(table.shape)}, expected ({T + K}, "
                             f"{self.config.hidden_size}) = [T + ttt_steps, hidden_size]")
        table = table.to(g.dtype)
        split = self._qkv_halves()
        if split is not None:
            once = compiled(embedding_qkv) if fused else embedding_qkv
            pre = compiled(attention_inputs_split) if fused else attention_inputs_split
            embed_qkv = once(self.midlayer, table, split[0])                # [T+K, n·d] each
        hidden, prenorm = [], []
        for k in range(K):
            if split is None:
                q, kk, v = pre(self.midlayer, table[1 + k:1 + k + T], g,
                               step_positions(positions, k), inv_freq, rope_factor)
            else:
                q, kk, v = pre(self.midlayer, tuple(e[1 + k:1 + k + T] for e in embed_qkv), g,
                               split[1], step_positions(positions, k), inv_freq, rope_factor)
            out = attn(q, kk, v)                                            # [nh, T, d]
            if self.checkpoint_mlp and torch.is_grad_enabled():
                p, normed = self._checkpointed_output(out, g, fused)
            else:
                p, normed = post(self.midlayer, out, g, self.norm)          # [T, H] each
            hidden.append(normed)
            prenorm.append(p)
            g = normed if c.norm_output else p                              # fed to step k+1
        return DrafterOutput(hidden=torch.stack(hidden),
                             prenorm=torch.stack(prenorm) if return_prenorm else None,
                             valid=valid)

    def _rope_on(self, device: torch.device) -> tuple[Tensor, float]:
        """(RoPE inverse frequencies on `device`, attention factor), copied there once: a copy
        from pageable host memory in every forward would make the host wait for the GPU."""
        c = self.config
        key = (str(device), c.head_dim, c.rope_theta, repr(c.rope_scaling),
               c.max_position_embeddings)
        if key not in self._rope_cache:
            inv_freq, factor = rope_parameters(c.head_dim, c.rope_theta, c.rope_scaling,
                                               c.max_position_embeddings)
            self._rope_cache[key] = (inv_freq.to(device), factor)
        return self._rope_cache[key]

    def _qkv_halves(self) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None:
        """(embedding halves, hidden halves) of the q/k/v weights [n·d, 2H] with
        `embedding_qkv_once`, else None (also for projections that are not plain nn.Linear,
        e.g. float8 training linears, which must run their own forward). Taken once per
        unroll: the K steps' weight gradients add up in the halves before reaching the weight."""
        a = self.midlayer.self_attn
        projections = (a.q_proj, a.k_proj, a.v_proj)
        if not self.embedding_qkv_once or any(type(p) is not nn.Linear for p in projections):
            return None
        H = self.config.hidden_size
        return (tuple(p.weight[:, :H] for p in projections),
                tuple(p.weight[:, H:] for p in projections))

    def _embed(self, ids: Tensor) -> Tensor:
        if self.embed_tokens is None:
            raise ValueError("this drafter's embedding is held outside it (TrainingModule's "
                             "host_embedding): pass its rows as forward(..., embeds=...)")
        return self.embed_tokens(ids)

    def _fc_input(self, aux: Tensor) -> Tensor:
        """aux [T, 3·tH] through the EAGLE-3.1 norms that are on (input_norm over the whole row,
        then fc_norm per state), as both engines apply them; unchanged otherwise."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([n(x) for n, x in zip(self.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
        return aux

    def _checkpointed_output(self, attn_out: Tensor, g: Tensor, fused: bool
                             ) -> tuple[Tensor, Tensor]:
        """layer_output with the MLP (its [T, I] activations) recomputed in the backward."""
        res = compiled(attention_residual) if fused else attention_residual
        mlp = compiled(mlp_residual) if fused else mlp_residual
        h, x = res(self.midlayer, attn_out, g)
        return torch.utils.checkpoint.checkpoint(mlp, self.midlayer, h, x, self.norm,
                                                 use_reentrant=False)

    def forward_batch(self, batch, ttt_steps: int | None = None, **kwargs) -> DrafterOutput:
        """`forward` on a packed `data.loader.Batch` (or anything with those attributes)."""
        return self(batch.input_ids, batch.aux, batch.doc_ids, batch.positions, ttt_steps, **kwargs)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits over the draft vocabulary: lm_head(hidden) [..., Vd] (tests, evaluation)."""
        return F.linear(hidden.float(), self.lm_head.weight.float())

    # ------------------------------------------------------------------ target weights, vocab map
    def load_target_embedding(self, weight: Tensor) -> None:
        """Copy the target's input embedding [V, H] into `embed_tokens` (kept frozen)."""
        want = tuple(self.embed_tokens.weight.shape)
        if tuple(weight.shape) != want:
            raise ValueError(f"target embedding has shape {tuple(weight.shape)}, the drafter needs "
                             f"{want} = [vocab_size, hidden_size]; the drafter width must equal "
                             f"the target's hidden size")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)
        self.embed_tokens.weight.requires_grad_(False)

    def set_vocab_map(self, d2t: Tensor, t2d: Tensor | None = None) -> None:
        """Install a draft vocabulary: d2t [Vd] int64 offsets (target id = i + d2t[i]); t2d [V] bool.

        `data.vocab_map.VocabMap.validate` checks serving-contract §3's invariants (ids strictly
        increasing, within [0, V), t2d equal to the selected set). t2d is derived from d2t when
        not given.
        """
        V, Vd = self.config.vocab_size, self.config.draft_vocab_size
        d2t = torch.as_tensor(d2t).to(torch.int64).cpu()
        if d2t.shape != (Vd,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({Vd},) = [draft_vocab_size]")
        vocab = (VocabMap.from_d2t(d2t, V) if t2d is None
                 else VocabMap(d2t, torch.as_tensor(t2d).bool().cpu()))
        vocab.validate(target_vocab_size=V, draft_vocab_size=Vd)
        self.d2t.copy_(vocab.d2t.to(self.d2t.device))
        self.t2d.copy_(vocab.t2d.to(self.t2d.device))

    def init_lm_head_from_target(self, target_head_weight: Tensor, d2t: Tensor) -> None:
        """Install the vocabulary map `d2t` and copy target head rows into lm_head (row i ← id i+d2t[i]).

        For a fresh drafter only: when fine-tuning, keep the checkpoint's own d2t.
        """
        if target_head_weight.shape[1] != self.config.hidden_size:
            raise ValueError(f"target head has width {target_head_weight.shape[1]}, lm_head "
                             f"needs {self.config.hidden_size}")
        self.set_vocab_map(d2t)
        ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        with torch.no_grad():
            self.lm_head.weight.copy_(target_head_weight[ids.to(target_head_weight.device)])

    def direct_weights(self) -> list[nn.Parameter]:
        """Weights read outside their own module's forward: the lm_head (applied by the loss),
        the down projection (`SwiGLUDown`) and q/k/v (`embedding_qkv_once` slices them). ZeRO-3
        must gather them for the whole step."""
        a = self.midlayer.self_attn
        return [self.lm_head.weight, self.midlayer.mlp.down_proj.weight,
                a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]

    def num_trainable_parameters(self) -> int:
        """Number of parameters the optimiser updates (everything but the frozen embedding)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
