"""`Eagle3Drafter`: the layout-A EAGLE-3 drafter and its training-time-test (TTT) unroll.

Parameter names and shapes are the exported layout-A ones (models/serving/CONTRACT.md §3), so a
state dict minus `embed_tokens.weight` (the target's embedding [V, H], frozen) is the export; the
buffers `d2t` and `t2d` carry the vocab map, with its unsaved lookups `target_ids` [Vd] and
`t2d_index` [V].

One step computes exactly models/serving/CONTRACT.md §4, written out in `models.layer` with the
layer's modules and the pieces of one step that torch.compile fuses (`models.serving.reference`
re-derives it independently). `checkpoint_mlp` recomputes the MLP of each step in the backward
(saves 2·T·I bf16 per step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.data.store.packing import embedding_ids
from eyas.data.store.vocab_map import VocabMap
from eyas.models.attention import ATTENTION_KINDS, TTTAttention
from eyas.models.config import Eagle3Config
from eyas.models.fp8 import is_float8_linear
from eyas.models.layer import Midlayer, RMSNorm, StepPlan, step_plan
from eyas.models.rope import rope_parameters
from eyas.models.ttt import step_positions, structural_valid

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


def _index_vocab(drafter: nn.Module, _=None) -> None:
    """The unsaved lookups of the drafter's vocab map, anew after each change of d2t/t2d."""
    vocab = VocabMap(drafter.d2t, drafter.t2d)
    drafter.register_buffer("target_ids", vocab.target_ids, persistent=False)
    drafter.register_buffer("t2d_index", vocab.t2d_index, persistent=False)


