"""train.update: the optimizer step off DeepSpeed, in process: NaN/inf without host syncs."""

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from eyas.train.config import OptimConfig
from eyas.train.optim import MasterAdamW
from eyas.train.tracking import MetricsWindow
from eyas.train.update import SkippedSteps, micro_step

K, T = 2, 6


class Toy(torch.nn.Module):
    """A bf16 linear map and the `drafter.d2t` the metrics window reads."""

    def __init__(self, device):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4).to(torch.bfloat16)
        self.drafter = SimpleNamespace(d2t=torch.zeros(4, dtype=torch.int64, device=device))

    def forward(self, x: torch.Tensor, add: float = 0.0) -> SimpleNamespace:
        """A StepOutput stand-in; `add` is a constant term of the loss (no gradient)."""
        loss = self.lin(x).float().pow(2).mean() + add
        return SimpleNamespace(loss=loss, step_loss=loss.detach().expand(K).clone(),
                               draft_argmax=torch.zeros(K, T, dtype=torch.int64, device=x.device),
                               metric_mask=torch.ones(K, T, dtype=torch.bool, device=x.device),
                               alpha={"alpha_sum": torch.zeros(K, dtype=torch.int64,
                                                               device=x.device),
                                      "alpha_rows": torch.ones(K, dtype=torch.int64,
                                                               device=x.device)})


@pytest.fixture(params=["triton", "torch"])
def setup(request):
    """(accelerator, setup, skipped) with grad_accum 2 and MasterAdamW behind accelerate: on
    the GPU where there is one (the compiled kernel), else on the CPU (Triton's interpreter)."""
    acc = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = Toy(acc.device)
    opt = MasterAdamW(model.lin.parameters(), lr=1e-2, impl=request.param)
    model, opt = acc.prepare(model, opt)
    yield acc, SimpleNamespace(module=model, optimizer=opt), SkippedSteps(2, acc.device)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _batch(device, tokens=T):
    """A micro-batch of T rows, `tokens` of them real (the rest padding)."""
    return SimpleNamespace(num_tokens=tokens, input_ids=torch.zeros(T, dtype=torch.int64),
                           target_argmax=torch.zeros(T, dtype=torch.int64, device=device))


def _step(acc, s, skipped, window, adds):
    """One optimizer step over len(adds) micro-batches, as train.trainer's loop runs them;
    the gradient norm it returns."""
    clip = OptimConfig(clip_grad_norm=0.5).clip_grad_norm
    norm = None
    for add in adds:
        with acc.accumulate(s.module):
            res = s.module(torch.randn(3, 8, dtype=torch.bfloat16).to(acc.device), add)
            norm = micro_step(clip, acc, s.module, s.optimizer, skipped, res.loss)
            window.add(res, _batch(acc.device), s.module.drafter.d2t)
    return norm


def _weights(s):
    opt = s.optimizer.optimizer
    return [p.detach().clone() for p in s.module.lin.parameters()] + \
        [m.clone() for m in opt.masters[0]]


@contextlib.contextmanager
def _no_python_numbers(enabled: bool):
    """Fail on any tensor → Python number conversion (what a host sync looks like on CUDA).

    Off for the torch implementation on CPU: torch AdamW reads its host step counter there."""
    if not enabled:
        yield
        return

    def refuse(*_):
        raise AssertionError("a tensor was read on the host inside the optimizer step")
    names = ("item", "__bool__", "__float__", "__int__", "tolist")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    for n in names:
        setattr(torch.Tensor, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_micro_batch_drops_its_whole_optimizer_step(setup, bad):
    acc, s, skipped = setup
    window = MetricsWindow()
    before = _weights(s)
    # the second micro-batch of the step is NaN/inf through a constant term of its loss, whose
    # gradients stay finite: the trainer must skip the step anyway
    with _no_python_numbers(s.optimizer.optimizer.impl == "triton"):
        norm = _step(acc, s, skipped, window, [0.0, bad])
    assert not torch.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(_weights(s), before))
    assert all(p.grad is None for p in s.module.lin.parameters())
    assert skipped.read(step=1) == 1
    # the finite micro-batch stays in the metrics window, the bad one adds only its tokens
    assert int(window.n) == 1 and window.tokens == 2 * T and torch.isfinite(window.loss)
    assert int(window.counts["total"].sum()) == K * T
    # the next finite step updates
    norm = _step(acc, s, skipped, window, [0.0, 0.0])
    assert torch.isfinite(norm)
    assert not torch.equal(_weights(s)[0], before[0])
    assert skipped.read(step=2) == 1


def test_the_window_reports_step_time_and_the_packing_fill(setup):
    acc, s, _ = setup
    window = MetricsWindow()
    for tokens in (T, T - 2, 1):                  # three micro-batches, 9 of 18 rows padding
        res = s.module(torch.randn(3, 8, dtype=torch.bfloat16).to(acc.device))
        window.add(res, _batch(acc.device, tokens), s.module.drafter.d2t)
    window.steps, window.lr = 2, 0.1
    rec = window.flush(acc, 1.0, None)
    assert rec["fill"] == (2 * T - 1) / (3 * T) and rec["lr"] == 0.1
    assert rec["tokens_per_s"] * rec["step_ms"] * 2 / 1e3 == pytest.approx(2 * T - 1)
    assert window.steps == 0 and window.slots == 0         # the next window starts afresh


def test_the_skip_limit_is_checked_when_the_count_is_read(caplog):
    skipped = SkippedSteps(2, torch.device("cpu"), done=1)     # one from before a resume
    for _ in range(2):
        skipped.add(torch.tensor(True))
    skipped.add(torch.tensor(False))
    with caplog.at_level(logging.WARNING, logger="eyas.train.update"):
        with pytest.raises(RuntimeError) as e:
            skipped.read(step=7)
    assert "2 optimizer step(s) skipped by step 7 (3 in all)" in caplog.text
    assert "train.max_nonfinite_steps=2" in str(e.value)
    assert "checked every train.log_every steps" in str(e.value)


def test_the_deepspeed_path_counts_on_the_host_and_raises_at_once():
    skipped = SkippedSteps(1, torch.device("cpu"))
    skipped.add_host()
    assert skipped.read(step=1) == 1
    with pytest.raises(RuntimeError, match="2 steps had a NaN/inf"):
        skipped.add_host()
