"""Ranks that exit when their launcher dies.

`accelerate launch` (torch's elastic agent) starts every rank of a multi-process job in a
session of its own, so a `kill -9` of the launcher's process group leaves the ranks running:
they keep training and writing checkpoints next to whatever is started next. torch's agent
stops its workers only when it is itself asked to stop (SIGTERM/SIGINT), never when it is
killed. A rank therefore asks Linux for a parent-death signal at start-up
(`prctl(PR_SET_PDEATHSIG)`, through ctypes: the standard library has no binding for it):
when the process that started it ends, the kernel sends it SIGKILL.

Only processes started by a launcher do this (torch's agent sets TORCHELASTIC_RUN_ID and
LOCAL_RANK for them); a training started by hand from a shell is left alone, so it survives
its terminal as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launched_rank() -> bool:
    """Whether this process is a rank started by torch's elastic agent (accelerate launch,
    torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def exit_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent ends (Linux; elsewhere a
    no-op returning False). Exits at once when the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this rank will not stop "
                        "by itself if its launcher is killed", ctypes.get_errno())
            return False
    except (OSError, AttributeError):
        return False
    if parent == 1 or os.getppid() != parent:  # the launcher ended before the request
        os.kill(os.getpid(), sig)
    return True


def exit_with_launcher() -> bool:
    """`exit_with_parent` for a launched rank; False (nothing done) otherwise."""
    return exit_with_parent() if launched_rank() else False
