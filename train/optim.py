"""Optimizer and LR schedule: bf16 parameters, fp32 AdamW state and master weights.

Under DDP the model keeps bf16 parameters (half the memory and bandwidth of fp32) and
`MasterAdamW` keeps an fp32 copy of each for the update, so small updates are not lost to
bf16 rounding. Under DeepSpeed ZeRO the engine does the same itself (bf16 enabled in its
config), so a plain torch AdamW is handed to it.

On CUDA the update is one fused Triton pass per tensor (`kernels.adamw.master_adamw_`; its
docstring gives the traffic saved, the compact masters of `optim.compact_masters` and the
stochastically rounded bf16 moments of `optim.moments`); the CPU runs the kernel's torch twin
for bf16 moments. The optimizer state is a torch AdamW state either way, and checkpoints hold
fp32 masters in both master modes, so they load into either. A checkpoint of either moment
dtype loads into either mode (converted at load; exact only within one mode).

optim=muon (`optim.name`) builds `train.muon.MuonAdamW`, or under ZeRO-1/2
`train.muon.zero_muon` (that module's docstring)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from eyas.train.choices import Schedule
from eyas.train.muon import (MuonAdamW, adamw_settings, follow_parameters, muon_settings,
                             split_muon, step_on_masters, zero_lr_ratio, zero_muon)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over fp32 master copies of (bf16) parameters.

    `param_groups` are the model's own parameters, so accelerate, clipping and LR schedulers
    work unchanged; `step()` updates the fp32 masters from the parameters' gradients and writes
    the result back rounded to the parameter dtype. impl: "triton" (fused kernel), "torch"
    (fp32 gradient copies + torch AdamW, fused on CUDA), as `train.resolve.resolve` decides it.

    `step(skip=flag)` takes the decision to skip the update as a 0-dim device tensor of any
    dtype (nonzero = skip; e.g. a non-finite gradient norm) instead of a host bool: a skipped
    step leaves parameters, masters, moments and step counters bitwise unchanged. The triton
    path decides on the device, so the trainer never waits for the GPU to find out; the torch
    path (the CPU, or the fallback on CUDA) reads the flag on the host.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, impl: str = "torch", compact: bool = False,
                 moments: str = "fp32"):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        if impl not in ("triton", "torch"):
            raise ValueError(f"MasterAdamW impl must be triton or torch, got {impl!r}")
        if compact and (impl != "triton" or any(p.dtype != torch.bfloat16 for g in
                                                self.param_groups for p in g["params"])):
            raise ValueError("MasterAdamW(compact=True) needs impl='triton' and bf16 parameters "
                             "(set optim.compact_masters=false)")
        if moments not in ("fp32", "bf16"):
            raise ValueError(f"MasterAdamW moments must be fp32 or bf16, got {moments!r}")
        self.compact = bool(compact)
        self.moment_dtype = torch.bfloat16 if moments == "bf16" else torch.float32
        self.masters = [[self._new_master(p) for p in g["params"]] for g in self.param_groups]
        fused = all(p.is_cuda for g in self.param_groups for p in g["params"]) and not compact
        groups = [dict(params=m, **{k: v for k, v in g.items() if k != "params"})
                  for g, m in zip(self.param_groups, self.masters)]
        # compact: a state container only (keyed by the int16 masters; the kernel updates it)
        self.inner = torch.optim.AdamW(groups, fused=fused or None)
        self.impl = impl

    def _new_master(self, p: torch.Tensor) -> torch.Tensor:
        """fp32 copy of p, or (compact) its 16 missing bits: zero, as p is exactly bf16."""
        if self.compact:
            return torch.zeros(p.shape, dtype=torch.int16, device=p.device)
        return p.detach().float().clone()

    def describe(self) -> str:
        """One line for the log: the update, the masters and the moments."""
        update = "fused Triton" if self.impl == "triton" else (
            "torch twin" if self.moment_dtype != torch.float32 else "torch AdamW")
        masters = "compact fp32 masters" if self.compact else "fp32 masters"
        moments = "bf16" if self.moment_dtype == torch.bfloat16 else "fp32"
        return f"MasterAdamW ({update} update, {masters}, {moments} moments)"

    def master_weights(self) -> list[list[torch.Tensor]]:
        """The fp32 masters, per group (rebuilt from parameter + low bits when compact)."""
        if not self.compact:
            return self.masters
        from eyas.kernels.adamw import join_master
        return [[join_master(p, m) for p, m in zip(g["params"], ms)]
                for g, ms in zip(self.param_groups, self.masters)]

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, master) of every group."""
        return [(p, m) for g, ms in zip(self.param_groups, self.masters)
                for p, m in zip(g["params"], ms)]

    def _follow_parameters(self) -> None:
        """Masters and moments on their parameters' device (`train.muon.follow_parameters`).
        The step counters stay where torch AdamW keeps them (the fused path moves its own)."""
        follow_parameters(self._pairs(), self.inner.state, ("exp_avg", "exp_avg_sq"))

    @torch.no_grad()
    def step(self, closure=None, *, skip: torch.Tensor | None = None):
        """One AdamW update; with a nonzero 0-dim tensor `skip`, none (class docstring)."""
        self._follow_parameters()
        if self.impl == "triton" or self.moment_dtype != torch.float32:
            return self._fused_step(skip)
        if skip is not None and bool(skip):
            return
        for group, inner_group in zip(self.param_groups, self.inner.param_groups):
            for key in ("lr", "betas", "eps", "weight_decay"):
                inner_group[key] = group[key]
        step_on_masters(self.inner, self._pairs())

    def _fused_step(self, skip: torch.Tensor | None):
        """The same update through kernels.adamw (state kept in torch AdamW's layout): the
        Triton kernel, or its torch twin for bf16 moments off Triton."""
        from eyas.kernels.adamw import master_adamw_, master_adamw_reference_
        update = master_adamw_ if self.impl == "triton" else master_adamw_reference_
        mdt = self.moment_dtype
        first_seed = 0                     # each tensor its own random-bit stream
        for group, inner_group, masters in zip(self.param_groups, self.inner.param_groups,
                                               self.masters):
            for key in ("lr", "betas", "eps", "weight_decay"):
                inner_group[key] = group[key]
            todo = [(p, m) for p, m in zip(group["params"], masters) if p.grad is not None]
            for _, m in todo:
                st = self.inner.state[m]
                if not st:                           # torch AdamW's own (fused) initial state
                    st["step"] = torch.zeros((), dtype=torch.float32, device=m.device)
                    st["exp_avg"] = torch.zeros(m.shape, dtype=mdt, device=m.device)
                    st["exp_avg_sq"] = torch.zeros(m.shape, dtype=mdt, device=m.device)
                elif st["step"].device != m.device or st["step"].dtype != torch.float32:
                    st["step"] = st["step"].to(m.device, torch.float32)   # e.g. a CPU checkpoint
            if group.get("amsgrad") or group.get("maximize"):
                raise NotImplementedError("MasterAdamW(impl='triton') has no amsgrad/maximize")
            states = [self.inner.state[m] for _, m in todo]
            b1, b2 = group["betas"]
            update([p for p, _ in todo], [p.grad for p, _ in todo], [m for _, m in todo],
                   [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                   [s["step"] for s in states], lr=group["lr"], beta1=b1, beta2=b2,
                   eps=group["eps"], weight_decay=group["weight_decay"], skip=skip,
                   first_seed=first_seed)
            first_seed += len(group["params"])

    def state_dict(self):
        return {"inner": self.inner.state_dict(),
                "masters": [[m.clone() for m in ms] for ms in self.master_weights()],
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]}

    def load_state_dict(self, state):
        self._follow_parameters()
        self.inner.load_state_dict(state["inner"])
        # torch casts moments to the master's dtype; a checkpoint of the other mode converts here
        for st in self.inner.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st and st[key].dtype != self.moment_dtype:
                    st[key] = st[key].to(self.moment_dtype).contiguous()
        with torch.no_grad():
            if self.compact:
                from eyas.kernels.adamw import split_master
                for group, ms, saved in zip(self.param_groups, self.masters, state["masters"]):
                    for p, m, s in zip(group["params"], ms, saved):
                        hi, lo = split_master(s.to(p.device))
                        p.copy_(hi)
                        m.copy_(lo)
            else:
                for (p, m), s in zip(self._pairs(), (s for ms in state["masters"] for s in ms)):
                    m.copy_(s)
                    p.copy_(m)
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)


