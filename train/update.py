"""Backward and optimizer step of each micro-batch, and the NaN/inf steps they skip.

    micro_step_for(...)           the run's micro-step, `update(loss, step)`: one of the three
                                  below, with the run's accelerator, module, optimizer bound
    micro_step(...)               DDP or one process: no host sync
    engine_skip_micro_step(...)   DeepSpeed ZeRO-1/2 skipping NaN/inf steps itself: no read of
                                  the trainer's own (DeepSpeed's step makes three)
    host_checked_micro_step(...)  other DeepSpeed engines: the loss and the gradient norm read
                                  on the host
    SkippedSteps                  the count of skipped steps against train.max_nonfinite_steps

Off DeepSpeed the host never waits for the device inside a step: a NaN/inf loss makes every
gradient non-finite (`poisoned`), the gradient norm stays a device tensor, its finiteness is
the skip flag `MasterAdamW.step(skip=...)` obeys on the device, and the flags are summed on
the device until the trainer reads them at a log line or a checkpoint. A non-finite
micro-batch therefore drops the whole optimizer step it belongs to (as torch.amp.GradScaler
does), not only itself. A DeepSpeed ZeRO-1/2 engine in bf16 checks the gradients for NaN/inf
before its step (bf16.check_grad_overflow, which `train.dist` requires) and skips such a step
itself, with the same result; the trainer counts DeepSpeed's verdict and adds no read.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from collections.abc import Callable

import torch
from accelerate.utils import DistributedType
from torch import Tensor
from torch.profiler import record_function

from eyas.train.optim import MasterAdamW

log = logging.getLogger(__name__)


def micro_step(clip: float, accelerator, module, optimizer, skipped: SkippedSteps,
               loss: Tensor) -> Tensor | None:
    """Backward of one micro-batch and, after the last one of the accumulation, clip to `clip`
    (optim.clip_grad_norm) and optimizer step, with no host sync. Returns the gradient norm (a
    device tensor, non-finite on a skipped step) after the last micro-batch, else None."""
    accelerator.backward(poisoned(loss))
    if not accelerator.sync_gradients:
        return None
    norm = grad_norm(clip, accelerator, module)
    skip = ~torch.isfinite(norm)
    step_unless(optimizer, skip)
    skipped.add(skip)
    optimizer.zero_grad(set_to_none=True)
    return norm


def poisoned(loss: Tensor) -> Tensor:
    """The loss to back-propagate: itself when finite, else times NaN.

    A NaN or inf loss can come with finite gradients (an inf term whose gradient is bounded);
    scaling by NaN makes every gradient non-finite, so the gradient norm is non-finite, under
    DDP on every rank (the gradients are all-reduced), and all ranks skip the same step with
    no extra collective. Multiplying by 1.0 leaves a finite loss and its gradients exact."""
    return loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))


def grad_norm(clip: float, accelerator, module) -> Tensor:
    """Clip to `clip` (optim.clip_grad_norm; 0: no clipping) and return the global gradient
    norm, a device tensor: converting it to a float here would wait for the whole backward."""
    max_norm = clip if clip > 0 else float("inf")
    with record_function("eyas.clip"):      # profiles (train.profile_steps) count it as optimizer
        return accelerator.clip_grad_norm_(module.parameters(), max_norm)


def step_unless(optimizer, skip: Tensor) -> None:
    """optimizer.step() unless `skip`: decided on the device by MasterAdamW's Triton path, on
    the host (a sync) for its torch path, any other optimizer, or under an fp16 GradScaler
    (which skips on its own)."""
    inner = getattr(optimizer, "optimizer", optimizer)      # under accelerate's wrapper
    if isinstance(inner, MasterAdamW) and getattr(optimizer, "scaler", None) is None:
        inner.step(skip=skip)
    elif not skip.item():
        optimizer.step()


def micro_step_for(accelerator, module, optimizer, skipped: SkippedSteps, clip: float
                   ) -> Callable[[Tensor, int], Tensor | float | None]:
    """The micro-step of this run as `update(loss, step)`, chosen once (the engine does not
    change during the run): `micro_step` off DeepSpeed, `engine_skip_micro_step` under a
    DeepSpeed ZeRO-1/2 engine whose optimizer skips NaN/inf steps itself
    (bf16.check_grad_overflow), else `host_checked_micro_step` (ZeRO-3, fp32; both DeepSpeed
    paths clip inside the engine)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        step = partial(micro_step, clip, accelerator, module, optimizer, skipped)
        return lambda loss, _: step(loss)
    opt = getattr(module, "optimizer", None)
    if getattr(opt, "check_grad_overflow", False) is True and hasattr(opt, "overflow"):
        return partial(engine_skip_micro_step, accelerator, module, optimizer, skipped)
    return partial(host_checked_micro_step, accelerator, module, optimizer, skipped)


