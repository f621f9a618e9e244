"""Stopping a training on request: SIGTERM, SIGINT (Ctrl-C), SIGHUP, SIGQUIT or SIGUSR1 saves a
checkpoint, then the job ends.

Schedulers ask a job to end with SIGTERM before they kill it: SLURM on preemption or at its
time limit (`--signal=USR1@120` sends SIGUSR1 that long before), Kubernetes when it evicts a
pod, `timeout` and most batch runners when their limit is reached. While `fit` runs, such a
signal no longer ends the process at once. The loop finishes the optimizer step it is in,
saves a checkpoint of that step on every rank, and raises `Stopped` (exit status 128 + the
signal's number, as a process ended by it reports: 143 for SIGTERM, 130 for Ctrl-C). The same command with `train.resume=latest` then continues
from that step, bit for bit as if never stopped. No summary and no final export are written, so a
stopped run never looks finished.

The ranks must stop at the same step: a single process checks its flag after every step, and
several processes agree (a max all-reduce of their flags) every `train.log_every` steps, where
the loop synchronises for its metrics anyway, so they may run up to log_every - 1 steps more.
A signal that arrives after the last check is sent again once the handlers are restored, so
it still ends the process. Outside the training loop (building the dataset, the final
export, the checks) the signals keep their default action; Ctrl-C there ends the job with one
line and status 130 (train/main.py).

Launchers: torch's elastic agent (`accelerate launch` with several processes) forwards SIGTERM
to the ranks and SIGKILLs them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by default);
it forwards SIGUSR1 only when PET_SIGNALS_TO_HANDLE names it (launch.sh sets both, and passes
a signal sent to itself alone on to accelerate's process group). With one
process, `accelerate launch` SIGKILLs the trainer 5 s after a SIGTERM: run `python
train/main.py` directly there when the step and its checkpoint take longer.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class Stopped(Exception):
    """The training stopped on a signal after saving a checkpoint (a usage-level outcome, not a
    bug: one line and exit status 128 + the signal's number; SIGTERM's when another rank's
    signal stopped this one)."""
    exit_status = 128 + signal.SIGTERM

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        if signum is not None and signum != signal.SIGUSR1:   # USR1: a scheduler's TERM ahead
            self.exit_status = 128 + int(signum)


class StopRequest:
    """A context manager that turns the SIGNALS into a flag for the training loop."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():   # only there can Python
            for sig in SIGNALS:                                      # install a handler
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, handler in self._previous.items():   # None: a handler installed from C
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
        if exc_type is None and self.signum is not None:
            signal.raise_signal(self.signum)   # it came after the last check: act on it now

    def _handle(self, signum: int, frame) -> None:
        if self.signal is None:
            self.signum = signum
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
