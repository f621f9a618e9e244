"""`eyas inspect DIR`: what a dataset holds, from its manifest, index and shard headers (every
shard's header and file size are checked: a truncated or garbled shard is an error naming it;
no sample data is read).

`--samples N` also shows the first N samples as decoded text with the trained tokens marked
(`data.store.render`); `--raw` shows their ids instead.

A directory with shards but no manifest (a producer still running, or one that stopped) is
summarised from the shard headers and reported as incomplete.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eyas.data.store.format import MANIFEST_NAME, SHARD_GLOB, dtype_from_name
from eyas.data.common.options import option
from eyas.data.store.render import dataset_tokenizer, default_style, render_sample, sample_header
from eyas.data.common.space import human_bytes


def _field_bytes(fields: dict[str, Any], aux_format: str | None) -> dict[str, float]:
    """Stored bytes per token of each field (fp8 aux includes its 3 fp32 scales)."""
    out = {}
    for name, spec in fields.items():
        per = int(np.prod(spec["shape"], dtype=np.int64)) if spec["shape"] else 1
        out[name] = per * dtype_from_name(spec["stored_dtype"]).itemsize
        if name == "aux" and aux_format == "fp8":
            out[name] += 3 * 4
    return out


def summarize(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON-able summary of the dataset at `path` (see module docstring)."""
    root = Path(path)
    if not (root / MANIFEST_NAME).is_file():
        from eyas.data.store.shards import read_shard_meta
        metas = [read_shard_meta(p) for p in sorted(root.glob(SHARD_GLOB))]
        if not metas:
            raise FileNotFoundError(f"{root}: neither a manifest nor shards; not a dataset")
        lengths = np.concatenate([np.asarray(m["sample_lengths"]) for m in metas])
        m0 = metas[0]
        man = {"kind": None, "fields": m0["fields"], "aux_format": m0["aux_format"],
               "n_shards": len(metas), "bytes": sum(m["bytes"] for m in metas)}
        complete = False
    else:
        from eyas.data.store.dataset import open_dataset
        ds = open_dataset(root)
        ds.verify_headers()   # every shard's header and size: a truncated shard is named here
        man, lengths, complete = ds.manifest, ds.sample_lengths, True
    n_tokens = int(lengths.sum())
    per_field = _field_bytes(man["fields"], man.get("aux_format"))
    teacher = man.get("teacher")
    return {
        "path": str(root), "complete": complete, "kind": man.get("kind"),
        "format_version": man.get("format_version"),
        "samples": int(len(lengths)), "tokens": n_tokens, "shards": man["n_shards"],
        "bytes": int(man["bytes"]), "bytes_per_token": man["bytes"] / max(1, n_tokens),
        "payload_bytes_per_token": float(sum(per_field.values())),
        "field_bytes_per_token": per_field,
        "fields": {k: {"dtype": v["dtype"], "stored": v["stored_dtype"], "shape": v["shape"]}
                   for k, v in man["fields"].items()},
        "aux_format": man.get("aux_format"),
        "teacher": teacher.get("kind") if isinstance(teacher, dict) else teacher,
        "teacher_detail": teacher,
        "target": man.get("target"), "aux_layer_ids": man.get("aux_layer_ids"),
        "convention": man.get("convention"), "hidden_size": man.get("hidden_size"),
        "tokenizer": man.get("tokenizer"), "template_kwargs": man.get("template_kwargs"),
        "prepare": man.get("prepare"),
        "length": ({"min": int(lengths.min()), "mean": float(lengths.mean()),
                    "p50": float(np.percentile(lengths, 50)),
                    "p95": float(np.percentile(lengths, 95)), "max": int(lengths.max())}
                   if len(lengths) else None),
    }


def _line(label: str, *parts: tuple[str, Any]) -> str | None:
    """``label`` then the parts whose value is known (not None) as "name value", three spaces
    apart; None when none is known."""
    known = "   ".join(f"{k} {v}" if k else str(v) for k, v in parts if v is not None)
    return f"{label:<9} {known}" if known else None


def _target(s: dict[str, Any]) -> str | None:
    """What the data was made with: the target and, where recorded, its tokenizer (tokens), or
    the aux layers and hidden size (hidden states)."""
    tok = s["tokenizer"] if isinstance(s.get("tokenizer"), dict) else {}
    layers = s["aux_layer_ids"] and (f"{s['aux_layer_ids']}" + (
        f" ({s['convention']})" if s["convention"] else ""))
    tokenizer = (s["kind"] == "tokens" and tok.get("name_or_path")) or None
    if tokenizer and tok.get("vocab_size"):
        tokenizer += f" ({tok['vocab_size']:,} tokens)"
    return _line("target", ("", s["target"]), ("tokenizer", tokenizer),
                 ("aux layers", layers), ("hidden", s["hidden_size"]))


def _template(s: dict[str, Any]) -> str | None:
    """The chat template the conversations were rendered with, where the manifest records it."""
    tok = s["tokenizer"] if isinstance(s.get("tokenizer"), dict) else {}
    if not tok.get("chat_template_sha256"):
        return None
    name = tok.get("chat_template") or "tokenizer"
    args = ", ".join(f"{k}={v!r}" for k, v in (s.get("template_kwargs") or {}).items())
    return _line("template", ("", "the tokenizer's own" if name == "tokenizer" else repr(name)),
                 ("sha256", tok["chat_template_sha256"][:12] + "…"), ("args", args or None))


