"""Writing eyas dataset shards and manifests; `open_dataset` re-exported for readers.

The on-disk format (version 1) is data/store/FORMAT.md.

Producers call:

    meta = write_shard(out_dir, i, samples, aux_format="bf16")   # one call per shard, atomic
    write_manifest(out_dir, {"kind": "hidden", "target": ...}, metas)  # once, at the end

Readers call `open_dataset(out_dir)` (see data/store/dataset.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from eyas.data.store.dataset import Dataset, open_dataset
from eyas.data.store.format import (AUX_FORMATS, AUX_SCALE, DATASET_FORMAT, FLOAT_FIELDS,
                                    FORMAT_VERSION, ID_FIELDS, INDEX_NAME, KINDS, MANIFEST_NAME,
                                    OFFSETS, READ_DTYPES, RESERVED, SAMPLE_CRC, SHARD_FORMAT,
                                    SHARD_GLOB, DatasetError, as_numpy_bytes, crc32_rows,
                                    dequantize_fp8, dtype_name, json_meta, nonfinite_tokens,
                                    quantize_fp8, read_shard_header, table_checksum)
from eyas.data.common.utils import atomic_path, atomic_write_json

__all__ = ["Dataset", "DatasetError", "open_dataset", "write_shard", "read_shard_meta",
           "write_manifest", "shard_name", "quantize_fp8", "dequantize_fp8"]

log = logging.getLogger(__name__)

_INT32_MAX = 2**31 - 1


def shard_name(index: int) -> str:
    """File name of shard `index`: 'shard-00042.safetensors'."""
    return f"shard-{index:05d}.safetensors"


def _store_field(name: str, t: torch.Tensor, path: Path) -> torch.Tensor:
    """Cast a concatenated field [T, ...] to its stored dtype (see READ_DTYPES / FORMAT.md)."""
    if name in ID_FIELDS:
        if t.is_floating_point() or t.dtype == torch.bool:
            raise DatasetError(f"field {name!r} must hold integer token ids, got {t.dtype}",
                               path=path)
        if t.numel() and (int(t.min()) < -_INT32_MAX - 1 or int(t.max()) > _INT32_MAX):
            raise DatasetError(f"field {name!r} has ids outside int32 range "
                               f"[{int(t.min())}, {int(t.max())}]", path=path)
        return t.to(torch.int32)
    if name == "loss_mask":
        if t.is_floating_point():
            raise DatasetError(f"loss_mask must be bool or 0/1 integers, got {t.dtype}", path=path)
        if t.dtype != torch.bool and t.numel() and not bool(((t == 0) | (t == 1)).all()):
            raise DatasetError("loss_mask must hold only 0/1 values", path=path)
        return t.to(torch.bool)
    if name in FLOAT_FIELDS:
        if not t.is_floating_point():
            raise DatasetError(f"field {name!r} must be floating point, got {t.dtype}", path=path)
        return t.to(READ_DTYPES[name])
    return t


def _check_samples(samples: Sequence[Mapping[str, torch.Tensor]], path: Path
                   ) -> tuple[list[str], list[int]]:
    """Field names (sorted) and sample lengths; raises DatasetError on any inconsistency."""
    if not samples:
        raise DatasetError("write_shard needs at least one sample", path=path)
    names = sorted(samples[0])
    if "input_ids" not in names:
        raise DatasetError(f"samples need an 'input_ids' field; got fields {names}", path=path)
    bad = [n for n in names if n in RESERVED]
    if bad:
        raise DatasetError(f"field names {bad} are reserved by the shard format", path=path)
    ref_shapes = {n: tuple(samples[0][n].shape[1:]) for n in names}
    lengths = []
    for i, s in enumerate(samples):
        if sorted(s) != names:
            raise DatasetError(f"sample {i} has fields {sorted(s)}, sample 0 has {names}; every "
                               f"sample of a shard needs the same fields", path=path)
        T = int(s["input_ids"].shape[0]) if s["input_ids"].dim() == 1 else -1
        if T <= 0:
            raise DatasetError(f"sample {i}: input_ids must be 1-D and non-empty, got shape "
                               f"{list(s['input_ids'].shape)}", path=path, sample=i)
        for n in names:
            t = s[n]
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != T:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise DatasetError(f"sample {i}: field {n!r} has shape {shape}; expected "
                                   f"[{T}, ...] (token-major, T = len(input_ids))",
                                   path=path, sample=i)
            if tuple(t.shape[1:]) != ref_shapes[n]:
                raise DatasetError(f"sample {i}: field {n!r} has per-token shape "
                                   f"{list(t.shape[1:])}, sample 0 has {list(ref_shapes[n])}",
                                   path=path, sample=i)
        lengths.append(T)
    if "aux" in names and (len(ref_shapes["aux"]) != 2 or ref_shapes["aux"][0] != 3):
        raise DatasetError(f"field 'aux' must be [T, 3, tH] (the three aux states, ascending "
                           f"layer order); got per-token shape {list(ref_shapes['aux'])}",
                           path=path)
    if "last" in names and len(ref_shapes["last"]) != 1:
        raise DatasetError(f"field 'last' must be [T, tH]; got per-token shape "
                           f"{list(ref_shapes['last'])}", path=path)
    return names, lengths


def _raise_nonfinite(bad: dict[str, torch.Tensor], offsets: np.ndarray, path: Path) -> None:
    """bad: {field: bool [T] non-finite token rows}; raises DatasetError naming the samples."""
    rows = torch.stack(list(bad.values())).any(dim=0).nonzero().flatten()
    if not rows.numel():
        return
    samples = np.unique(np.searchsorted(offsets, rows.numpy(), side="right") - 1)
    first = int(samples[0])
    fields = sorted(n for n, b in bad.items() if b.any())
    raise DatasetError(
        f"NaN/inf values in {len(samples)} sample(s) (first: sample {first}, token "
        f"{int(rows[0]) - int(offsets[first])}; fields {fields}); drop those samples or pass "
        f"check_finite=False to store them anyway", path=path, sample=first)


def write_shard(dataset_dir: str | os.PathLike, index: int,
                samples: Sequence[Mapping[str, torch.Tensor]], *, aux_format: str = "bf16",
                check_finite: bool = True, file_name: str | None = None,
                fsync: bool = True) -> dict[str, Any]:
    """Write `samples` as `dataset_dir/shard-{index:05d}.safetensors`, atomically.

    Args:
        samples: dicts of CPU tensors, every field token-major `[T_i, ...]` with the same fields
            and per-token shapes in every sample. Known fields are cast to their stored dtype
            (FORMAT.md "Shards"); other fields are stored as given.
        aux_format: "bf16" (exact) or "fp8" (FORMAT.md "fp8 aux"; readers dequantise to bf16).
        check_finite: refuse NaN/inf in float fields (DatasetError naming the sample).
        file_name: another file name in `dataset_dir` (a streamed run's one-sample spool
            files); fsync: flush it to the disk before it appears (off for such a spool).

    Returns:
        the shard meta (also stored in the file header): file, index, n_samples, n_tokens,
        fields, aux_format, checksum, bytes, sample_lengths.
    """
    root = Path(dataset_dir)
    path = root / (file_name or shard_name(index))
    if aux_format not in AUX_FORMATS:
        raise ValueError(f"aux_format must be one of {AUX_FORMATS}, got {aux_format!r}")
    names, lengths = _check_samples(samples, path)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    tensors: dict[str, torch.Tensor] = {}
    fields: dict[str, dict[str, Any]] = {}
    nonfinite: dict[str, torch.Tensor] = {}
    for n in names:
        cat = torch.cat([s[n].detach().cpu() for s in samples]) if len(samples) > 1 \
            else samples[0][n].detach().cpu()
        stored = _store_field(n, cat, path).contiguous()
        if check_finite and n in FLOAT_FIELDS:
            nonfinite[n] = nonfinite_tokens(stored)
        read_dtype = READ_DTYPES.get(n, stored.dtype)
        if n == "aux" and aux_format == "fp8":
            stored, scale = quantize_fp8(stored)
            tensors[AUX_SCALE] = scale.contiguous()
        tensors[n] = stored
        fields[n] = {"dtype": dtype_name(read_dtype), "stored_dtype": dtype_name(stored.dtype),
                     "shape": list(stored.shape[1:])}

    if nonfinite:
        _raise_nonfinite(nonfinite, offsets, path)
    data_names = sorted(tensors)  # the crc covers every per-token tensor, incl. aux_scale
    sample_crcs = crc32_rows([as_numpy_bytes(tensors[n]) for n in data_names], offsets)
    tensors[OFFSETS] = torch.from_numpy(offsets)
    tensors[SAMPLE_CRC] = torch.from_numpy(sample_crcs)
    meta = {
        "format": SHARD_FORMAT, "format_version": FORMAT_VERSION, "index": int(index),
        "n_samples": len(lengths), "n_tokens": int(offsets[-1]),
        "aux_format": aux_format if "aux" in fields else None,
        "fields": fields, "checksum": table_checksum(offsets, sample_crcs),
    }
    with atomic_path(path, fsync=fsync) as tmp:
        save_file(tensors, str(tmp), metadata={"eyas": json_meta(meta)})
        size = tmp.stat().st_size       # before it appears: a reader may remove it at once
    meta = dict(meta, file=path.name, bytes=size,
                sample_lengths=[int(x) for x in lengths])
    log.debug("wrote %s: %d samples, %d tokens", path, meta["n_samples"], meta["n_tokens"])
    return meta


def read_shard_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The meta `write_shard` returned for this file, recovered from the file alone.

    Reads the header and the small offsets table, not the data. Raises DatasetError for a
    truncated file, a garbled header or a file that is not an eyas shard.
    """
    path = Path(path)
    with open(path, "rb") as f:
        _, meta, offsets = read_shard_header(path, f)
    return dict(meta, file=path.name, bytes=path.stat().st_size,
                sample_lengths=np.diff(offsets).tolist())