def build_optimizer(params, optim_cfg, *, master_weights: bool, impl: str = "torch",
                    compact: bool = False, moments: str = "fp32",
                    deepspeed: bool | None = None) -> torch.optim.Optimizer:
    """The `optim` group's optimizer: AdamW (below), or with optim.name=muon `MuonAdamW`
    (train/muon.py): torch's Muon for the hidden matrices, that AdamW for the rest; under
    DeepSpeed (`deepspeed`; None: whether this process's accelerate state is DeepSpeed's)
    DeepSpeed's MuonWithAuxAdam (`train.muon.zero_muon`), which only ZeRO-1/2 orthogonalise."""
    params = [p for p in params if p.requires_grad]
    if getattr(optim_cfg, "name", "adamw") == "muon":       # a str Enum equals its value
        muon, other = split_muon(params)
        if deepspeed is None:       # this process's Accelerator, built before the optimizer
            from accelerate.state import AcceleratorState, is_initialized
            from accelerate.utils import DistributedType
            deepspeed = is_initialized() and \
                AcceleratorState().distributed_type == DistributedType.DEEPSPEED
        if deepspeed:
            return zero_muon(muon, other, optim_cfg)
        adamw = build_adamw(other, optim_cfg, master_weights=master_weights, impl=impl,
                            compact=compact, moments=moments)
        return MuonAdamW(muon, adamw, masters=master_weights, **muon_settings(optim_cfg))
    return build_adamw(params, optim_cfg, master_weights=master_weights, impl=impl,
                       compact=compact, moments=moments)


