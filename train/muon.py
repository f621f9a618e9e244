"""optim=muon: torch's Muon for the hidden weight matrices, AdamW for everything else.

Which parameter goes where is the drafter's own list (`Eagle3Drafter.hidden_matrices`, each
flagged `use_muon = True`): the 2-D weights of hidden layers, fc (the 3H -> H projection of the
aux states) among them, so fc, q/k/v/o and gate/up/down go to `torch.optim.Muon`. AdamW keeps
the rest: the 1-D norm weights, any bias, the embedding when trainable and the draft lm_head.
Embeddings and output heads stay on AdamW as in Keller Jordan's Muon recipe and speculators:
Muon's orthogonalised update suits hidden matrices, not a map from or to the vocabulary.
Muon's lr scale is torch's `adjust_lr_fn` (`optim.muon_adjust_lr`; by default
"match_rms_adamw", Moonshot's 0.2·sqrt(max(rows, cols)), so `optim.lr` and
`optim.weight_decay` mean the same for both halves).

`MuonAdamW` is the one optimizer the trainer sees: its `param_groups` are the Muon groups
followed by the AdamW groups, so accelerate, gradient clipping, the LambdaLR schedule and
`apply_optim_settings` treat it as any torch optimizer; `step(skip=flag)` takes
`MasterAdamW.step`'s skip flag (read on the host here). With master weights (DDP with bf16
parameters) Muon runs on fp32 copies of its matrices, as `MasterAdamW` does for the rest.

Under DeepSpeed ZeRO-1/2 the optimizer is DeepSpeed's own `MuonWithAuxAdam`
(deepspeed.runtime.zero.muon, 0.19.8 here; `zero_muon`), handed to the engine as any client
optimizer (why, the accuracy measured and the settings refused: docs/training.md, "DDP and
DeepSpeed"). The ZeRO optimizer runs `muon_update` on each whole `use_muon` matrix (its full
gradient all-reduced to every rank holding part of it) when it builds the gradient partitions,
keeps the momentum in its own optimizer state (checkpointed with it), and MuonWithAuxAdam
applies the result to the flat fp32 partition as p·(1 − lr·wd) − lr·update. The rest is
torch's AdamW (MuonWithAuxAdam's aux optimizer) on ZeRO's fp32 partitions, as under
optim=adamw with ZeRO.

How the ZeRO update maps onto torch's Muon:
- lr scale: DeepSpeed multiplies each orthogonalised update by max(1, rows/cols)^0.5 (Keller
  Jordan's scale, torch's "original"); torch by `adjust_lr_fn`'s factor. Each Muon matrix
  shape is its own param group, whose lr is the configured Muon lr times ratio = torch's
  factor / DeepSpeed's (`zero_lr_ratio`; 1 for "original") and whose weight_decay is the
  configured one divided by the same ratio, so lr·wd (torch decays by the unadjusted lr) and
  the update's step are torch's. The LambdaLR schedule multiplies each group's own base lr, so
  the ratio holds at every step; `apply_optim_settings` rescales a resumed group the same way.
- Newton-Schulz: DeepSpeed's "gram" iteration (ns_method; its default), torch's quintic with
  torch's coefficients and 5 steps, iterated on the Gram matrix X·Xᵀ with a restart at step
  2 (the same polynomial in exact arithmetic), torch.compile'd, in fp16 where the accelerator
  has fp16 matmuls (GPUs), else fp32 (the CPU here); torch iterates X itself in bf16. Gram is
  the closer of DeepSpeed's two to torch's step: measured against the fp64 iteration, torch's
  bf16 one is 1-1.5 % off on random matrices (14 % on low-rank ones), Gram in fp16 (run on
  the CPU) 0.3-0.6 % (2 %), DeepSpeed's "standard" bf16 iteration 2.5-3.5 % (19 %).
- momentum, nesterov, ns_steps: DeepSpeed's momentum is torch's (m ← lerp(m, g, 1−β), Nesterov
  update lerp(g, m, β)), but its ZeRO path always runs Nesterov with 5 steps. The momentum is
  kept in the gradient's dtype (bf16 with bf16 parameters; fp32 under DDP's masters).
- clipping: DeepSpeed clips the orthogonalised Muon update with the AdamW gradients (its norm
  is ~sqrt(Σ min(rows, cols)) whatever the gradient), so any clip would shrink Muon's steps
  (DDP clips the gradients before Muon). The logged train/grad_norm there includes those
  updates.
- a NaN/inf step (bf16, the engine's own check): DeepSpeed stages the new momentum and
  commits it only when the step is kept (its stage_1_and_2), so a skipped step leaves the
  momentum as it was, as under DDP."""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)