def write_manifest(dataset_dir: str | os.PathLike, manifest: Mapping[str, Any],
                   shard_metas: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Write `index.safetensors` and then `manifest.json` (the dataset's commit point), atomically.

    Args:
        manifest: producer information, stored as given. Must contain `kind` ("tokens" or
            "hidden"); typically also target name/config, aux_layer_ids with
            "convention": "hf_hidden_states", hidden_size, teacher kind, tokenizer hash.
        shard_metas: the dicts `write_shard` returned, in any order. None: read them from the
            shard files present (`read_shard_meta`). Shard indices must be 0..S-1 without gaps.

    Returns the manifest as written. Per-shard entries carry file, n_samples, n_tokens, bytes and
    checksum; totals and the common field table are added at the top level.
    """
    root = Path(dataset_dir)
    if shard_metas is None:
        shard_metas = [read_shard_meta(p) for p in sorted(root.glob(SHARD_GLOB))]
    metas = sorted((dict(m) for m in shard_metas), key=lambda m: m["index"])
    if not metas:
        raise DatasetError("no shards to put in the manifest", path=root)
    idx = [m["index"] for m in metas]
    if idx != list(range(len(metas))):
        missing = sorted(set(range(max(idx) + 1)) - set(idx))
        raise DatasetError(f"shard indices must be 0..{len(metas) - 1} without gaps or duplicates; "
                           f"got {len(metas)} shards, missing {missing[:10]}", path=root)
    kind = manifest.get("kind")
    if kind not in KINDS:
        raise ValueError(f"manifest['kind'] must be one of {KINDS}, got {kind!r}")
    if manifest.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise ValueError(f"manifest['format_version'] is set by write_manifest ({FORMAT_VERSION}); "
                         f"got {manifest['format_version']!r}")
    ref = metas[0]
    fields, aux_format = ref["fields"], ref.get("aux_format")
    for m in metas[1:]:
        if m["fields"] != fields or m.get("aux_format") != aux_format:
            raise DatasetError(
                f"shard {m['file']} has fields {m['fields']} / aux_format {m.get('aux_format')}, "
                f"but {ref['file']} has {fields} / {aux_format}; every shard of a dataset must "
                f"share fields, dtypes, shapes and aux format", path=root)
    if kind == "hidden" and "aux" not in fields:
        raise DatasetError(f"kind 'hidden' needs an 'aux' field; shards have {sorted(fields)}",
                           path=root)
    for m in metas:
        f = root / m["file"]
        if not f.is_file() or ("bytes" in m and f.stat().st_size != m["bytes"]):
            raise DatasetError(f"shard {m['file']} is missing or has changed size since it was "
                               f"written", path=f)

    lengths = np.concatenate([np.asarray(m["sample_lengths"], dtype=np.int32) for m in metas])
    first = np.zeros(len(metas) + 1, dtype=np.int64)
    np.cumsum([m["n_samples"] for m in metas], out=first[1:])
    with atomic_path(root / INDEX_NAME) as tmp:
        save_file({"sample_lengths": torch.from_numpy(lengths),
                   "shard_first_sample": torch.from_numpy(first)}, str(tmp),
                  metadata={"format": SHARD_FORMAT})

    out: dict[str, Any] = {"format": DATASET_FORMAT, "format_version": FORMAT_VERSION}
    out.update({k: v for k, v in manifest.items() if k not in ("format", "format_version")})
    out.update({
        "fields": fields, "aux_format": aux_format,
        "n_samples": int(first[-1]), "n_tokens": int(sum(m["n_tokens"] for m in metas)),
        "n_shards": len(metas), "bytes": int(sum(m["bytes"] for m in metas)),
        "index": INDEX_NAME,
        "shards": [{"file": m["file"], "n_samples": m["n_samples"], "n_tokens": m["n_tokens"],
                    "bytes": m["bytes"], "checksum": m["checksum"]} for m in metas],
    })
    atomic_write_json(root / MANIFEST_NAME, out)
    return out
