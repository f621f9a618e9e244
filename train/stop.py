"""Stopping a training on request: SIGTERM, SIGINT (Ctrl-C), SIGHUP, SIGQUIT or SIGUSR1 saves a
checkpoint, then the job ends.

What a user sees (the step finished, the checkpoint, exit status 128 + the signal's number,
resuming bit for bit, the launchers' time limits): docs/training.md, "Stopping a run".

The ranks must stop at the same step: a single process checks its flag after every step, and
several processes agree (a max all-reduce of their flags) every `train.log_every` steps, where
the loop synchronises for its metrics anyway. A signal that arrives after the last check is
sent again once the handlers are restored, so it still ends the process. Outside the training
loop (building the dataset, the final export, the checks) the signals keep their default
action; Ctrl-C there ends the job with one line and status 130 (train/main.py)."""

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
