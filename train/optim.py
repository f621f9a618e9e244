"""Optimizer and LR schedule: bf16 parameters, fp32 AdamW state and master weights.

Under DDP the model keeps bf16 parameters (half the memory and bandwidth of fp32) and
`MasterAdamW` keeps an fp32 copy of each for the update, so small updates are not lost to
bf16 rounding. Under DeepSpeed ZeRO the engine does the same itself (bf16 enabled in its
config), so a plain torch AdamW is handed to it.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from train.config import Schedule


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over fp32 master copies of (bf16) parameters.

    `param_groups` are the model's own parameters, so accelerate, clipping and LR schedulers
    work unchanged; `step()` moves their gradients onto the fp32 masters, runs torch AdamW
    (fused on CUDA) there and writes the result back rounded to the parameter dtype.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.masters = [[p.detach().float().clone() for p in g["params"]]
                        for g in self.param_groups]
        fused = all(p.is_cuda for g in self.param_groups for p in g["params"])
        groups = [dict(params=m, **{k: v for k, v in g.items() if k != "params"})
                  for g, m in zip(self.param_groups, self.masters)]
        self.inner = torch.optim.AdamW(groups, fused=fused or None)

    @torch.no_grad()
    def step(self, closure=None):
        for group, inner_group, masters in zip(self.param_groups, self.inner.param_groups,
                                               self.masters):
            for key in ("lr", "betas", "eps", "weight_decay"):
                inner_group[key] = group[key]
            for p, m in zip(group["params"], masters):
                m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for group, masters in zip(self.param_groups, self.masters):
            for p, m in zip(group["params"], masters):
                p.copy_(m)
                m.grad = None

    def state_dict(self):
        return {"inner": self.inner.state_dict(),
                "masters": [[m.clone() for m in ms] for ms in self.masters],
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for ms, saved in zip(self.masters, state["masters"]):
                for m, s in zip(ms, saved):
                    m.copy_(s)
            for group, masters in zip(self.param_groups, self.masters):
                for p, m in zip(group["params"], masters):
                    p.copy_(m)
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)


def build_optimizer(params, optim_cfg, *, master_weights: bool) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    kw = dict(lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
              weight_decay=optim_cfg.weight_decay)
    if master_weights:
        return MasterAdamW(params, **kw)
    fused = all(p.is_cuda for p in params) or None
    return torch.optim.AdamW(params, fused=fused, **kw)


def warmup_steps(optim_cfg, total_steps: int) -> int:
    if optim_cfg.warmup_steps is not None:
        return int(optim_cfg.warmup_steps)
    return int(math.ceil(optim_cfg.warmup_ratio * total_steps))


def build_scheduler(optimizer, optim_cfg, total_steps: int) -> LambdaLR:
    """Linear warmup, then cosine to 0, linear to 0, or constant."""
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