# ---------------------------------------------------------------------- the drafter
class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter (layout A) with the TTT unroll as its forward.

    attention: "flex" (GPU training; compiled when `compile_flex` and on CUDA), "eager" (dense
    fp32 reference; CPU training) or "lse-eager" (see models.attention).
    compile_layer: torch.compile the element-wise work of each step on CUDA (default: follows
    `compile_flex`). checkpoint_mlp: recompute each step's MLP in the backward (less memory).
    embedding_qkv_once: project the embedding half of q/k/v once for the whole unroll
    (`embedding_qkv`; step k reads rows shifted by k) instead of once per step.
    fp8_split_qkv: with float8 training q/k/v projections (`models.fp8`), keep that split: the
    embedding half in bf16 once per unroll, the hidden half in FP8 each step (its own scales);
    without it, such projections take the whole [T, 2H] input in FP8 every step.
    """

    def __init__(self, config: Eagle3Config, *, attention: str = "flex", compile_flex: bool = True,
                 flex_block_size: int = 128, compile_layer: bool | None = None,
                 checkpoint_mlp: bool = False, embedding_qkv_once: bool = True,
                 fp8_split_qkv: bool = False):
        super().__init__()
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={attention!r}; choose one of {ATTENTION_KINDS} "
                             f"(flex: GPU training, eager: CPU)")
        self.config, self.attention = config, attention
        self.compile_flex, self.flex_block_size = compile_flex, flex_block_size
        self.compile_layer = compile_flex if compile_layer is None else bool(compile_layer)
        self.checkpoint_mlp = bool(checkpoint_mlp)
        self.embedding_qkv_once = bool(embedding_qkv_once)
        self.fp8_split_qkv = bool(fp8_split_qkv)
        self._rope_cache: dict[tuple, tuple[Tensor, float]] = {}
        self._plans: dict[str, StepPlan] = {}
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
        self.register_buffer("t2d", torch.arange(V) < Vd)                # consistent with d2t = 0
        _index_vocab(self)
        self.register_load_state_dict_post_hook(_index_vocab)
        self.reset_parameters()
        for weight in self.hidden_matrices():       # optim=muon's half (train/muon.py)
            weight.use_muon = True

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
        plan = self.plan(input_ids.device)
        attn = TTTAttention(doc_ids, self.attention, head_dim=self.config.head_dim,
                            compile_flex=self.compile_flex, block_size=self.flex_block_size,
                            compile_merge=self.fused(input_ids.device))
        inv_freq, rope_factor = self._rope_on(input_ids.device)
        g = self.fc(self._fc_input(aux).to(self.fc.weight.dtype))          # [T, H]
        # one lookup for all steps: step k reads rows 1+k .. k+T (its tokens input_ids[t+1+k])
        table = (self._embed(embedding_ids(input_ids, K)) if embeds is None else embeds)
        if table.shape != (T + K, self.config.hidden_size):
            raise ValueError(f"embeds has shape {tuple(table.shape)}, expected ({T + K}, "
                             f"{self.config.hidden_size}) = [T + ttt_steps, hidden_size]")
        rows, extra = plan.embedding(self.midlayer, table.to(g.dtype))
        hidden, prenorm = [], []
        for k in range(K):
            q, kk, v = plan.qkv(self.midlayer, tuple(r[1 + k:1 + k + T] for r in rows), extra,
                                g, step_positions(positions, k), inv_freq, rope_factor)
            p, normed = plan.output(self.midlayer, attn(q, kk, v), g, self.norm)  # [T, H] each
            hidden.append(normed)
            prenorm.append(p)
            g = normed if self.config.norm_output else p                    # fed to step k+1
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

    def fused(self, device: torch.device) -> bool:
        """Whether the step pieces run compiled here: `compile_layer`, on CUDA only."""
        return self.compile_layer and device.type == "cuda"

    def plan(self, device: torch.device) -> StepPlan:
        """The step functions on `device` (`models.layer.step_plan`), chosen at the first
        forward there, after any float8 conversion (`models.fp8`), and kept. The embedding half
        of q/k/v is projected once per unroll with `embedding_qkv_once` when every q/k/v
        projection is a plain linear, or a float8 one under `fp8_split_qkv`; other float8
        linears take the whole input each step."""
        if device.type not in self._plans:
            a = self.midlayer.self_attn
            split = self.embedding_qkv_once and all(
                type(p) is nn.Linear or self.fp8_split_qkv and is_float8_linear(p)
                for p in (a.q_proj, a.k_proj, a.v_proj))
            self._plans[device.type] = step_plan(fused=self.fused(device), split=split,
                                                 checkpoint_mlp=self.checkpoint_mlp)
        return self._plans[device.type]

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

    def forward_batch(self, batch, ttt_steps: int | None = None, **kwargs) -> DrafterOutput:
        """`forward` on a packed `data.store.loader.Batch` (or anything with those attributes)."""
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

        `data.store.vocab_map.VocabMap.validate` checks the invariants of models/serving/CONTRACT.md
        §3 (ids strictly increasing, within [0, V), t2d equal to the selected set). t2d is
        derived from d2t when not given.
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
        _index_vocab(self)

    def init_lm_head_from_target(self, target_head_weight: Tensor, d2t: Tensor) -> None:
        """Install the vocabulary map `d2t` and copy target head rows into lm_head (row i ← id i+d2t[i]).

        For a fresh drafter only: when fine-tuning, keep the checkpoint's own d2t.
        """
        if target_head_weight.shape[1] != self.config.hidden_size:
            raise ValueError(f"target head has width {target_head_weight.shape[1]}, lm_head "
                             f"needs {self.config.hidden_size}")
        self.set_vocab_map(d2t)
        with torch.no_grad():
            self.lm_head.weight.copy_(target_head_weight[self.target_ids.to(
                target_head_weight.device)])

    def direct_weights(self) -> list[nn.Parameter]:
        """Weights read outside their own module's forward: the lm_head (applied by the loss),
        the down projection (`SwiGLUDown`) and q/k/v (`embedding_qkv_once` slices them). ZeRO-3
        must gather them for the whole step."""
        a = self.midlayer.self_attn
        return [self.lm_head.weight, self.midlayer.mlp.down_proj.weight,
                a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]

    def hidden_matrices(self) -> list[nn.Parameter]:
        """The 2-D weights of hidden layers, fc (3H -> H) among them: what optim=muon hands to
        Muon (each carries `use_muon = True`, DeepSpeed's name for the same flag). The frozen
        embedding and the draft lm_head, the model's input and output maps, are not among them
        (Keller Jordan's Muon recipe and speculators keep those on AdamW), nor the 1-D norms.
        The flag is an attribute of each Parameter: copy.deepcopy of the module drops it."""
        return [p for name, p in self.named_parameters()
                if p.ndim == 2 and name not in ("embed_tokens.weight", "lm_head.weight")]

    def num_trainable_parameters(self) -> int:
        """Number of parameters the optimiser updates (everything but the frozen embedding)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
