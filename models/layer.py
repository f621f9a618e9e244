"""The drafter's one decoder layer: its modules, and one TTT step cut into the pieces that
torch.compile fuses (`models.drafter.Eagle3Drafter` runs the unroll).

One step computes exactly models/serving/CONTRACT.md §4 (`models.serving.reference` re-derives
it independently) up to norm(p), the lm_head input: the loss applies lm_head.
Norms and softmax run in fp32; parameters may be bf16.

Speed (GPU): with `compile_layer` the two halves of a step around the attention kernel,
`attention_inputs` (norms, cat, q/k/v projections, RoPE) and `layer_output` (o_proj, residuals,
post-attention norm, SwiGLU MLP, final norm), are each one torch.compile graph: the element-wise
work fuses into a few kernels around the cuBLAS GEMMs, and the backward keeps the GEMM inputs
instead of every fp32 intermediate. Eager and compiled paths run the same Python functions.
The embedding half of q/k/v is linear in rows that step k reads shifted by k, so
`embedding_qkv` projects it once for the whole unroll and `attention_inputs_split` adds each
step's hidden half to its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from eyas.models.attention import compiled
from eyas.models.config import Eagle3Config
from eyas.models.fp8 import fp8_linear
from eyas.models.rope import apply_rope


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
# The drafter's unroll runs a step as attention_inputs -> TTTAttention -> layer_output (the
# equations of the module docstring); the pieces are what torch.compile fuses.
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
    a = layer.self_attn
    # with float8 training projections (`drafter.fp8_split_qkv`) the hidden half runs their
    # FP8 GEMMs; the embedding half stayed bf16 (`embedding_qkv`)
    q, k, v = (e + fp8_linear(x, w, proj)
               for e, w, proj in zip(embed_qkv, weights, (a.q_proj, a.k_proj, a.v_proj)))
    return _heads(a, q, k, v, positions, inv_freq, rope_factor)


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


# ---------------------------------------------------------------------- one step, planned
@dataclass(frozen=True)
class StepPlan:
    """How every step of an unroll runs, chosen once (`step_plan`); the unroll itself
    (`models.drafter.Eagle3Drafter.forward`) is one path over these functions.

    `embedding` runs once per unroll on the embedding table [T+K, H] and gives the rows step k
    reads at 1+k .. k+T, plus what each step's q/k/v needs besides (the hidden halves of the
    q/k/v weights when the embedding half is projected once, else nothing); `qkv` gives one
    step's q, k, v from its rows; `output` gives (p, final_norm(p)) from the attention output.
    `split`: whether the embedding half of q/k/v is projected once per unroll.
    """

    split: bool
    embedding: Callable[[Midlayer, Tensor], tuple[tuple[Tensor, ...], tuple[Tensor, ...]]]
    qkv: Callable[..., tuple[Tensor, Tensor, Tensor]]
    output: Callable[[Midlayer, Tensor, Tensor, RMSNorm], tuple[Tensor, Tensor]]


def step_plan(*, fused: bool, split: bool, checkpoint_mlp: bool) -> StepPlan:
    """The step functions: each piece compiled (`fused`) or eager; the embedding half of q/k/v
    projected once per unroll (`split`: `embedding_qkv` + `attention_inputs_split`) or with
    each step (`attention_inputs`); the MLP recomputed in the backward (`checkpoint_mlp`, while
    gradients are recorded) or kept."""
    def fn(f: Callable) -> Callable:
        return compiled(f) if fused else f

    if split:
        once, inputs = fn(embedding_qkv), fn(attention_inputs_split)

        def embedding(layer: Midlayer, table: Tensor):
            # the halves are taken once per unroll: the K steps' weight gradients add up in
            # them before reaching the weight
            H = table.shape[-1]
            proj = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
            return (once(layer, table, tuple(p.weight[:, :H] for p in proj)),
                    tuple(p.weight[:, H:] for p in proj))

        def qkv(layer, rows, extra, g, *rope):
            return inputs(layer, rows, g, extra, *rope)
    else:
        whole = fn(attention_inputs)

        def embedding(layer: Midlayer, table: Tensor):
            return (table,), ()

        def qkv(layer, rows, extra, g, *rope):
            return whole(layer, rows[0], g, *rope)
    output = fn(layer_output)
    if checkpoint_mlp:
        residual, mlp, kept = fn(attention_residual), fn(mlp_residual), output

        def output(layer: Midlayer, attn_out: Tensor, g: Tensor, final_norm: RMSNorm):
            if not torch.is_grad_enabled():
                return kept(layer, attn_out, g, final_norm)
            h, x = residual(layer, attn_out, g)
            return torch.utils.checkpoint.checkpoint(mlp, layer, h, x, final_norm,
                                                     use_reentrant=False)
    return StepPlan(split, embedding, qkv, output)