def build_adamw(params, optim_cfg, *, master_weights: bool, impl: str = "torch",
                compact: bool = False, moments: str = "fp32") -> torch.optim.Optimizer:
    """AdamW of the `optim` group: `MasterAdamW` (update `impl` and `compact` masters, as
    `train.resolve.resolve` decides them) over bf16 parameters, else torch AdamW (fused when
    the parameters are on CUDA)."""
    kw = adamw_settings(optim_cfg)
    if master_weights:
        return MasterAdamW(params, impl=impl, compact=compact, moments=moments, **kw)
    if moments != "fp32":
        raise ValueError(f"optim.moments={moments} needs the master-weight update (DDP with "
                         f"bf16 parameters); set optim.moments=fp32")
    fused = all(p.is_cuda for p in params) or None
    return torch.optim.AdamW(params, fused=fused, **kw)


def warmup_steps(optim_cfg, total_steps: int) -> int:
    if optim_cfg.warmup_steps is not None:
        return int(optim_cfg.warmup_steps)
    return int(math.ceil(optim_cfg.warmup_ratio * total_steps))


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> LambdaLR:
    """Linear warmup, then cosine to 0, linear to 0, or constant.

    Not transformers.get_scheduler: its warmup factor is step/warmup, so the first optimizer
    update runs at lr 0 and is lost (the parameters do not move); here it is (step+1)/(warmup+1)
    and every update counts. Past that, the rates are get_scheduler's with the warmup one step
    longer, read one step later: equal for cosine and constant, within one ulp for linear
    (tests/train/test_optim_schedule.py compares them value by value)."""
    warm = warmup_steps(optim_cfg, total_steps)
    kind = Schedule(optim_cfg.schedule)
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if kind == Schedule.constant:
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if kind == Schedule.linear:
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def _group_settings(optim_cfg, group: dict) -> dict[str, tuple[str, object]]:
    """What the config wants in one param group, config key -> (group key, value): a Muon
    group of `MuonAdamW` (marked "muon") or of DeepSpeed's MuonWithAuxAdam ("use_muon") takes
    the optim.muon_* settings, the others AdamW's. The "lr" entry is the group's peak rate
    (the schedule's base); a ZeRO Muon group's lr and weight decay carry its `_zero_ratio`."""
    if group.get("muon") or group.get("use_muon"):
        kw = muon_settings(optim_cfg)
        lr_key = "optim.lr" if optim_cfg.muon_lr is None else "optim.muon_lr"
        wd_key = ("optim.weight_decay" if optim_cfg.muon_weight_decay is None
                  else "optim.muon_weight_decay")
        ratio = _zero_ratio(group, kw["adjust_lr_fn"])
        if ratio != 1.0:
            kw["lr"], kw["weight_decay"] = kw["lr"] * ratio, kw["weight_decay"] / ratio
        return {wd_key: ("weight_decay", kw["weight_decay"]),
                "optim.muon_momentum": ("momentum", kw["momentum"]),
                "optim.muon_nesterov": ("nesterov", kw["nesterov"]),
                "optim.muon_ns_steps": ("ns_steps", kw["ns_steps"]),
                "optim.muon_adjust_lr": ("adjust_lr_fn", kw["adjust_lr_fn"]),
                lr_key: ("lr", kw["lr"])}
    return {f"optim.{key}": (key, value) for key, value in adamw_settings(optim_cfg).items()}


