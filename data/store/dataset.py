"""Reading eyas datasets: `open_dataset(dir)` -> `Dataset` with O(1), zero-copy sample access.

Opening reads only `manifest.json` and `index.safetensors` (sample lengths), never the shards:
a dataset of thousands of shards opens in milliseconds. A shard is opened on first access (header
parsed and checked against the manifest, file memory-mapped copy-on-write) and kept in a bounded
LRU cache. `dataset[i]` returns views into the mapping: no bytes are copied for bf16 `aux`/`last`
or bool `loss_mask`; int32 ids are widened to int64 and fp8 aux is dequantised (small copies).
Views stay valid after their shard leaves the cache (the tensor keeps the mapping alive).
Verification levels: `open_dataset`.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.store.format import (AUX_SCALE, FLOAT_FIELDS, FORMAT_VERSION, INDEX_NAME,
                                    MANIFEST_NAME, OFFSETS, SAMPLE_CRC, SHARD_GLOB, DatasetError,
                                    as_numpy_bytes, crc32_rows, dequantize_fp8, dtype_from_name,
                                    nonfinite_tokens, pread_exact, read_shard_header,
                                    table_checksum)
from eyas.data.common.utils import progress
from eyas.data.store.read_checks import ReadChecks

log = logging.getLogger(__name__)

VERIFY_LEVELS = ("none", "header", "checksum")
NONFINITE_MODES = ("error", "skip")


def _check_buffer(name: str, dst: torch.Tensor, e, dtype: torch.dtype | None, length: int,
                  path: Path) -> None:
    """Raise unless `dst` holds >= `length` rows of stored tensor `e`'s row size (and `dtype`)."""
    row = list(e.shape[1:])
    if not (dst.dim() and dst.shape[0] >= length and math.prod(dst.shape[1:]) == math.prod(row)
            and dtype in (None, dst.dtype)):
        raise DatasetError(f"read_into buffer for field {name!r} is {dst.dtype} {list(dst.shape)} "
                           f"but the field needs {dtype or 'any dtype'} with >= {length} rows of "
                           f"{row}; allocate it from Dataset.fields (dtype, per-token shape)",
                           path=path)


