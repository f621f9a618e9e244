"""`train.profile_steps`: torch.profiler over a window of the real trainer's steps.

    with StepProfiler(start=20, steps=3, out=run_dir / "profile", rank=0) as prof:
        for step in ...:
            with prof.step(step):
                train_step(...)

What the window covers and writes, and `benchmarks/profile_breakdown.py`: docs/configuration.md,
"Profiling a run". Each step runs inside a `train.step` range and ends with a device
synchronisation, as the in-process benchmark times its steps (`benchmarks/train_step.py`);
each rank writes profile/trace-rank<r>.json (chrome://tracing or Perfetto) and
profile/kernels-rank<r>.txt atomically when the window closes."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from eyas.data.common.utils import atomic_path, atomic_write_bytes

log = logging.getLogger(__name__)

#: the range around each profiled step (`benchmarks/profile_breakdown.py --window`)
STEP_RANGE = "train.step"


class StepProfiler:
    """Profiles optimizer steps start .. start + steps - 1 (steps 0: does nothing)."""

    def __init__(self, start: int, steps: int, out: Path, rank: int):
        self.start, self.steps, self.out, self.rank = start, steps, Path(out), rank
        self._prof: profile | None = None
        self._first = self._last = 0
        self.done = steps <= 0

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._prof is not None:          # the loop ended inside the window: keep what ran
            try:
                self._finish()
            except Exception as e:          # never in place of the error that ended the loop
                if exc_type is None:
                    raise
                log.warning("the profile of steps %d-%d was not written: %s", self._first,
                            self._last, e)
        elif not self.done and exc_type is None:
            log.warning("train.profile_steps=%d: no step from train.profile_start=%d ran "
                        "(the run ended before it, or resumed past it); nothing profiled",
                        self.steps, self.start)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run one optimizer step, profiled when it falls in the window."""
        if self.done or not self.start <= step < self.start + self.steps:
            yield
            return
        if self._prof is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self._prof = profile(activities=activities)
            self._prof.start()
            self._first = step
        self._last = step                   # started: in the trace even if it raises
        with record_function(STEP_RANGE):
            yield
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        if step == self.start + self.steps - 1:
            self._finish()

    def _finish(self) -> None:
        prof, self._prof, self.done = self._prof, None, True
        prof.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"trace-rank{self.rank}.json"
        with atomic_path(trace) as tmp:
            prof.export_chrome_trace(str(tmp))
        key = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=30)
        atomic_write_bytes(self.out / f"kernels-rank{self.rank}.txt", table.encode())
        log.info("profiled steps %d-%d into %s (python benchmarks/profile_breakdown.py %s)",
                 self._first, self._last, trace, trace)
