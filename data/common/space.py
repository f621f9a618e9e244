"""Room to write: free-space checks before a long stage, and write failures that say so.

A write that finds the disk full, the quota spent or the process's file-size limit (`ulimit -f`)
reached fails deep inside a writer: Python's OSError (ENOSPC, EDQUOT, EFBIG) without a path,
safetensors' ``I/O error: … (os error 28)``, or torch's ``unexpected pos … vs …`` /
``basic_ios::clear`` from its C++ stream. `no_room_error` recognises all of them and
`DiskFullError` says it in one line: the directory, the bytes needed (where known) and free,
and the fix; the `eyas` command and the trainer exit 2 with it (data/common/log.py).
`require_free` refuses a stage whose size is known before it writes anything.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import shutil
from collections.abc import Iterator
from pathlib import Path

#: errnos of a write that found no room
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_OS_ERROR = re.compile(r"\(os error (\d+)\)")      # safetensors (Rust's io::Error)
_TORCH_WRITE = ("unexpected pos", "basic_ios::clear", "file write failed",
                "PytorchStreamWriter failed")        # torch.save's C++ stream, which drops errno
_FULL_BELOW = 1 << 20   # free bytes under which a failed write counts as a full disk


class DiskFullError(Exception):
    """A write found (or would find) no room: the disk or quota is full, or a file would pass
    the process's file-size limit. Exit status 2: the user frees space or writes elsewhere."""

    exit_status = 2


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (or of its
    nearest existing ancestor, for a directory not created yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def file_size_limit() -> int | None:
    """The process's file-size limit in bytes (`ulimit -f`), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _h(n: int) -> str:
    return f"{human_bytes(n)} ({n:,} bytes)" if n >= 1024 else f"{n} bytes"


def _limit_text(limit: int) -> str:
    return (f"this process's file-size limit of {_h(limit)} (`ulimit -f` {limit // 1024} "
            f"KiB); raise it (`ulimit -f unlimited`) and run again")


def require_free(directory: str | os.PathLike, needed: int, *, what: str, fix: str,
                 largest_file: int | None = None) -> None:
    """Raise DiskFullError before `what` writes `needed` bytes into `directory` when its
    filesystem has less free, or when a `largest_file` of that many bytes would pass the
    file-size limit. `fix`: what the user does instead (the free-space case)."""
    limit = file_size_limit()
    if largest_file is not None and limit is not None and largest_file > limit:
        raise DiskFullError(f"{what} in {directory} writes a file of {_h(largest_file)}, over "
                            f"{_limit_text(limit)}")
    free = free_bytes(directory)
    if needed > free:
        raise DiskFullError(f"not enough space for {what} in {directory}: needs {_h(needed)}, "
                            f"{_h(free)} free there; {fix}")


def no_room_errno(e: BaseException) -> int | None:
    """ENOSPC / EDQUOT / EFBIG when `e` is a write that found no room, else None; 0 for torch's
    stream error, which does not say which (`no_room_error` asks the filesystem)."""
    if isinstance(e, OSError):
        return e.errno if e.errno in NO_ROOM_ERRNOS else None
    text = str(e)
    m = _OS_ERROR.search(text)
    if m and int(m.group(1)) in NO_ROOM_ERRNOS:
        return int(m.group(1))
    if isinstance(e, RuntimeError) and any(s in text for s in _TORCH_WRITE):
        return 0
    return None


def no_room_error(e: BaseException, directory: str | os.PathLike, *, what: str,
                  fix: str = "free space there or write to another directory",
                  needed: int | None = None) -> DiskFullError | None:
    """The DiskFullError for a write error `e` of `what` in `directory`, or None when `e` is
    something else. Call it before removing the partial files: the free bytes it reports are
    the ones the write found."""
    if isinstance(e, DiskFullError):
        return e
    code = no_room_errno(e)
    if code is None:
        return None
    free, limit = free_bytes(directory), file_size_limit()
    if code == 0:            # torch: a full disk, else the file-size limit, else not ours
        code = (errno.ENOSPC if free < _FULL_BELOW else
                errno.EFBIG if limit is not None else None)
        if code is None:
            return None
    if code == errno.EFBIG:
        why = (_limit_text(limit) if limit is not None else
               "the filesystem's largest file size; write to another filesystem")
        return DiskFullError(f"writing {what} in {directory} failed: a file passed {why}")
    cause = "the disk quota is spent" if code == errno.EDQUOT else "no space left on the device"
    room = (f"needs {_h(needed)}, {_h(free)} free there" if needed is not None else
            f"it needs more than the {_h(free)} free there")
    return DiskFullError(f"writing {what} in {directory} failed: {cause} ({room}); {fix}")


@contextlib.contextmanager
def no_room_is_an_error(directory: str | os.PathLike, *, what: str,
                        fix: str = "free space there or write to another directory",
                        needed: int | None = None) -> Iterator[None]:
    """Inside, a write that finds no room raises DiskFullError (`no_room_error`) instead."""
    try:
        yield
    except Exception as e:
        err = no_room_error(e, directory, what=what, fix=fix, needed=needed)
        if err is None or err is e:
            raise
        raise err from e
