"""The LR schedule against transformers.get_scheduler, value by value: its warmup runs the first
optimizer update at lr 0 (lost: the parameters do not move); eyas's starts at lr/(warmup+1).
After that difference nothing differs: eyas's rates are get_scheduler's with the warmup one step
longer, read one step later (exactly for cosine and constant; linear's 1 - p vs its (T - s)/(T -
w) round apart by at most one unit in the last place)."""

import math

import pytest
import torch
from eyas.train.config import OptimConfig
from eyas.train.optim import build_scheduler
from transformers import get_scheduler

HF_NAME = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}
LR, TOTAL, WARM = 3e-4, 40, 6


def _rates(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _eyas(schedule: str, warm: int = WARM) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    cfg = OptimConfig(lr=LR, schedule=schedule, warmup_steps=warm)
    return _rates(build_scheduler(opt, cfg, TOTAL), TOTAL)


def _hf(schedule: str, warm: int, total: int) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    kw = {} if schedule == "constant" else {"num_training_steps": total}
    return _rates(get_scheduler(HF_NAME[schedule], opt, num_warmup_steps=warm, **kw), total)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_schedule_is_get_schedulers_but_for_the_first_update(schedule):
    ours = _eyas(schedule)
    assert _hf(schedule, WARM, TOTAL)[0] == 0.0 and ours[0] == LR * (1 / (WARM + 1))
    shifted = _hf(schedule, WARM + 1, TOTAL + 1)[1:]
    if schedule == "linear":
        assert all(math.isclose(a, b, rel_tol=0, abs_tol=math.ulp(LR))
                   for a, b in zip(ours, shifted))
    else:
        assert ours == shifted
    assert _eyas(schedule, warm=0)[0] == LR          # no warmup: the full rate at once


def _first_update_moves(build) -> bool:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=LR, weight_decay=0.0)
    build(opt)
    p.grad = torch.ones(4)
    opt.step()
    return not torch.equal(p.detach(), torch.ones(4))


def test_get_schedulers_first_update_moves_nothing():
    """The measured need: with get_scheduler's warmup the first AdamW update is lost."""
    assert not _first_update_moves(lambda o: get_scheduler(
        "cosine", o, num_warmup_steps=WARM, num_training_steps=TOTAL))
    assert _first_update_moves(lambda o: build_scheduler(
        o, OptimConfig(lr=LR, warmup_steps=WARM), TOTAL))