def engine_skip_micro_step(accelerator, module, optimizer, skipped: SkippedSteps, loss: Tensor,
                           step: int) -> Tensor | float | None:
    """The micro-step under a DeepSpeed engine that skips NaN/inf steps itself. The loss is
    `poisoned`, so a NaN/inf micro-batch drops its whole optimizer step; the engine clips and
    steps inside `accelerator.backward` and decides the skip with its own host read, whose
    result (`step_was_skipped`) is counted here at no cost. Returns the engine's gradient norm
    (a device tensor; inf on a skipped step)."""
    accelerator.backward(poisoned(loss))
    if not accelerator.sync_gradients:
        return None
    if optimizer.step_was_skipped:
        log.warning("NaN/inf gradients at step %d: DeepSpeed skipped the update (%d so far)",
                    step, skipped.seen + 1)
        skipped.add_host()
    optimizer.zero_grad(set_to_none=True)
    return module.get_global_grad_norm()


def host_checked_micro_step(accelerator, module, optimizer, skipped: SkippedSteps, loss: Tensor,
                            step: int) -> float | None:
    """The other DeepSpeed engines (ZeRO-3, fp32): the loss is checked on the host per
    micro-batch (a non-finite micro-batch is skipped alone), the engine's gradient norm is read
    as a float and the limit is checked at every skip. The engine steps inside
    `accelerator.backward`; ZeRO-3 skips a non-finite norm itself."""
    bad = accelerator.reduce((~torch.isfinite(loss)).float(), "max")
    if bad.item():
        skipped.add_host()
        log.warning("non-finite loss at step %d: micro-batch skipped (%d so far)",
                    step, skipped.seen)
    else:
        accelerator.backward(loss)
    if not accelerator.sync_gradients:
        return None
    norm = module.get_global_grad_norm() if hasattr(module, "get_global_grad_norm") else None
    gnorm = None if norm is None else float(norm)
    if gnorm is not None and not math.isfinite(gnorm):
        skipped.add_host()
        log.warning("non-finite gradient norm at step %d: update skipped", step)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return gnorm


class SkippedSteps:
    """Optimizer steps skipped for a NaN/inf loss or gradient, against train.max_nonfinite_steps.

    `micro_step` adds each step's device skip flag to a device counter; reading it is a host
    sync, so `read` runs only where the trainer syncs anyway (log lines, checkpoints, the
    summary) and the limit is checked there, i.e. every train.log_every steps: a run can
    overshoot it by up to log_every - 1 steps. The DeepSpeed paths count on the host
    (`add_host`) and check at once.
    """

    def __init__(self, limit: int, device, done: int = 0):
        self.limit = limit
        self.host = done                    # a resumed run's count, plus DeepSpeed's skips
        self.counted = torch.zeros((), dtype=torch.int64, device=device)
        self.seen = done                    # the total as of the last read

    def add(self, skip: Tensor) -> None:
        self.counted += skip

    def add_host(self) -> None:
        self.host += 1
        self.seen += 1
        self._check()

    def read(self, step: int) -> int:
        """The total so far (a host sync); logs new skips, raises past the limit."""
        total = self.host + int(self.counted)
        if total > self.seen:
            log.warning("non-finite loss or gradient: %d optimizer step(s) skipped by step %d "
                        "(%d in all)", total - self.seen, step, total)
        self.seen = total
        self._check()
        return total

    def _check(self) -> None:
        if self.seen > self.limit:
            raise RuntimeError(f"{self.seen} steps had a NaN/inf loss or gradient (limit "
                               f"train.max_nonfinite_steps={self.limit}, checked every "
                               f"train.log_every steps); lower optim.lr or check the dataset "
                               f"with `eyas inspect`")


def skipped_samples(dataset) -> int:
    """Samples of this rank's training set left out for NaN/inf (data.nonfinite=skip), logged."""
    checks = dataset.read_checks
    if checks is None or not checks.skipped:
        return 0
    first = checks.skipped[0]
    log.warning("data.nonfinite=skip left out %d sample(s) with NaN/inf values (first: %s "
                "sample %d)", len(checks.skipped), first["file"], first["sample"])
    return len(checks.skipped)
