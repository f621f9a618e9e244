"""optim=muon: torch's Muon for the hidden weight matrices, AdamW for everything else.

Which parameter goes where is the drafter's own list (`Eagle3Drafter.hidden_matrices`, each
flagged `use_muon = True`): the 2-D weights of hidden layers, fc (the 3H -> H projection of the
aux states) among them, so fc, q/k/v/o and gate/up/down go to `torch.optim.Muon`. AdamW keeps
the rest: the 1-D norm weights, any bias, the embedding when trainable and the draft lm_head.
Embeddings and output heads stay on AdamW as in Keller Jordan's Muon recipe and speculators:
Muon's orthogonalised update suits hidden matrices, not a map from or to the vocabulary.

Muon's lr scale is torch's `adjust_lr_fn`, by default "match_rms_adamw" (Moonshot's
0.2·sqrt(max(rows, cols))): Muon's updates then have AdamW's RMS, so `optim.lr` (and
`optim.weight_decay`) mean the same for both halves; `optim.muon_lr` and
`optim.muon_weight_decay` set Muon's apart.

`MuonAdamW` is the one optimizer the trainer sees: its `param_groups` are the Muon groups
followed by the AdamW groups, so accelerate, gradient clipping, the LambdaLR schedule and
`apply_optim_settings` treat it as any torch optimizer; `step(skip=flag)` takes
`MasterAdamW.step`'s skip flag (read on the host here). With master weights (DDP with bf16
parameters) Muon runs on fp32 copies of its matrices, as `MasterAdamW` does for the rest.

DeepSpeed ZeRO is refused (train/limits.py): ZeRO flattens the parameters into 1-D partitions
before its client optimizer sees them, and torch's Muon orthogonalises whole matrices.
DeepSpeed's own Muon (deepspeed.runtime.zero.muon.MuonWithAuxAdam; 0.19.8 here, reading the
same `use_muon` flag) runs inside ZeRO-1/2 but is another update: Keller Jordan's lr scale
only (no match_rms_adamw, so optim.lr would mean something else there), its own compiled
Newton-Schulz, its own inline Adam for the rest, its momentum kept by the ZeRO optimizer.
"""

from __future__ import annotations

import logging

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
        """Masters and momenta on their parameters' device (see MasterAdamW: the optimizer may
        be built before accelerate moves the model)."""
        for p, m in zip(self._muon_groups[0]["params"], self.masters):
            if m.device != p.device:
                m.data = m.data.to(p.device)
                st = self.muon.state.get(m, {})
                if "momentum_buffer" in st:
                    st["momentum_buffer"] = st["momentum_buffer"].to(p.device)

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
        for p, m in zip(group["params"], self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.muon.step()
        for p, m in zip(group["params"], self.masters):
            p.copy_(m)
            m.grad = None

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