def _zero_ratio(group: dict, adjust_lr_fn: str | None = None) -> float:
    """A ZeRO Muon group's factor on the configured lr (`train.muon.zero_lr_ratio` of its
    matrix shape, by `adjust_lr_fn` or the group's own); 1.0 for every other group."""
    if "muon_shape" not in group:
        return 1.0
    return zero_lr_ratio(group["muon_shape"], adjust_lr_fn or group["adjust_lr_fn"])


def _as_configured(key: str, value, ratio: float):
    """A group's lr / weight_decay as the config states it (a ZeRO Muon group's unscaled)."""
    if ratio == 1.0 or key not in ("lr", "weight_decay"):
        return value
    return float(f"{value / ratio if key == 'lr' else value * ratio:.12g}")


def apply_optim_settings(scheduler: LambdaLR, optim_cfg) -> list[str]:
    """Write the config's optim settings (lr, betas, eps, weight_decay; with optim=muon the
    optim.muon_* ones into Muon's groups) into a resumed optimizer and its schedule (a
    checkpoint's own values would otherwise win); the rate of the current step is recomputed
    from the new peak lr. Returns one line per changed setting (empty when the checkpoint
    already had the config's values, as every exact resume does)."""
    groups = scheduler.optimizer.param_groups
    changed: dict[str, str] = {}
    peaks = []
    for base, g in zip(scheduler.base_lrs, groups):
        wanted = _group_settings(optim_cfg, g)
        old = _zero_ratio(g)
        new = _zero_ratio(g, wanted.get("optim.muon_adjust_lr", (None, None))[1])
        for name, (key, value) in wanted.items():
            have = base if key == "lr" else tuple(g[key]) if key == "betas" else g[key]
            if have != value:
                was, now = _as_configured(key, have, old), _as_configured(key, value, new)
                if was != now:          # else only a ZeRO group's ratio changed (adjust_lr)
                    changed.setdefault(name, f"{name}: {was} in the checkpoint, {now} now")
                if key != "lr":
                    g[key] = value
            if key == "lr":
                peaks.append(value)
    if peaks != list(scheduler.base_lrs):
        scheduler.base_lrs = peaks
        for g, f, peak in zip(groups, scheduler.lr_lambdas, peaks):
            g["lr"] = peak * f(scheduler.last_epoch)
        scheduler._last_lr = [g["lr"] for g in groups]
    return list(changed.values())