class ShardFile:
    """One open shard: parsed header, offsets, and a lazily created copy-on-write mapping."""

    def __init__(self, path: Path, expected: dict[str, Any] | None = None,
                 lengths: np.ndarray | None = None):
        self.path = path
        self.file = open(path, "rb")  # closed when the last reference (cache or view) goes
        self.header, self.meta, self.offsets = read_shard_header(path, self.file)
        if expected is not None:
            self._check_against(expected, lengths)
        self._base: torch.Tensor | None = None
        self._lock = threading.Lock()

    def _check_against(self, exp: dict[str, Any], lengths: np.ndarray | None) -> None:
        m = self.meta
        for key in ("n_samples", "n_tokens", "checksum", "fields", "aux_format"):
            if key in exp and exp[key] != m.get(key):
                raise DatasetError(f"shard header says {key}={m.get(key)!r} but the manifest says "
                                   f"{exp[key]!r}; the shard was replaced or the manifest is stale "
                                   f"(re-run write_manifest / the producer)", path=self.path)
        if lengths is not None and not np.array_equal(np.diff(self.offsets), lengths):
            raise DatasetError("sample lengths in the shard differ from index.safetensors; "
                               "the index is stale (re-run write_manifest)", path=self.path)

    @property
    def base(self) -> torch.Tensor:
        """uint8 [file size]: the whole file mapped copy-on-write (writes never reach the file)."""
        if self._base is None:
            with self._lock:
                if self._base is None:
                    mm = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_COPY)
                    self._base = torch.frombuffer(mm, dtype=torch.uint8)
        return self._base

    def tensor(self, name: str) -> torch.Tensor:
        """Stored tensor `name` as a zero-copy view (copied only if misaligned: foreign files)."""
        e = self.header.tensors[name]
        raw = self.base[e.begin:e.end]
        if e.begin % e.dtype.itemsize:
            raw = raw.clone()
        return raw.view(e.dtype).view(e.shape)

    def rows(self, name: str, j: int) -> torch.Tensor:
        lo, hi = int(self.offsets[j]), int(self.offsets[j + 1])
        return self.tensor(name)[lo:hi]

    def verbatim(self, name: str) -> bool:
        """Whether field `name` is read as stored (not widened, not fp8 aux dequantised)."""
        spec = self.meta["fields"][name]
        fp8 = name == "aux" and self.meta.get("aux_format") == "fp8"
        return spec["dtype"] == spec["stored_dtype"] and not fp8

    @property
    def crc_names(self) -> list[str]:
        """The per-token tensors the sample crc covers, in crc order (sorted names)."""
        return sorted(n for n in self.header.tensors if n not in (OFFSETS, SAMPLE_CRC))

    def crc_table(self) -> np.ndarray:
        """int64 [n]: the stored per-sample crcs, checked against the shard checksum."""
        stored = self.tensor(SAMPLE_CRC).numpy()
        if table_checksum(self.offsets, stored) != self.meta["checksum"]:
            raise DatasetError("the per-sample checksum table does not match the shard checksum "
                               "(corrupted file); re-create the shard", path=self.path)
        return stored

    def sample(self, j: int, names=None) -> dict[str, torch.Tensor]:
        out = {}
        for name, spec in self.meta["fields"].items():
            if names is not None and name not in names:
                continue
            t = self.rows(name, j)
            if name == "aux" and self.meta.get("aux_format") == "fp8":
                t = dequantize_fp8(t, self.rows(AUX_SCALE, j))
            elif spec["dtype"] != spec["stored_dtype"]:
                t = t.to(dtype_from_name(spec["dtype"]))
            out[name] = t
        return out

    def read_into(self, j: int, out: dict[str, torch.Tensor], length: int) -> None:
        """Copy the first `length` tokens of sample j into out[name][:length] for each field.

        Fields stored in their read dtype are read with pread straight into the destination
        (one copy, no page faults on a mapping; the buffer must have that dtype); converted
        fields go through the mapping. Buffers with too few or wrong-sized rows raise DatasetError.
        """
        lo = int(self.offsets[j])
        fp8 = self.meta.get("aux_format") == "fp8"
        for name in self.meta["fields"]:
            dst = out.get(name)
            if dst is None:
                continue
            e = self.header.tensors[name]
            verbatim = self.verbatim(name)
            _check_buffer(name, dst, e, e.dtype if verbatim else None, length, self.path)
            dst = dst[:length]
            if name == "aux" and fp8:
                q = self.tensor(name)[lo:lo + length]
                dequantize_fp8(q, self.tensor(AUX_SCALE)[lo:lo + length],
                               out=dst.view(q.shape))
            elif verbatim and dst.is_contiguous():  # pread path
                row = e.nbytes // e.shape[0]
                buf = memoryview(as_numpy_bytes(dst).reshape(-1).view(np.uint8))
                pread_exact(self.file.fileno(), buf, e.begin + lo * row, self.path)
            else:
                dst.copy_(self.tensor(name)[lo:lo + length].reshape(dst.shape))

    def bad_checksums(self) -> list[int]:
        """Local indices of samples whose stored bytes no longer match their crc32."""
        stored = self.crc_table()
        actual = crc32_rows([as_numpy_bytes(self.tensor(n)) for n in self.crc_names],
                            self.offsets)
        return np.nonzero(actual != stored)[0].tolist()

    def nonfinite_samples(self) -> list[int]:
        bad: set[int] = set()
        names = [n for n in (*FLOAT_FIELDS, AUX_SCALE) if n in self.header.tensors]
        for name in names:
            tok = nonfinite_tokens(self.tensor(name)).nonzero().flatten()
            if tok.numel():
                bad.update(np.searchsorted(self.offsets, tok.numpy(), side="right") - 1)
        return sorted(int(b) for b in bad)


