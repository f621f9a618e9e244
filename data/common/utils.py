"""Small I/O helpers shared by the data layer: atomic writes and progress bars.

Every file eyas writes under a dataset directory goes through `atomic_path`: the bytes land in a
temporary file in the SAME directory (so the final rename never crosses a filesystem), the file is
fsync'ed, then `os.replace`d onto its final name and the directory entry is fsync'ed. A crash or an
exception at any point leaves either the previous file or nothing under the final name, never a
half-written file that looks complete. Directories that must appear whole (an export, a cached
target, an engine venv) are written the same way by `atomic_write_dir`. Temporary names start
with ``.tmp-`` so readers and globs for ``shard-*.safetensors`` never match them. A write that
finds the disk full or passes the file-size limit raises DiskFullError naming the directory and
the free bytes (data/common/space.py). Every file and directory gets the mode a plain `open()` /
`mkdir` gives under the user's umask.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from eyas.data.common.space import DiskFullError, no_room_is_an_error, require_free

log = logging.getLogger(__name__)

T = TypeVar("T")

TMP_PREFIX = ".tmp-"


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it survives a power loss (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on normal exit it is renamed onto `path`.

    The caller writes the temporary file (any way it likes). On an exception the temporary file
    is removed and nothing appears under `path`.

    >>> with atomic_path("out.bin") as tmp:         # doctest: +SKIP
    ...     tmp.write_bytes(b"...")
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{final.name}.", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with no_room_is_an_error(final.parent, what=final.name):   # before the cleanup below
            yield tmp
            umask_mode(tmp)  # after the caller: writers such as safetensors recreate it 0600
            if fsync:
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if fsync:
                fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def umask_mode(path: str | os.PathLike) -> None:
    """Give a file the mode a plain `open()` would: ``0o666 & ~umask`` (mkstemp and safetensors
    create files 0600, which a serving container running as another user cannot read)."""
    umask = os.umask(0o022)   # read by setting it and putting it back
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def umask_modes(root: str | os.PathLike) -> None:
    """`umask_mode` for every regular file under the directory `root` (what a library such as
    accelerate's `save_state` wrote there with its own modes)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                umask_mode(p)


def _fresh_dir(parent: Path, name: str) -> Path:
    """A new empty directory `.tmp-<name>.<random>` in `parent`, with the umask's mode."""
    for _ in range(100):
        tmp = parent / f"{TMP_PREFIX}{name}.{secrets.token_hex(4)}"
        try:
            tmp.mkdir()  # unlike mkdtemp (always 0700) this keeps the user's umask
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary directory name for {name} in {parent}")


def atomic_write_dir(path: str | os.PathLike, build: Callable[[Path], object], *,
                     if_exists: str = "error",
                     exists_hint: str = "choose a new directory or remove it",
                     need_bytes: int | None = None) -> Path:
    """Write a directory atomically: `build(tmp)` fills a fresh sibling, which is renamed onto
    `path`.

    `path` never holds a half-written directory: until `build` returns, everything lives under a
    ``.tmp-`` sibling, removed again when `build` raises. The directory gets the mode ``mkdir``
    gives under the user's umask. `if_exists` says what an existing `path` means:
    "error" (FileExistsError naming it, plus `exists_hint`, before anything is built),
    "replace" (the old directory is moved aside, the new one renamed in, the old one removed) or
    "keep" (a concurrent writer finished first: its directory stays and the new one is dropped).
    `need_bytes`: what `build` writes, refused (DiskFullError) before it starts when the
    filesystem has less free; a build that runs out of room raises DiskFullError. Returns `path`.
    """
    if if_exists not in ("error", "replace", "keep"):
        raise ValueError(f"if_exists must be 'error', 'replace' or 'keep', got {if_exists!r}")
    final = Path(path)
    if final.exists() and if_exists == "error":
        raise FileExistsError(f"{final} already exists: {exists_hint}")
    if need_bytes is not None:
        require_free(final.parent, need_bytes, what=final.name,
                     fix="free space there or write to another directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_dir(final.parent, final.name)
    try:
        with no_room_is_an_error(final.parent, what=final.name, needed=need_bytes):
            build(tmp)
            if final.exists() and if_exists == "keep":
                shutil.rmtree(tmp)
            elif final.exists():
                old = final.with_name(f"{TMP_PREFIX}{final.name}.old.{os.getpid()}")
                final.rename(old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            fsync_dir(final.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, DiskFullError) and str(tmp) in str(e):   # a file of `build`: named
            raise type(e)(str(e).replace(str(tmp), str(final))) from e   # where it would be
        raise
    return final


def remove_leftover_dirs(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary siblings of `path` that a killed `atomic_write_dir` left
    (``.tmp-<name>.<random>``, ``.tmp-<name>.old.<pid>``), logging each. Only for a caller
    that holds `path`'s lock (data/common/lock.py): then no live writer owns them."""
    final = Path(path)
    ours = re.compile(re.escape(f"{TMP_PREFIX}{final.name}.") + r"([0-9a-f]{8}|old\.\d+)")
    found = sorted(p for p in final.parent.glob(f"{TMP_PREFIX}*")
                   if ours.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
    for p in found:
        log.warning("removing %s, left by an earlier write of %s that did not finish", p, final)
        shutil.rmtree(p, ignore_errors=True)
    return found


def atomic_write_bytes(path: str | os.PathLike, data: bytes | bytearray | memoryview) -> Path:
    """Write `data` to `path` atomically (temp file in the same dir, fsync, os.replace)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return Path(path)


def json_safe(obj: Any) -> Any:
    """`obj` as strict JSON values, recursively: NaN/inf -> None, tuples -> lists, keys -> str,
    other objects -> str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1) -> Path:
    """Write `obj` as JSON to `path` atomically. Keys keep their insertion order."""
    text = json.dumps(obj, indent=indent, allow_nan=False) + "\n"
    return atomic_write_bytes(path, text.encode("utf-8"))


def progress(iterable: Iterable[T], **tqdm_kwargs: Any) -> Iterable[T]:
    """`tqdm(iterable, **tqdm_kwargs)`, disabled when stderr is not a terminal (logs, CI, pipes).

    An explicit ``disable=`` in `tqdm_kwargs` wins.
    """
    from tqdm.auto import tqdm

    tqdm_kwargs.setdefault("disable", not _stderr_is_tty())
    tqdm_kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **tqdm_kwargs)


#: seconds between two progress lines of a long stage in the log (and the run's log file)
PROGRESS_LOG_EVERY_S = 30.0


class LogEvery:
    """`due()` is true at most once every PROGRESS_LOG_EVERY_S seconds, the first time that
    long after construction: a long loop's progress lines in the log, where a tqdm bar (off
    when stderr is not a terminal) does not go. `elapsed` is the seconds since construction."""

    def __init__(self):
        self.t0 = self.last = time.perf_counter()
        self.elapsed = 0.0

    def due(self) -> bool:
        now = time.perf_counter()
        if now - self.last < PROGRESS_LOG_EVERY_S:
            return False
        self.last, self.elapsed = now, now - self.t0
        return True


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
