"""One writer per directory: an advisory lock every command that writes a directory takes.

A dataset (`eyas prepare`, `extract`, `import`), a run directory (rank 0 of the training job,
for the run's life) and an export (`eyas export`, the trainer's final export) are each written
by one process at a time. The writer holds ``fcntl.flock`` on a lock file and records in it who
it is (pid, host, command line, start time, as JSON); a second writer fails at once with one
line naming that holder, unless it asked to wait (a shared cache: the second process then
reads what the first wrote). Readers never take the lock.

The lock file of a directory is ``<dir>/.eyas.lock`` (`lock_path`); a directory that is
replaced as a whole (an export, renamed into place) is locked beside it, ``<parent>/.<name>.lock``
(`sibling_lock_path`). The file is removed when the lock is released. A process killed with
SIGKILL leaves its file behind but not its flock (the kernel drops it with the process): the
next writer finds the lock free, logs the dead holder as stale and takes the lock over.

``flock`` is hand-written here (through the standard library's fcntl) rather than taken from a
package such as `filelock`, because the holder record must live in the locked file itself and
the file must be removed race-free on release (the inode check in `DirLock.acquire`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import inspect
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = ".eyas.lock"


class DirectoryRefused(RuntimeError):
    """A writer may not write this directory (exit status 2: a usage error)."""

    exit_status = 2


class DirectoryLocked(DirectoryRefused):
    """Another live process holds the directory's lock."""


def lock_path(directory: str | os.PathLike) -> Path:
    """The lock file of a directory written in place: ``<dir>/.eyas.lock``."""
    return Path(directory) / LOCK_NAME


def sibling_lock_path(directory: str | os.PathLike) -> Path:
    """The lock file of a directory that is replaced as a whole: ``<parent>/.<name>.lock``."""
    d = Path(directory)
    return d.parent / f".{d.name}.lock"


def _read_holder(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 1 << 16).decode("utf-8", "replace")
        found = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def describe_holder(holder: dict | None) -> str:
    """`pid 123 on host h, since 2026-01-01 12:00:00+0000 (command: eyas prepare ...)`."""
    if not holder:
        return "a process that left no record"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since "
            f"{holder.get('since', '?')} (command: {holder.get('command', '?')})")


# Locks this process holds, by lock file: a nested writer of the same directory (a library
# function called by a command that already holds it) shares the lock instead of refusing.
_HELD: dict[str, "DirLock"] = {}


@atexit.register
def _release_all() -> None:
    """A process that exits holding locks removes their files (a killed one cannot: stale)."""
    for lock in list(_HELD.values()):
        lock.depth = 1
        lock.release()


class DirLock:
    """The lock of one directory (`acquire` / `release`, or use `dir_lock`)."""

    def __init__(self, directory: str | os.PathLike, *, what: str = "directory",
                 path: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory)
        self.path = Path(path) if path is not None else lock_path(directory)
        self.what = what
        self.fd: int | None = None
        self.depth = 0

    def _key(self) -> str:
        """The lock file, however the directory was spelled (symlinks, relative paths)."""
        return os.path.join(os.path.realpath(self.path.parent), self.path.name)

    def acquire(self, wait: float = 0.0) -> "DirLock":
        """Take the lock or raise DirectoryLocked naming the holder; `wait` > 0: first wait up
        to that many seconds for the holder to finish (for a shared cache that another
        process is filling, where the second one should read what the first writes)."""
        key = self._key()
        if key in _HELD:
            _HELD[key].depth += 1
            return _HELD[key]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait
        waiting = False
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                if time.monotonic() < deadline:
                    if not waiting:
                        log.info("%s is being written by %s: waiting up to %.0f s for it",
                                 self.directory, describe_holder(holder), wait)
                        waiting = True
                    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                    continue
                waited = f" (after waiting {wait:.0f} s)" if wait > 0 else ""
                raise DirectoryLocked(
                    f"{self.directory} is being written by another process{waited}: "
                    f"{describe_holder(holder)}; lock file {self.path}. Fix: wait for it to "
                    f"finish or stop it, or write to another directory") from None
            try:  # the file may have been released (removed) between open and flock
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read_holder(fd)
        if stale:
            log.warning("%s: taking over the stale lock of %s, which is no longer running "
                        "(%s)", self.directory, describe_holder(stale), self.path)
        record = json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
            "since": time.strftime("%Y-%m-%d %H:%M:%S%z"), "what": self.what,
            "directory": str(self.directory)}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record + b"\n", 0)
        os.fsync(fd)
        self.fd, self.depth = fd, 1
        _HELD[key] = self
        return self

    def release(self) -> None:
        """Give the lock back (the outermost release removes the lock file)."""
        if self.fd is None:
            return
        self.depth -= 1
        if self.depth > 0:
            return
        _HELD.pop(self._key(), None)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # while still locked: no other writer holds this inode
        os.close(self.fd)  # drops the flock
        self.fd = None


@contextlib.contextmanager
def dir_lock(directory: str | os.PathLike, *, what: str = "directory",
             path: str | os.PathLike | None = None, wait: float = 0.0) -> Iterator[DirLock]:
    """Hold the lock of `directory` (`path`: another lock file, e.g. `sibling_lock_path`;
    `wait`: seconds to wait for another holder, `DirLock.acquire`)."""
    lock = DirLock(directory, what=what, path=path).acquire(wait)
    try:
        yield lock
    finally:
        lock.release()


def writes_directory(param: str, *, what: str, sibling: bool = False,
                     when: Callable[[dict], bool] | None = None):
    """Decorator: the function writes the directory named by its argument `param` and holds
    that directory's lock while it runs (`sibling`: the lock beside it; `when(arguments)`
    False: this call takes no lock, e.g. one rank of several)."""
    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            if when is not None and not when(bound.arguments):
                return fn(*args, **kwargs)
            d = Path(bound.arguments[param])
            with dir_lock(d, what=what, path=sibling_lock_path(d) if sibling else None):
                return fn(*args, **kwargs)
        return locked
    return wrap


def lock_for_ranks(state, directory: str | os.PathLike, *, what: str,
                   check: Callable[[str | os.PathLike], None] | None = None) -> DirLock | None:
    """The lock of `directory` for every rank of a launch (`state`: accelerate's PartialState):
    rank 0 runs `check(directory)` (raises to refuse) and takes the lock, then every rank
    raises rank 0's refusal as DirectoryRefused, so none writes where it may not. Returns
    rank 0's lock (None on the others)."""
    lock, message = None, None
    if state.is_main_process:
        try:
            if check is not None:
                check(directory)
            lock = DirLock(directory, what=what).acquire()
        except (OSError, ValueError, DirectoryRefused) as e:
            message = str(e)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list
        shared = [message]
        broadcast_object_list(shared, from_process=0)
        message = shared[0]
    if message:
        if lock is not None:
            lock.release()
        raise DirectoryRefused(message)
    return lock