class Dataset:
    """A read-only eyas dataset. `ds[i]` -> dict of CPU tensors (see FORMAT.md for the fields)."""

    def __init__(self, root: Path, manifest: dict[str, Any], lengths: np.ndarray,
                 shard_first: np.ndarray, *, check_finite: bool = False,
                 max_open_shards: int = 256):
        self.root = root
        self.manifest = manifest
        self.check_finite = check_finite
        self._shard_entries = manifest["shards"]
        self._first = shard_first                                  # [S+1] first sample per shard
        self._all_lengths = lengths                                # [N] int64
        self._keep: np.ndarray | None = None                      # filtered view (skip mode)
        self._sample_shard: np.ndarray | None = None              # [N] shard of each sample
        self.skipped: list[dict[str, Any]] = []
        self.read_checks: ReadChecks | None = None               # see enable_read_checks
        self._cache: OrderedDict[int, ShardFile] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._max_open = max(1, max_open_shards)

    # ---- description -------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def fields(self) -> dict[str, dict[str, Any]]:
        """{name: {"dtype", "stored_dtype", "shape" (per token)}} shared by every shard."""
        return self.manifest["fields"]

    @property
    def aux_format(self) -> str | None:
        return self.manifest.get("aux_format")

    @property
    def sample_lengths(self) -> np.ndarray:
        """int64 [len(self)]: tokens per sample, from index.safetensors (no shard is read)."""
        return self._all_lengths if self._keep is None else self._all_lengths[self._keep]

    @property
    def num_tokens(self) -> int:
        return int(self.sample_lengths.sum())

    @property
    def num_shards(self) -> int:
        return len(self._shard_entries)

    def shard_path(self, s: int) -> Path:
        return self.root / self._shard_entries[s]["file"]

    def __len__(self) -> int:
        return len(self._all_lengths) if self._keep is None else len(self._keep)

    def __repr__(self) -> str:
        return (f"Dataset({str(self.root)!r}, kind={self.kind}, samples={len(self)}, "
                f"tokens={self.num_tokens}, shards={self.num_shards}, aux={self.aux_format})")

    # ---- access ------------------------------------------------------------------------
    def locate(self, i: int) -> tuple[int, int]:
        """(shard index, sample index inside the shard) of sample i; O(1) table lookup."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n} samples")
        g = int(i % n if self._keep is None else self._keep[i % n])
        if self._sample_shard is None:   # built on first use: 4 bytes per sample
            counts = np.diff(self._first)
            self._sample_shard = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        s = int(self._sample_shard[g])
        return s, g - int(self._first[s])

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (e.g. for spawned worker processes): open shards are not carried over."""
        state = self.__dict__.copy()
        state["_cache"], state["_cache_lock"] = OrderedDict(), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache_lock = threading.Lock()

    def shard(self, s: int) -> ShardFile:
        with self._cache_lock:
            sh = self._cache.get(s)
            if sh is not None:
                self._cache.move_to_end(s)
                return sh
        entry = dict(self._shard_entries[s], fields=self.fields, aux_format=self.aux_format)
        lengths = self._all_lengths[self._first[s]:self._first[s + 1]]
        sh = ShardFile(self.shard_path(s), entry, lengths)
        with self._cache_lock:
            self._cache[s] = sh
            while len(self._cache) > self._max_open:
                self._cache.popitem(last=False)
        return sh

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.sample(i)

    def sample(self, i: int, fields: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Sample i (optionally only `fields`): zero-copy views where the stored dtype allows."""
        s, j = self.locate(i)
        sh = self.shard(s)
        out = sh.sample(j, fields)
        if self.check_finite:
            for name in FLOAT_FIELDS:
                if name in out and not bool(torch.isfinite(out[name]).all()):
                    raise DatasetError(f"field {name!r} has NaN/inf values (shard-local sample "
                                       f"{j}); open with nonfinite='skip' to drop such samples",
                                       path=sh.path, sample=i)
        return out

    def read_into(self, i: int, out: dict[str, torch.Tensor], length: int | None = None) -> int:
        """Copy sample i (its first `length` tokens) into the buffers `out[name][:length]`.

        Returns the number of tokens copied. Fields absent from `out` are skipped; `aux` buffers
        may be [*, 3*tH] or [*, 3, tH]. Used by the packed loader (no intermediate tensors).
        With `enable_read_checks`, a sample's first read raises DatasetError on a crc mismatch
        or NaN/inf (`data.verify.SkippedSample` when such samples are skipped).
        """
        s, j = self.locate(i)
        g = int(self._first[s]) + j
        n = int(self._all_lengths[g])
        length = n if length is None else min(length, n)
        sh, checks = self.shard(s), self.read_checks
        check = checks is not None and checks.before_read(sh, s, j, g)
        sh.read_into(j, out, length)
        if check:
            checks.after_read(sh, s, j, g, out, length)
        return length

    def enable_read_checks(self, *, checksum: bool = True, nonfinite: str = "error") -> ReadChecks:
        """Check each sample's crc32 and NaN/inf on its first `read_into` (data.verify)."""
        self.read_checks = ReadChecks(checksum=checksum, nonfinite=nonfinite)
        return self.read_checks

    # ---- verification ------------------------------------------------------------------
    def verify_headers(self) -> None:
        """Open every shard (header + offsets only) and check it against the manifest."""
        for s in progress(range(self.num_shards), desc="checking shard headers", unit="shard"):
            self.shard(s)

    def scan(self, *, checksum: bool = True, finite: bool = True,
             nonfinite: str = "error") -> list[dict[str, Any]]:
        """Read every sample: crc32 (checksum=True) and NaN/inf (finite=True) checks.

        A checksum mismatch always raises DatasetError naming the shard file and sample.
        Non-finite samples raise (nonfinite="error") or are dropped from this dataset
        (nonfinite="skip": len() shrinks, the drops are listed in `self.skipped` and logged).
        """
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
        bad_global: list[int] = []
        for s in progress(range(self.num_shards), desc="verifying shards", unit="shard"):
            sh = self.shard(s)
            first = int(self._first[s])
            if checksum:
                bad = sh.bad_checksums()
                if bad:
                    raise DatasetError(
                        f"checksum mismatch in {len(bad)} sample(s) (first: shard-local sample "
                        f"{bad[0]}); the file is corrupted: re-create or re-download it",
                        path=sh.path, sample=first + bad[0])
            if finite:
                for j in sh.nonfinite_samples():
                    if nonfinite == "error":
                        raise DatasetError(
                            f"sample has NaN/inf values (shard-local sample {j}); open with "
                            f"nonfinite='skip' to drop such samples", path=sh.path,
                            sample=first + j)
                    bad_global.append(first + j)
                    self.skipped.append({"sample": first + j, "file": sh.path.name, "local": j,
                                         "reason": "nonfinite"})
        if bad_global:
            keep = np.ones(len(self._all_lengths), dtype=bool)
            keep[bad_global] = False
            self._keep = np.nonzero(keep)[0]
            log.warning("skipped %d of %d samples with NaN/inf values (first: %s sample %d); "
                        "see Dataset.skipped", len(bad_global), len(keep),
                        self.skipped[0]["file"], self.skipped[0]["local"])
        return self.skipped


def _load_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST_NAME
    if not path.is_file():
        shards = list(root.glob(SHARD_GLOB)) if root.is_dir() else []
        hint = (f"it holds {len(shards)} shard files but no manifest: the producer did not "
                f"finish (re-run it to resume; it writes the manifest last)") if shards else \
            "not an eyas dataset directory"
        raise DatasetError(f"no {MANIFEST_NAME}: {hint}", path=root)
    try:
        manifest = json.loads(path.read_text())
        manifest["shards"], manifest["fields"], manifest["kind"]
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"garbled manifest ({e!r}); re-run write_manifest", path=path) from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DatasetError(f"manifest format_version {manifest.get('format_version')!r}, this eyas "
                           f"reads version {FORMAT_VERSION}; convert or re-create the dataset",
                           path=path)
    return manifest