def split_muon(params) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's, AdamW's) of the trainable `params`: those flagged `use_muon` (the drafter's
    hidden matrices) and the rest. A flagged parameter that is not 2-D is an error."""
    muon, other = [], []
    for p in params:
        if not p.requires_grad:
            continue
        if getattr(p, "use_muon", False):
            if p.ndim != 2:
                raise ValueError(f"a parameter of shape {list(p.shape)} is flagged use_muon, "
                                 f"but Muon updates 2-D matrices only")
            muon.append(p)
        else:
            other.append(p)
    if not muon:
        raise ValueError("optim=muon found no hidden weight matrix to give Muon (no trainable "
                         "parameter carries use_muon = True); use optim=adamw")
    return muon, other


def adamw_settings(optim_cfg) -> dict:
    """torch AdamW's keyword arguments from the `optim` group (lr last, as `muon_settings`)."""
    return dict(betas=tuple(float(b) for b in optim_cfg.betas), eps=float(optim_cfg.eps),
                weight_decay=float(optim_cfg.weight_decay), lr=float(optim_cfg.lr))


def muon_settings(optim_cfg) -> dict:
    """torch.optim.Muon's keyword arguments from the `optim` group (null = AdamW's value)."""
    adjust = getattr(optim_cfg.muon_adjust_lr, "value", optim_cfg.muon_adjust_lr)
    return dict(lr=float(optim_cfg.lr if optim_cfg.muon_lr is None else optim_cfg.muon_lr),
                weight_decay=float(optim_cfg.weight_decay if optim_cfg.muon_weight_decay is None
                                   else optim_cfg.muon_weight_decay),
                momentum=float(optim_cfg.muon_momentum), nesterov=bool(optim_cfg.muon_nesterov),
                ns_steps=int(optim_cfg.muon_ns_steps), adjust_lr_fn=str(adjust))


#: the keys of a Muon param group that its settings (and `apply_optim_settings`) may change
MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr_fn")


#: what DeepSpeed's ZeRO-1/2 Muon path runs, whatever the group says (module docstring)
ZERO_NESTEROV, ZERO_NS_STEPS, ZERO_NS_METHOD = True, 5, "gram"


def zero_lr_ratio(shape, adjust_lr_fn: str) -> float:
    """The factor on a ZeRO Muon group's lr (and divisor of its weight decay) that makes
    DeepSpeed's step torch's: torch's lr scale over DeepSpeed's (1.0 for "original")."""
    rows, cols = shape
    # torch.optim.Muon's per-matrix lr factor (its `_adjust_lr`) for a [rows, cols] matrix
    torch_scale = (0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw"
                   else math.sqrt(max(1, rows / cols)))
    # DeepSpeed's `muon_update` multiplies each orthogonalised update by its
    # `_aspect_ratio_scale`, sqrt(max(1, rows/cols))
    return torch_scale / (math.sqrt(rows / cols) if rows > cols else 1.0)