def _prepared(s: dict[str, Any]) -> str | None:
    """Where the conversations came from and what `eyas prepare` kept of them."""
    p = s["prepare"] if isinstance(s.get("prepare"), dict) else {}
    if "input" not in p:
        return None
    packed = f" ({p['input_compression']})" if p.get("input_compression") else ""
    skipped = ", ".join(f"{k} {v}" for k, v in (p.get("skipped") or {}).items())
    return _line("input", ("", p["input"] + packed), ("records", p.get("records")),
                 ("trained tokens", p.get("loss_tokens")), ("skipped", skipped or "none"))


def format_summary(s: dict[str, Any]) -> str:
    """Human-readable lines for a `summarize` result; a line or part that does not apply to the
    dataset (aux layers of a token dataset, a template no manifest recorded) is left out."""
    kind = s["kind"] or ("hidden" if "aux" in s["fields"] else "tokens") + " (from its fields)"
    lines = [f"dataset   {s['path']}" + ("" if s["complete"] else "   (INCOMPLETE: no manifest)"),
             _line("kind", ("", kind), ("format", s["format_version"] and
                                        f"v{s['format_version']}")),
             f"samples   {s['samples']:,}   tokens {s['tokens']:,}   shards {s['shards']:,}",
             f"size      {human_bytes(s['bytes'])}   {s['bytes_per_token']:.1f} bytes/token "
             f"({s['payload_bytes_per_token']:.0f} payload)"]
    if s["length"]:
        L = s["length"]
        lines.append(f"lengths   min {L['min']}  mean {L['mean']:.1f}  p50 {L['p50']:.0f}  "
                     f"p95 {L['p95']:.0f}  max {L['max']}")
    lines += [x for x in (_target(s), _template(s), _prepared(s),
                          _line("modes", ("aux", s["aux_format"]), ("teacher", s["teacher"])))
              if x]
    lines.append("fields:")
    for name, f in s["fields"].items():
        shape = f"per token {f['shape']}" if f["shape"] else "one per token"
        lines.append(f"  {name:<14} {f['dtype']:<9} (stored {f['stored']:<13}) {shape:<18} "
                     f"{s['field_bytes_per_token'][name]:.0f} B")
    return "\n".join(lines)


def _raw_sample(i: int, x: dict[str, Any]) -> str:
    desc = "  ".join(f"{k} {list(v.shape)}" for k, v in x.items())
    ids = x["input_ids"][:12].tolist()
    return (f"{sample_header(i, x['input_ids'], x['loss_mask'])}  {desc}\n"
            f"     ids {ids}{' ...' if len(x['input_ids']) > 12 else ''}")


def print_samples(path: str | os.PathLike, n: int, raw: bool = False, target: str | None = None,
                  color: str = "auto") -> None:
    """Print the first `n` samples: decoded with the loss mask marked (data.store.render), or, with
    `raw` or when no tokenizer loads (one line says why), their ids and field shapes."""
    from eyas.data.store.dataset import open_dataset
    ds = open_dataset(path)
    tok = None
    if not raw:
        tok, why = dataset_tokenizer(ds.manifest, target)
        if why:
            print(why if tok is not None else f"showing token ids: no tokenizer loads ({why})")
    style = default_style(color=color)
    for i in range(min(n, len(ds))):
        x = ds[i]
        if tok is None:
            print(_raw_sample(i, x))
        else:
            ids, mask = x["input_ids"].tolist(), x["loss_mask"].tolist()
            print(("\n" if i else "") + render_sample(tok, i, ids, mask, style))


@dataclass(kw_only=True)
class InspectOptions:
    """Summarise an eyas dataset (tokens or hidden states)."""

    dir: str = option(help="dataset directory", positional=True)
    json: bool = option(False, "print the summary as JSON")
    samples: int = option(
        0, "also show the first N samples as decoded text (special tokens included), each run "
        "of trained tokens (loss mask 1) wrapped in [[ ... ]], or coloured on a terminal",
        metavar="N")
    raw: bool = option(False, "with --samples: show token ids and field shapes, not decoded text")
    target: str | None = option(
        None, "with --samples: decode with this target's tokenizer (directory, hub id or preset "
        "name; default: the one the manifest names)", metavar="MODEL")
    color: str = option(
        "auto", "with --samples: colour trained text (auto: on a terminal, unless NO_COLOR is "
        "set); otherwise [[ ]] marks it", choices=("auto", "always", "never"))
    verify: str = option("none", "check shard headers / every checksum and NaN before "
                         "summarising", choices=("none", "header", "checksum"))


def main(args: InspectOptions) -> int:
    """`eyas inspect DIR [--json] [--samples N [--raw] [--target MODEL]] [--verify LEVEL]`."""
    if args.verify != "none":
        from eyas.data.store.dataset import open_dataset
        open_dataset(args.dir, verify=args.verify)
        print(f"verify={args.verify}: ok")
    s = summarize(args.dir)
    print(json.dumps(s, indent=1) if args.json else format_summary(s))
    if args.samples and s["complete"]:
        print_samples(args.dir, args.samples, raw=args.raw, target=args.target, color=args.color)
    return 0
