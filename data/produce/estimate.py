"""What an extraction will cost, before it starts: `eyas extract --estimate ...`.

Bytes come from the format exactly (data/store/FORMAT.md): the shard plan `eyas extract` would make
(the same `plan_shards` and default shard size), and per shard the safetensors file it would
write: the per-token fields (ids and argmax int32, loss mask bool, aux bf16 3·tH or fp8 3·tH +
3 float32 scales, `last` bf16 tH, top-k int32 ids + float32 logits), the offsets and sample crc
tables, and the header (its JSON rebuilt as safetensors writes it: tensors ordered by dtype,
then name, padded with spaces to 8 bytes). Plus `index.safetensors`; `manifest.json` and
`extract_plan.json` are a few KiB more (they hold the target's config).

Time comes from a short timed capture on the real target on this device: the first forwards
of the first shard's plan through the same hooks and argmax/top-k as extraction (one untimed
warm-up forward first), or from a throughput you state (`--tokens-per-s`, nothing loaded).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import torch

from eyas.data.store.format import AUX_FORMATS, SHARD_FORMAT, json_meta

#: safetensors writes tensors by dtype (this rank, eyas's dtypes), then by name
_DTYPE_RANK = {"I64": 0, "F32": 1, "I32": 2, "BF16": 3, "F8_E4M3": 4, "BOOL": 5}
_ITEMSIZE = {"I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F8_E4M3": 1, "BOOL": 1}
_READ = {"I32": "int64", "BOOL": "bool", "BF16": "bfloat16", "F32": "float32",
         "F8_E4M3": "bfloat16"}
_STORED = {"I32": "int32", "BOOL": "bool", "BF16": "bfloat16", "F32": "float32",
           "F8_E4M3": "float8_e4m3fn"}


def hidden_tensors(hidden: int, aux_format: str, teacher: str, topk: int
                   ) -> dict[str, tuple[str, list[int]]]:
    """{tensor: (safetensors dtype, per-token shape)} of the per-token tensors of a shard."""
    out = {"input_ids": ("I32", []), "loss_mask": ("BOOL", []), "target_argmax": ("I32", []),
           "aux": ("F8_E4M3" if aux_format == "fp8" else "BF16", [3, hidden])}
    if aux_format == "fp8":
        out["aux_scale"] = ("F32", [3])
    if teacher in ("last", "both"):
        out["last"] = ("BF16", [hidden])
    if teacher in ("topk", "both"):
        out["topk_ids"], out["topk_logits"] = ("I32", [topk]), ("F32", [topk])
    return out


def _file_bytes(tensors: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> int:
    """Bytes of a safetensors file of these tensors (name, dtype, shape, nbytes): the header's
    8-byte length, the header (the tensors laid out as safetensors orders them, the JSON padded
    with spaces to 8 bytes) and the data."""
    head: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for name, dt, shape, nbytes in sorted(tensors, key=lambda t: (_DTYPE_RANK[t[1]], t[0])):
        head[name] = {"dtype": dt, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    n = len(json.dumps(head, separators=(",", ":")).encode())
    return 8 + n + (-n % 8) + at


def shard_file_bytes(index: int, lengths: list[int], per_token: dict[str, tuple[str, list[int]]],
                     aux_format: str) -> int:
    """The exact size of the shard file `write_shard(dir, index, samples)` writes for samples of
    these lengths with these per-token tensors."""
    n, T = len(lengths), int(sum(lengths))
    tensors = [("offsets", "I64", [n + 1], 8 * (n + 1)), ("sample_crc32", "I64", [n], 8 * n)]
    fields = {}
    for name, (dt, shape) in sorted(per_token.items()):
        tensors.append((name, dt, [T, *shape], math.prod(shape, start=T * _ITEMSIZE[dt])))
        if name != "aux_scale":
            fields[name] = {"dtype": _READ[dt], "stored_dtype": _STORED[dt], "shape": shape}
    meta = {"format": SHARD_FORMAT, "format_version": 1, "index": int(index), "n_samples": n,
            "n_tokens": T, "aux_format": aux_format, "fields": fields,
            "checksum": "crc32:00000000"}
    return _file_bytes(tensors, {"eyas": json_meta(meta)})


def index_file_bytes(n_samples: int, n_shards: int) -> int:
    """The exact size of `index.safetensors` for a dataset of this many samples and shards."""
    tensors = [("sample_lengths", "I32", [n_samples], 4 * n_samples),
               ("shard_first_sample", "I64", [n_shards + 1], 8 * (n_shards + 1))]
    return _file_bytes(tensors, {"format": SHARD_FORMAT})


def estimate_bytes(lengths: list[int], hidden: int, aux_format: str, teacher: str, topk: int,
                   shard_tokens: int | None = None, shard_bytes: int = 1 << 30) -> dict[str, Any]:
    """Bytes on disk of extracting samples of these lengths: shard files (exact, as
    `eyas extract` plans and writes them), the index, and per token."""
    from eyas.data.produce.forward import default_shard_tokens, plan_shards
    topk = topk if teacher != "last" else 0
    if shard_tokens is None:
        shard_tokens = default_shard_tokens(hidden, aux_format, teacher, topk, shard_bytes)
    plan = plan_shards(lengths, shard_tokens)
    per_token = hidden_tensors(hidden, aux_format, teacher, topk)
    shards = sum(shard_file_bytes(j, lengths[a:b], per_token, aux_format)
                 for j, (a, b) in enumerate(plan))
    index = index_file_bytes(len(lengths), len(plan))
    tokens = int(sum(lengths))
    payload = sum(math.prod(shape, start=_ITEMSIZE[dt]) for dt, shape in per_token.values())
    return {"aux_format": aux_format, "teacher": teacher, "topk": topk or None,
            "shards": len(plan), "shard_tokens": shard_tokens, "shard_bytes": shards,
            "index_bytes": index, "bytes": shards + index, "tokens": tokens,
            "payload_bytes_per_token": payload,
            "bytes_per_token": (shards + index) / max(1, tokens)}


@torch.no_grad()
def timed_capture(model, tokens, lengths: list[int], ids: list[int], *, aux_ids: list[int],
                  teacher: str, topk: int, batch_tokens: int, pad_batches: bool,
                  batches: int) -> dict[str, Any]:
    """Tokens/s of the extraction forward (hooks, argmax/top-k) over the first `batches`
    forwards of the samples `ids`, after one untimed warm-up forward."""
    from eyas.data.common.capture import LayerHooks, find_text_model, logit_transform
    from eyas.data.produce.forward import length_groups, run_batch
    text, layers, norm, head = find_text_model(model)
    groups = length_groups(lengths, ids, batch_tokens, pad_batches)
    capture = LayerHooks(layers, aux_ids, norm)
    tf, sync = logit_transform(model.config), getattr(torch, head.weight.device.type, None)
    done = seconds = 0.0
    try:
        for g, idx in enumerate(groups[:batches + 1]):
            batch = [tokens.sample(i, fields=("input_ids", "loss_mask")) for i in idx]
            t0 = time.perf_counter()
            run_batch(text, capture, head, batch, teacher=teacher, topk=topk, row_chunk=1024,
                      vocab_chunk=65536, logit_tf=tf)
            if hasattr(sync, "synchronize"):
                sync.synchronize()
            if g or len(groups) == 1:       # the first forward warms up (unless it is the only)
                seconds += time.perf_counter() - t0
                done += sum(lengths[i] for i in idx)
    finally:
        capture.remove()
    return {"tokens": int(done), "seconds": seconds,
            "tokens_per_s": done / seconds if seconds > 0 else None,
            "device": str(head.weight.device)}


def _target_shape(target, model) -> tuple[int, int]:
    """(hidden size, decoder layers) of the target: from the loaded model, else its config."""
    if model is not None:
        from eyas.data.common.capture import find_text_model
        _, layers, _, head = find_text_model(model)
        n = getattr(model.config.get_text_config(), "num_hidden_layers", len(layers))
        return int(head.weight.shape[1]), min(len(layers), n)
    from eyas.data.common.targets import load_target_config, text_config
    cfg = text_config(load_target_config(target))
    return int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])


def estimate(tokens_dir, target, *, layers: list[int] | None = None, aux_format: str = "bf16",
             teacher: str = "last", topk: int = 32, shard_tokens: int | None = None,
             shard_bytes: int = 1 << 30, max_samples: int | None = None,
             batch_tokens: int = 8192, pad_batches: bool = False, batches: int = 3,
             tokens_per_s: float | None = None, dtype: str = "bfloat16", device=None,
             model=None) -> dict[str, Any]:
    """Bytes per storage mode and the expected capture time of `eyas extract` with these
    settings; `tokens_per_s` given: no target is loaded, the time uses that rate."""
    from eyas.data.common.capture import check_aux_layers
    from eyas.data.produce.forward import TEACHERS, load_model, plan_shards
    from eyas.data.store.shards import open_dataset
    tokens = open_dataset(tokens_dir)
    n = len(tokens) if max_samples is None else min(max_samples, len(tokens))
    lengths = [int(x) for x in tokens.sample_lengths[:n]]
    if tokens_per_s is None and model is None:
        model = load_model(target, dtype, device)
    hidden, n_layers = _target_shape(target, model)
    aux_ids = check_aux_layers(layers, n_layers)
    modes = [estimate_bytes(lengths, hidden, f, t, topk, shard_tokens, shard_bytes)
             for f in AUX_FORMATS for t in TEACHERS]
    chosen = next(m for m in modes if (m["aux_format"], m["teacher"]) == (aux_format, teacher))
    if tokens_per_s is not None:
        timing = {"tokens_per_s": float(tokens_per_s), "source": "stated (--tokens-per-s)"}
    else:
        first = plan_shards(lengths, chosen["shard_tokens"])[0] if lengths else [0, 0]
        timing = timed_capture(model, tokens, lengths, list(range(*first)), aux_ids=aux_ids,
                               teacher=teacher, topk=topk if teacher != "last" else 0,
                               batch_tokens=batch_tokens, pad_batches=pad_batches,
                               batches=batches)
        timing["source"] = (f"timed: {timing['tokens']} tokens in {timing['seconds']:.2f} s "
                            f"on {timing['device']} ({dtype})")
    rate = timing["tokens_per_s"]
    return {"tokens_dir": str(tokens_dir), "target": str(target), "samples": n,
            "tokens": int(sum(lengths)), "hidden_size": hidden, "aux_layer_ids": aux_ids,
            "modes": modes, "chosen": {"aux_format": aux_format, "teacher": teacher},
            "bytes": chosen["bytes"], "timing": timing,
            "seconds": sum(lengths) / rate if rate else None}


def format_estimate(r: dict[str, Any]) -> str:
    """The estimate as lines: one per storage mode, the chosen one marked, then the time."""
    from eyas.data.common.space import human_bytes
    lines = [f"estimate: {r['samples']:,} samples, {r['tokens']:,} tokens of {r['tokens_dir']} "
             f"through {r['target']} (hidden {r['hidden_size']}, aux layers "
             f"{r['aux_layer_ids']})",
             f"  {'aux':<5}{'teacher':<12}{'bytes/token':>12}{'shards':>8}{'on disk':>12}"]
    for m in r["modes"]:
        mark = " <- these settings" if (m["aux_format"], m["teacher"]) == (
            r["chosen"]["aux_format"], r["chosen"]["teacher"]) else ""
        teacher = m["teacher"] + (f" k={m['topk']}" if m["topk"] else "")
        lines.append(f"  {m['aux_format']:<5}{teacher:<12}{m['payload_bytes_per_token']:>12,}"
                     f"{m['shards']:>8,}{human_bytes(m['bytes']):>12}{mark}")
    lines.append("  (bytes/token: the per-token fields; on disk: shard files and index exactly, "
                 "plus a few KiB of manifest and plan)")
    t = r["timing"]
    if r["seconds"] is None:
        lines.append(f"time: no rate ({t['source']})")
    else:
        lines.append(f"time: {r['seconds']:,.0f} s ({r['seconds'] / 3600:.2f} h) for one "
                     f"process at {t['tokens_per_s']:,.0f} tokens/s, {t['source']}; G "
                     f"data-parallel processes take about 1/G of it")
    return "\n".join(lines)


def cli_estimate(args) -> int:
    """`eyas extract --estimate ...`: print the estimate (the extract arguments, no --out)."""
    from eyas.data.common.targets import target_dtype_name
    device = None if args.device == "auto" else args.device
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    r = estimate(args.tokens, args.target, layers=layers, aux_format=args.aux_format,
                 teacher=args.teacher, topk=args.topk, shard_tokens=args.shard_tokens,
                 max_samples=args.max_samples, batch_tokens=args.batch_tokens,
                 pad_batches=args.pad_batches, batches=args.estimate_batches,
                 tokens_per_s=args.tokens_per_s, dtype=target_dtype_name(args.dtype, device),
                 device=device)
    print(format_estimate(r))
    return 0
