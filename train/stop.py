"""Stopping a training on request: SIGTERM (or SIGUSR1) saves a checkpoint, then the job ends.

Schedulers ask a job to end with SIGTERM before they kill it: SLURM on preemption or at its
time limit (`--signal=USR1@120` sends SIGUSR1 that long before), Kubernetes when it evicts a
pod, `timeout` and most batch runners when their limit is reached. While `fit` runs, such a
signal no longer ends the process at once. The loop finishes the optimizer step it is in,
saves a checkpoint of that step on every rank, and raises `Stopped` (exit status 143, as a
process ended by SIGTERM reports). The same command with `train.resume=latest` then continues
from that step, bit for bit as if never stopped. No summary and no export are written, so a
stopped run never looks finished.

The ranks must stop at the same step: a single process checks its flag after every step, and
several processes agree (a max all-reduce of their flags) every `train.log_every` steps (every
step when it is 0), where the loop synchronises for its metrics anyway. Outside `fit` (building the dataset, exporting,
evaluating) the signals keep their default action.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Stopped(Exception):
    """The training stopped on a signal after saving a checkpoint (a usage-level outcome, not a
    bug: one line and exit status 143)."""
    exit_status = 128 + signal.SIGTERM


class StopRequest:
    """A context manager that turns SIGTERM/SIGUSR1 into a flag for the training loop."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():   # only there can Python
            for sig in SIGNALS:                                      # install a handler
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            log.warning("%s received: saving a checkpoint at the next step boundary, then "
                        "stopping", self.signal)

    def due(self, accelerator, step: int, every: int) -> bool:
        """Whether the loop stops after `step`: this process's flag when it runs alone; with
        several processes, every rank's flags combined at each `every`-th step (False between)."""
        if accelerator.num_processes == 1:
            return self.signal is not None
        if every and step % every:
            return False
        flag = torch.tensor([1.0 if self.signal else 0.0], device=accelerator.device)
        agreed = bool(accelerator.reduce(flag, reduction="max").item())
        if agreed and self.signal is None:
            self.signal = "another rank's signal"
        return agreed
