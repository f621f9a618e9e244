"""Checks of what a reader actually reads: each sample's crc32 and NaN/inf, on its first read.

`Dataset.enable_read_checks(checksum=True, nonfinite="error")` turns them on; the packed
loader's `Dataset.read_into` then checks every sample the first time it is read (later reads
of a checked sample cost nothing):

- checksum: the sample's crc32 (data/store/FORMAT.md: every per-token tensor of the sample, sorted
  names, chained) is recomputed with `format.crc32` (zlib-ng's) over the bytes just read into the batch buffer
  (bf16/bool fields land there verbatim through pread) and over the memory-mapped rows of the
  other tensors (int32 ids, fp8 scales: a few bytes per token). A mismatch, even one flipped
  bit, raises `DatasetError` naming the shard file and the sample. The shard's table of sample
  crcs is itself checked against the shard checksum once per shard.
- non-finite: the float fields read into the batch are tested on their bits (an all-ones
  exponent is NaN/inf: one vectorised integer and+max pass per chunk, no float conversion);
  only then is the per-token test run to name the first bad token. With
  nonfinite="error" such a sample raises `DatasetError` naming file, sample and token; with
  "skip" it raises `SkippedSample` (the loader leaves the sample out of its batch), is counted
  in `ReadChecks.skipped`, logged with file and sample, and never read again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from eyas.data.store.format import (AUX_SCALE, FLOAT_FIELDS, SAMPLE_CRC, DatasetError,
                                    as_numpy_bytes, crc32, nonfinite_tokens)

log = logging.getLogger(__name__)

#: skipped samples logged one by one before the log switches to a count every 1000
_LOG_FIRST = 20


class SkippedSample(DatasetError):
    """A sample left out under nonfinite="skip"; `length` rows of the buffers were written."""

    def __init__(self, message: str, *, path, sample: int, length: int):
        super().__init__(message, path=path, sample=sample)
        self.length = length


def _flat_bytes(t: torch.Tensor) -> np.ndarray:
    return as_numpy_bytes(t).reshape(-1).view(np.uint8)


def sample_crc(sh, j: int, out: dict[str, torch.Tensor] | None = None,
               length: int | None = None) -> int:
    """crc32 of shard-local sample j; fields read in full into `out` are hashed from there."""
    lo, hi = int(sh.offsets[j]), int(sh.offsets[j + 1])
    full = out is not None and length == hi - lo
    crc = 0
    for name in sh.crc_names:
        dst = out.get(name) if full else None
        # read_into put the stored bytes of a verbatim field into a contiguous `dst` unchanged
        if (dst is not None and name in sh.meta["fields"] and sh.verbatim(name)
                and dst[:length].is_contiguous()):
            crc = crc32(_flat_bytes(dst[:length]), crc)
        else:
            crc = crc32(_flat_bytes(sh.tensor(name)[lo:hi]), crc)
    return crc


#: float dtype -> (mask dropping the sign bit, smallest NaN/inf bit pattern) of its int view
_EXP_ALL_ONES = {torch.bfloat16: (0x7FFF, 0x7F80), torch.float16: (0x7FFF, 0x7C00),
                 torch.float32: (0x7FFFFFFF, 0x7F800000)}
_CHUNK = 1 << 21   # values per pass: bounded temporaries


def _any_nonfinite(x: torch.Tensor) -> bool:
    """Whether x holds a NaN/inf (bit test on an integer view; other dtypes: torch.isfinite)."""
    bits = _EXP_ALL_ONES.get(x.dtype)
    if bits is None or not x.is_contiguous():
        return not bool(torch.isfinite(x).all())
    mask, lowest = bits
    flat = as_numpy_bytes(x).reshape(-1)
    return any(int((flat[k:k + _CHUNK] & mask).max()) >= lowest
               for k in range(0, flat.size, _CHUNK))


class ReadChecks:
    """First-read checks of one dataset (see the module docstring); shared by loader threads."""

    def __init__(self, *, checksum: bool = True, nonfinite: str = "error"):
        if nonfinite not in ("error", "skip"):
            raise ValueError(f"nonfinite must be 'error' or 'skip', got {nonfinite!r}")
        self.checksum, self.nonfinite = checksum, nonfinite
        self.skipped: list[dict[str, Any]] = []
        self._done: dict[int, np.ndarray] = {}   # shard -> bool [n]: sample already checked
        self._bad: set[int] = set()              # global ids of skipped samples
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def before_read(self, sh, s: int, j: int, g: int) -> bool:
        """True when sample (shard s, local j, global g) still needs its checks."""
        if g in self._bad:
            raise SkippedSample("sample skipped earlier (NaN/inf)", path=sh.path, sample=g,
                                length=0)
        done = self._done.get(s)
        if done is None:
            if self.checksum:
                sh.crc_table()
            with self._lock:
                done = self._done.setdefault(s, np.zeros(len(sh.offsets) - 1, dtype=bool))
        return not done[j]

    def after_read(self, sh, s: int, j: int, g: int, out: dict[str, torch.Tensor],
                   length: int) -> None:
        """Check sample j just read into `out[name][:length]`; raises on a bad sample."""
        if self.checksum:
            want = int(sh.tensor(SAMPLE_CRC)[j])
            got = sample_crc(sh, j, out, length)
            if got != want:
                raise DatasetError(
                    f"checksum mismatch in shard-local sample {j} (crc32 {got:08x}, stored "
                    f"{want:08x}): the file is corrupted; re-create or re-download it (or set "
                    f"data.verify=false to train on it anyway)", path=sh.path, sample=g)
        bad = self._nonfinite(sh, out, length)
        if bad is not None:
            self._nonfinite_found(sh, j, g, length, *bad)
        self._done[s][j] = True

    @staticmethod
    def _nonfinite(sh, out: dict[str, torch.Tensor], length: int) -> tuple[str, int] | None:
        """(field, first token) of a NaN/inf among the float fields read, or None."""
        names = [n for n in (*FLOAT_FIELDS, AUX_SCALE) if n in out and n in sh.meta["fields"]]
        for name in names:
            x = out[name][:length]
            if not _any_nonfinite(x):
                continue
            rows = nonfinite_tokens(x.reshape(length, -1)).nonzero().flatten()
            if rows.numel():
                return name, int(rows[0])
        return None

    def _nonfinite_found(self, sh, j: int, g: int, length: int, name: str, tok: int) -> None:
        where = f"field {name!r} has NaN/inf values (shard-local sample {j}, token {tok})"
        if self.nonfinite == "error":
            raise DatasetError(f"{where}; drop or re-extract the sample, or set "
                               f"data.nonfinite=skip to leave such samples out", path=sh.path,
                               sample=g)
        with self._lock:
            self._bad.add(g)
            self.skipped.append({"sample": g, "file": sh.path.name, "local": j, "field": name,
                                 "reason": "nonfinite"})
            n = len(self.skipped)
        if n <= _LOG_FIRST:
            log.warning("data.nonfinite=skip: left out %s (sample %d): %s", sh.path, g, where)
        elif n % 1000 == 0:
            log.warning("data.nonfinite=skip: %d samples left out so far", n)
        raise SkippedSample(where, path=sh.path, sample=g, length=length)


#: manifest entries two datasets read by one training run must agree on
SAME_CONTRACT = ("target", "aux_layer_ids", "convention", "hidden_size", "format_version")


def _read_fields(manifest: dict[str, Any]) -> dict[str, Any]:
    return {n: (f.get("dtype"), list(f.get("shape", []))) for n, f in manifest["fields"].items()}


def contract_mismatch(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """(entry, value in a, value in b) of the first difference that makes manifests `a` and `b`
    describe different inputs (target, aux layers, hidden size, fields as read), else None.
    The stored aux format may differ: fp8 and bf16 aux are both read as bf16."""
    for key in SAME_CONTRACT:
        if a.get(key) != b.get(key):
            return key, a.get(key), b.get(key)
    fa, fb = _read_fields(a), _read_fields(b)
    for name in sorted(set(fa) | set(fb)):
        if fa.get(name) != fb.get(name):
            return f"fields.{name}", fa.get(name, "absent"), fb.get(name, "absent")
    return None