def open_dataset(path: str | os.PathLike, *, verify: str = "none", nonfinite: str = "error",
                 check_finite: bool = False, max_open_shards: int = 256) -> Dataset:
    """Open the dataset in directory `path` (reads the manifest and the length index only).

    Args:
        verify: "none" (each shard's header checked on its first access: truncation, garbled
            header, manifest mismatch), "header" (every shard's header now), "checksum" (also
            every sample's crc32 and NaN/inf check; reads all data).
        nonfinite: what a NaN/inf sample found by a scan does: "error" raises DatasetError,
            "skip" drops it (counted, logged, listed in `Dataset.skipped`). "skip" scans the
            float fields at open even when verify != "checksum".
        check_finite: also check float fields of every sample returned by `ds[i]`.
        max_open_shards: bound of the open-shard LRU cache (file handles + mappings).
    """
    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {VERIFY_LEVELS}, got {verify!r}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    root = Path(path)
    manifest = _load_manifest(root)
    index_path = root / manifest.get("index", INDEX_NAME)
    try:
        from safetensors.numpy import load_file
        idx = load_file(str(index_path))
        lengths = idx["sample_lengths"].astype(np.int64)
        first = idx["shard_first_sample"].astype(np.int64)
    except (OSError, KeyError, Exception) as e:  # safetensors raises its own error types
        raise DatasetError(f"unreadable sample index ({e}); re-run write_manifest",
                           path=index_path) from None
    counts = [s["n_samples"] for s in manifest["shards"]]
    if len(first) != len(counts) + 1 or not np.array_equal(np.diff(first), counts) \
            or len(lengths) != first[-1]:
        raise DatasetError("index.safetensors does not match the manifest's shard sample counts; "
                           "re-run write_manifest", path=index_path)
    ds = Dataset(root, manifest, lengths, first, check_finite=check_finite,
                 max_open_shards=max_open_shards)
    if verify in ("header", "checksum"):
        ds.verify_headers()
    if verify == "checksum" or nonfinite == "skip":
        ds.scan(checksum=verify == "checksum", finite=True, nonfinite=nonfinite)
    return ds
