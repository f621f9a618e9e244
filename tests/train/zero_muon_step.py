"""Two optimizer steps of optim=muon under DeepSpeed ZeRO (built as the trainer builds it: the
eyas Accelerator, `build_optimizer`, accelerate.prepare) against `MuonAdamW` (torch's Muon +
AdamW, the DDP optimizer) from the same start with the same gradients, and against torch's
Muon algorithm in fp64 (`exact`: what both approximate, torch in bf16). Run under
`accelerate launch --multi_gpu --num_processes 2 tests/train/zero_muon_step.py OUT.json
zero1 zero2` (tests/train/test_muon.py): each rank's loss is sum(p * G), so the averaged
gradient is G exactly. Rank 0 writes, per stage, step and parameter, ‖Δzero − Δddp‖ / ‖Δddp‖
of the updates ("ddp") and ‖Δzero − Δexact‖ / ‖Δexact‖ ("exact", Muon's matrices)."""

import json
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype  # noqa: E402

from eyas.train.dist import build_accelerator  # noqa: E402
from eyas.train.optim import build_optimizer  # noqa: E402
from tests.train.test_config import _compose  # noqa: E402
from tests.train.test_muon import _drafter  # noqa: E402


class Probe(nn.Module):
    """sum(p * G) over the drafter's trainable parameters: its gradient is G."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, grads):
        ps = [p for p in self.drafter.parameters() if p.requires_grad]
        return sum((p * g).sum() for p, g in zip(ps, grads))


def grads_for(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def newton_schulz64(G, steps=5):
    """torch.optim.Muon's Newton-Schulz iteration in fp64 (torch runs it in bf16)."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.double().T if G.size(0) > G.size(1) else G.double()
    X = X / X.norm().clamp(min=1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.size(0) > G.size(1) else X


def exact_muon_update(p, g, buf, cfg):
    """torch Muon's step of p (nesterov, match_rms_adamw) in fp64; updates the momentum buf."""
    buf.lerp_(g.double(), 1 - cfg.muon_momentum)
    u = g.double().lerp(buf, cfg.muon_momentum)
    lr = cfg.lr * 0.2 * max(p.shape) ** 0.5
    return -p.double() * cfg.lr * cfg.weight_decay - lr * newton_schulz64(u)


def main(out: str, dists: list[str]) -> None:
    report = {dist: one_stage(dist) for dist in dists}
    if report[dists[0]]["rank"] == 0:
        Path(out).write_text(json.dumps(report, indent=1))


def one_stage(dist: str) -> dict:
    cfg = _compose(["optim=muon", f"dist={dist}", "optim.clip_grad_norm=0", "optim.lr=1e-2",
                    "optim.weight_decay=0.1", "optim.schedule=constant", "optim.warmup_steps=0"])
    acc = build_accelerator(cfg.dist, cfg.optim, tempfile.mkdtemp(), bf16=False)
    drafter, ref = _drafter(), _drafter()
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    opt = build_optimizer(drafter.parameters(), cfg.optim, master_weights=False)
    ref_opt = build_optimizer(ref.parameters(), cfg.optim, master_weights=False, deepspeed=False)
    module, opt = acc.prepare(Probe(drafter), opt)
    kind = type(module.optimizer).__name__, type(module.optimizer.optimizer).__name__
    live = [p for p in drafter.parameters() if p.requires_grad]
    mirror = [p for p in ref.parameters() if p.requires_grad]
    report = {"world_size": acc.num_processes, "engine": acc.distributed_type.value,
              "optimizer": list(kind), "rank": acc.process_index,
              "stage": module.zero_optimization_stage(),
              "ns_dtype": str(ns_compute_dtype("gram")), "steps": []}
    bufs = [torch.zeros(p.shape, dtype=torch.float64) for p in live]
    for seed in (1, 2):
        before = [p.detach().clone() for p in live]
        grads = grads_for(live, seed)
        acc.backward(module(grads))
        opt.step()
        opt.zero_grad()
        ref_before = [p.detach().clone() for p in mirror]
        for p, g in zip(mirror, grads):
            p.grad = g.clone()
        ref_opt.step()
        step = {}
        for name, p, b, q, qb, g, buf in zip(names, live, before, mirror, ref_before, grads,
                                              bufs):
            dz, dr = p.detach() - b, q.detach() - qb
            step[name] = {"ddp": float((dz - dr).norm() / dr.norm()),
                          "start_equal": bool(torch.equal(b, qb))}
            if getattr(p, "use_muon", False):
                de = exact_muon_update(b, g, buf, cfg.optim)
                step[name]["exact"] = float((dz.double() - de).norm() / de.norm())
        report["steps"].append(step)
    acc.wait_for_everyone()
    acc.free_memory()
    return report


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
