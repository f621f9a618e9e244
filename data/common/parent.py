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

A rank that refuses the run under launch.sh (status 2 or 3, recorded in its EYAS_EXIT_FILE)
ends its launcher itself (`end_launcher`): torch's agent would otherwise answer the refusal
with its ChildFailedError report of a crash (~40 lines after the one that says what to fix).

`python -m eyas.data.common.parent COMMAND...` (launch.sh's `accelerate launch`) runs COMMAND
in a process group of its own that is sent SIGTERM when its starter ends: launch.sh passes the
signals it gets to that group once, and a `kill -9` of launch.sh still stops the run.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time

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


#: statuses of a refusal (data/common/log.py: a usage or config error, a stage that cannot run)
REFUSALS = (2, 3)
#: seconds a rank other than its node's first waits for that one to end the launcher
REFUSAL_WAIT_S = 15.0


def end_launcher(status: int) -> bool:
    """After a refusal (`REFUSALS`) recorded for launch.sh (EYAS_EXIT_FILE), a launched rank
    ends torch's agent, so the agent reports no crash, and launch.sh exits with the recorded
    status: its node's first rank (LOCAL_RANK 0, the one that says why on node 0) SIGKILLs the
    agent, and the kernel then ends the node's other ranks (`exit_with_launcher`). The other
    ranks wait up to REFUSAL_WAIT_S for that; a rank that refused alone then exits as before.
    False (nothing done) for any other status or process."""
    if status not in REFUSALS or not launched_rank() or not os.environ.get("EYAS_EXIT_FILE"):
        return False
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    parent = os.getppid()
    if os.environ.get("LOCAL_RANK") == "0":
        os.kill(parent, signal.SIGKILL)
    else:
        deadline = time.monotonic() + REFUSAL_WAIT_S
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.1)
    return True


def exec_in_own_group(argv: list[str]) -> None:
    """Replaces this process with `argv`, in a process group of its own, with the signals a
    shell's background job and Python's start-up ignore (SIGINT, SIGQUIT, SIGPIPE, SIGXFSZ) at
    their default action, and SIGTERM sent to it when its parent ends."""
    os.setpgid(0, 0)
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    exit_with_parent(signal.SIGTERM)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m eyas.data.common.parent COMMAND [ARG...]")
    exec_in_own_group(sys.argv[1:])