def zero_muon(muon_params, other_params, optim_cfg):
    """DeepSpeed's `MuonWithAuxAdam` for ZeRO-1/2 (module docstring): the AdamW group first
    (optim.lr, betas, eps, weight_decay; torch AdamW as its aux optimizer), then one Muon group
    per matrix shape, with lr × `zero_lr_ratio` and weight_decay ÷ it. Each Muon group also
    records its `muon_shape` and what DeepSpeed runs (nesterov, ns_steps, adjust_lr_fn) for
    `apply_optim_settings`; its lr / weight decay values are DeepSpeed's, scaled."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype
    kw = muon_settings(optim_cfg)
    groups = []
    if other_params:
        groups.append(dict(params=list(other_params), use_muon=False,
                           **adamw_settings(optim_cfg)))
    shapes: dict[tuple[int, int], list] = {}
    for p in muon_params:
        shapes.setdefault(tuple(p.shape), []).append(p)
    for shape, ps in shapes.items():
        ratio = zero_lr_ratio(shape, kw["adjust_lr_fn"])
        groups.append(dict(params=ps, use_muon=True, lr=kw["lr"] * ratio,
                           weight_decay=kw["weight_decay"] / ratio, momentum=kw["momentum"],
                           ns_method=ZERO_NS_METHOD, nesterov=ZERO_NESTEROV,
                           ns_steps=ZERO_NS_STEPS, adjust_lr_fn=kw["adjust_lr_fn"],
                           muon_shape=shape))
    fused = bool(other_params) and all(p.is_cuda for p in other_params) or None
    opt = MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW,
                          adam_optimizer_kwargs=dict(fused=fused))
    n_adamw = len(other_params)
    dtype = str(ns_compute_dtype(ZERO_NS_METHOD)).removeprefix("torch.")

    def describe() -> str:
        return (f"DeepSpeed MuonWithAuxAdam: its ZeRO Muon on {len(muon_params)} hidden "
                f"matrices in {len(shapes)} shape groups ({kw['adjust_lr_fn']} lr as torch's, "
                f"{ZERO_NS_STEPS} {ZERO_NS_METHOD} Newton-Schulz steps in {dtype}) + torch "
                f"AdamW on the other {n_adamw} tensors")

    opt.describe = describe       # the trainer logs it (the class must stay DeepSpeed's own)
    return opt


def follow_parameters(pairs, state: dict, keys: tuple[str, ...]) -> None:
    """Each fp32 master, and its `keys` in the inner optimizer's `state`, onto its parameter's
    device (`pairs`: (parameter, master)). The optimizer may be built before the model is moved
    (accelerate.prepare moves the parameters in place afterwards): masters built on the CPU
    then follow the parameters."""
    for p, m in pairs:
        if m.device == p.device:
            continue
        m.data = m.data.to(p.device)
        st = state.get(m, {})
        for key in keys:
            if key in st:
                st[key] = st[key].to(p.device)


def step_on_masters(inner: torch.optim.Optimizer, pairs: list) -> None:
    """`inner`'s step over fp32 masters from fp32 copies of their parameters' gradients, each
    result written back to its parameter rounded (`pairs`: (parameter, master)); MasterAdamW's
    torch path and MuonAdamW's masters."""
    for p, m in pairs:
        m.grad = None if p.grad is None else p.grad.float()
    inner.step()
    for p, m in pairs:
        p.copy_(m)
        m.grad = None


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over `muon_params` plus an already built AdamW (torch's or
    `MasterAdamW`) over the rest, as one optimizer (module docstring).

    `masters`: Muon updates fp32 copies of its (bf16) matrices and writes them back rounded,
    as MasterAdamW does. Muon's groups carry `"muon": True`. `state_dict()` holds both inner
    optimizers' states, the fp32 masters and every group's settings; `load_state_dict` of it
    continues bitwise as the optimizer it came from would have.
    """

    def __init__(self, muon_params, adamw: torch.optim.Optimizer, *, masters: bool = False,
                 **muon_kw):
        muon_params = list(muon_params)
        super().__init__(muon_params, {k: muon_kw[k] for k in MUON_KEYS if k in muon_kw})
        self.masters = [p.detach().float().clone() for p in muon_params] if masters else None
        self.muon = torch.optim.Muon(self.masters if masters else muon_params, **muon_kw)
        if masters:    # a model-facing group (the scheduler's), copied in at each step
            self.param_groups[0]["muon"] = True
            self._muon_groups = list(self.param_groups)
        else:          # Muon's own group (`_join_groups`)
            self.muon.param_groups[0]["muon"] = True
        self.adamw = adamw
        self._join_groups()

    def _join_groups(self) -> None:
        """param_groups = Muon's then AdamW's, the inner optimizers' own dicts (rejoined after
        a load, which gives torch optimizers new group dicts)."""
        if self.masters is None:
            self._muon_groups = self.muon.param_groups
        self.param_groups = [*self._muon_groups, *self.adamw.param_groups]

    def describe(self) -> str:
        """One line for the log: the two halves and what each updates."""
        g = self._muon_groups[0]
        n_muon = len(g["params"])
        n_adamw = sum(len(a["params"]) for a in self.adamw.param_groups)
        adamw = (self.adamw.describe() if hasattr(self.adamw, "describe") else
                 f"torch AdamW ({self.adamw.param_groups[0]['params'][0].dtype})")
        masters = ", fp32 masters" if self.masters is not None else ""
        return (f"torch Muon on {n_muon} hidden matrices ({g['adjust_lr_fn']} lr, "
                f"{g['ns_steps']} Newton-Schulz steps{masters}) + {adamw} on the other "
                f"{n_adamw} tensors")

    def _follow_parameters(self) -> None:
        """Masters and momenta on their parameters' device (`follow_parameters`)."""
        follow_parameters(zip(self._muon_groups[0]["params"], self.masters), self.muon.state,
                          ("momentum_buffer",))

    @torch.no_grad()
    def step(self, closure=None, *, skip: torch.Tensor | None = None):
        """Muon's step, then AdamW's; none with a nonzero 0-dim tensor `skip` (read here)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if skip is not None and bool(skip):
            return loss
        if self.masters is None:
            self.muon.step()
        else:
            self._master_step()
        self.adamw.step()
        return loss

    def _master_step(self) -> None:
        self._follow_parameters()
        group, inner = self._muon_groups[0], self.muon.param_groups[0]
        inner.update({k: group[k] for k in MUON_KEYS if k in group})
        step_on_masters(self.muon, list(zip(group["params"], self.masters)))

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict(),
                "masters": None if self.masters is None else [m.clone() for m in self.masters],
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]}

    def load_state_dict(self, state):
        if not isinstance(state, dict) or "muon" not in state or "adamw" not in state:
            raise ValueError("this optimizer state was not written by optim=muon: resume with "
                             "the optim it was written with, or start a new run")
        if (state["masters"] is None) != (self.masters is None):
            raise ValueError("this optim=muon state was written with"
                             f"{'out' if state['masters'] is None else ''} master weights "
                             f"(train.param_dtype): resume with the checkpoint's param_dtype")
        if self.masters is not None:
            self._follow_parameters()
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        if self.masters is not None:
            with torch.no_grad():
                for p, m, saved in zip(self._muon_groups[0]["params"], self.masters,
                                       state["masters"]):
                    m.copy_(saved)
                    p.copy_(m)
        self._join_groups()
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
