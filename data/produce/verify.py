"""`eyas verify DATASET --target MODEL`: re-capture samples through the target and compare them
with what a hidden-state dataset stores.

Checksums prove that a file holds what its writer wrote, not that the writer wrote the right
thing: hidden states of one request stored under another's ids, samples moved between shards
(with their checksums recomputed), a dataset captured from other weights. `verify` re-runs N
random samples through the target as `eyas extract` ran it (the manifest's target dtype, aux
layer ids and teacher; each sample alone and unpadded, which is bitwise what an extraction of
equal-length batches on the same device stores) and reports, per sample and field, the max
abs error, the lowest cosine and the tokens over the storage mode's bound (data/produce/verify_checks.py,
data/store/FORMAT.md):

- identity: the manifest's target (weight fingerprint, hidden size, layers, vocabulary, config,
  aux layer ids) against `--target`;
- ``input_ids``, ``loss_mask``: equal to the token dataset's sample that extraction read
  (the manifest's ``tokens_dataset``, or ``--tokens``); the target runs on those ids;
- ``aux``, ``last``, ``topk_logits``, ``topk_ids``, ``target_argmax``: within their bounds.

Exit status: 0 clean, 1 findings, 2 usage error (like `eyas validate`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.common.options import option
from eyas.data.produce.verify_checks import argmax_check, ids_check, state_check, topk_checks

#: default compute tolerance: room for the target's own rounding across devices and batching
COMPUTE_TOL = 2.0**-5
#: fresh top-K computed for the teacher and argmax checks: the stored k plus this margin
TOPK_MARGIN = 8
# config keys that change with the transformers version or the loading, not the model
_VOLATILE = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures",
             "use_cache", "_attn_implementation_autoset", "output_hidden_states"}


class VerifyError(ValueError):
    """A dataset or target verify cannot work with; the message says what to pass instead."""


def _item(check: str, ok: bool | None, dataset: Any, target: Any, note: str = "") -> dict:
    return {"check": check, "ok": ok, "dataset": dataset, "target": target, "note": note}


def identity(manifest: dict[str, Any], model: torch.nn.Module, target: str,
             num_layers: int, hidden: int, vocab: int) -> tuple[list[dict], bool]:
    """(identity items, whether the values can be compared at all). ok None: not decided."""
    from eyas.data.common.capture import check_aux_layers, target_fingerprint
    items = [_item("name", True if manifest.get("target") == str(target) else None,
                   manifest.get("target"), str(target),
                   "" if manifest.get("target") == str(target) else
                   "named differently: the fingerprint and the values decide")]
    fp, now_fp = manifest.get("target_fingerprint"), target_fingerprint(model)
    items.append(_item("fingerprint", None if fp is None else fp == now_fp, fp, now_fp,
                       "not recorded in the manifest" if fp is None else ""))
    comparable = True
    for key, now in (("hidden_size", hidden), ("num_layers", num_layers), ("vocab_size", vocab)):
        was = manifest.get(key)
        items.append(_item(key, None if was is None else was == now, was, now))
        comparable &= was is None or was == now or key == "num_layers"
    ids = manifest.get("aux_layer_ids")
    try:
        check_aux_layers(ids, num_layers)
        items.append(_item("aux_layer_ids", True, ids, f"valid for {num_layers} layers"))
    except (ValueError, TypeError) as e:
        items.append(_item("aux_layer_ids", False, ids, f"{num_layers} layers", str(e)))
        comparable = False
    was = manifest.get("target_config")
    if isinstance(was, dict):
        now = json.loads(model.config.to_json_string())
        diff = sorted(k for k in set(was) & set(now) - _VOLATILE if was[k] != now[k])
        items.append(_item("config", not diff, {k: was[k] for k in diff},
                           {k: now[k] for k in diff}, f"differing keys {diff}" if diff else ""))
    return items, comparable


def _token_dataset(root: Path, manifest: dict[str, Any], tokens: str | None
                   ) -> tuple[Any, list[dict]]:
    """(the token dataset extraction read or None, identity items about it)."""
    from eyas.data.store.dataset import open_dataset
    from eyas.data.store.format import DatasetError
    path = tokens or (manifest.get("tokens_dataset") or {}).get("path")
    if not path:
        return None, [_item("tokens_dataset", None, None, None, "the manifest names no token "
                            "dataset: stored ids are run as they are (pass --tokens DIR)")]
    try:
        toks = open_dataset(path)
    except (DatasetError, OSError) as e:
        return None, [_item("tokens_dataset", None, path, None, f"unreadable ({e}): stored ids "
                            f"are run as they are (pass --tokens DIR)")]
    items = [_item("tokens_dataset", True, path, f"{len(toks)} samples")]
    plan = root / "extract_plan.json"
    if plan.is_file():
        was = json.loads(plan.read_text()).get("tokens_checksum")
        now = json.dumps([s.get("checksum") for s in toks.manifest.get("shards", [])])
        items.append(_item("tokens_checksum", was == now, was, now,
                           "" if was == now else "the token dataset changed since extraction"))
    return toks, items


def pick_samples(n: int, samples: int, seed: int) -> list[int]:
    """`samples` distinct sample ids of n, drawn with `seed` (every sample when 0 or >= n)."""
    if samples <= 0 or samples >= n:
        return list(range(n))
    return sorted(int(i) for i in np.random.default_rng(seed).choice(n, samples, replace=False))


def _check_sample(i: int, ds, toks, run, aux_format: str, c: float, teacher: dict) -> list[dict]:
    stored = ds[i]
    rows = []
    if toks is not None and i < len(toks):
        src = toks.sample(i, fields=("input_ids", "loss_mask"))
        rows += [ids_check(f, stored[f], src[f]) for f in ("input_ids", "loss_mask") if f in stored]
    else:
        src = {"input_ids": stored["input_ids"], "loss_mask": stored["loss_mask"]}
    fresh = run([src])[0]
    rows.append(state_check("aux", stored["aux"], fresh["aux"], aux_format or "bf16", c))
    if "last" in stored and teacher.get("last", "post_norm") == "post_norm":
        rows.append(state_check("last", stored["last"], fresh["last"], "bf16", c))
    if "topk_ids" in stored and "topk_logits" in stored:
        rows += topk_checks(stored["topk_ids"], stored["topk_logits"], fresh["topk_ids"],
                            fresh["topk_logits"], c)
    if "target_argmax" in stored:
        rows.append(argmax_check(stored["target_argmax"], fresh["topk_ids"],
                                 fresh["topk_logits"], c))
    return [dict(r, sample=i) for r in rows]


def verify(dataset: str | Path, target: str, *, samples: int = 16, seed: int = 0,
           tokens: str | None = None, device: str | torch.device | None = None,
           dtype: str | None = None, compute_tol: float = COMPUTE_TOL,
           model: torch.nn.Module | None = None) -> dict[str, Any]:
    """The verify report of `dataset` against `target` (see the module docstring).

    `model`: an already loaded target (skips loading; run it in the manifest's dtype)."""
    from eyas.data.common.capture import LayerHooks, find_text_model, logit_transform
    from eyas.data.produce.forward import load_model, run_batch
    from eyas.data.store.dataset import open_dataset
    root = Path(dataset)
    ds = open_dataset(root)
    m = ds.manifest
    if m.get("kind") != "hidden" or "aux" not in ds.fields:
        raise VerifyError(f"{root}: a {m.get('kind')!r} dataset has no hidden states to verify; "
                          f"pass a dataset written by eyas extract")
    if model is None:
        model = load_model(target, dtype or m.get("target_dtype") or "bfloat16", device)
    text, layers, norm, head = find_text_model(model)
    n_layers = min(len(layers), getattr(model.config.get_text_config(), "num_hidden_layers",
                                        len(layers)))
    hidden, vocab = int(head.weight.shape[1]), int(head.weight.shape[0])
    items, comparable = identity(m, model, target, n_layers, hidden, vocab)
    toks, tok_items = _token_dataset(root, m, tokens)
    items += tok_items
    teacher = m.get("teacher") if isinstance(m.get("teacher"), dict) else {}
    k = min(vocab, int(ds.fields.get("topk_ids", {}).get("shape", [0])[0]) + TOPK_MARGIN)
    picks = pick_samples(len(ds), samples, seed)
    rows: list[dict] = []
    if comparable:
        hooks = LayerHooks(layers, list(m["aux_layer_ids"]), norm)   # captures as extract does
        run = partial(run_batch, text, hooks, head, teacher="both", topk=k, row_chunk=1024,
                      vocab_chunk=65536, logit_tf=logit_transform(model.config))
        try:
            for i in picks:
                rows += _check_sample(i, ds, toks, run, ds.aux_format, compute_tol, teacher)
        finally:
            hooks.remove()
    bad = sorted({r["sample"] for r in rows if not r["ok"]})
    return {"dataset": str(root), "target": str(target), "samples": picks,
            "n_samples": len(ds), "seed": seed, "aux_format": ds.aux_format,
            "compute_tol": compute_tol, "identity": items, "compared": comparable,
            "rows": rows, "bad_samples": bad,
            "bad_fields": sorted({r["field"] for r in rows if not r["ok"]}),
            "ok": comparable and not bad and all(it["ok"] is not False for it in items)}


def _short(value: Any, width: int = 80) -> str:
    text = "same" if value == {} else repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= width else text[:width - 1] + "…"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_report(r: dict[str, Any]) -> str:
    """The report as a table: identity lines, one line per sample and field, a verdict."""
    lines = [f"verify {r['dataset']} against {r['target']}: {len(r['samples'])} of "
             f"{r['n_samples']} samples (seed {r['seed']}), aux {r['aux_format']}, compute "
             f"tolerance {r['compute_tol']:g}", "identity:"]
    for it in r["identity"]:
        mark = {True: "ok", False: "DIFFERS", None: "note"}[it["ok"]]
        what = (_short(it["dataset"]) if it["ok"]
                else f"  dataset {_short(it['dataset'])}, target {_short(it['target'])}")
        lines.append(f"  {mark:<8}{it['check']:<16}{it['note']}{what}")
    if r["rows"]:
        lines.append(f"{'sample':>7}  {'field':<14}{'max|err|':>10}{'min cos':>9}  "
                     f"{'tokens over':>12}  status  bound")
    for row in r["rows"]:
        over = f"{row['tokens_over']}/{row['tokens']}"
        status = "ok" if row["ok"] else "BAD"
        extra = f"  ({row['detail']})" if row["detail"] else ""
        if not row["ok"] and row["first_token"] is not None:
            extra += f"  first at token {row['first_token']}"
        lines.append(f"{row['sample']:>7}  {row['field']:<14}{_num(row['max_abs_err'], '.3g'):>10}"
                     f"{_num(row['cosine_min'], '.4f'):>9}  {over:>12}  {status:<6}  "
                     f"{row['bound']}{extra}")
    if not r["compared"]:
        lines.append("values not compared: the dataset's shapes do not fit this target")
    if r["ok"]:
        lines.append("verify: clean")
    else:
        ident = [it["check"] for it in r["identity"] if it["ok"] is False]
        lines.append("verify: FINDINGS" + (f"; identity differs: {', '.join(ident)}" if ident
                                           else "") +
                     (f"; samples {r['bad_samples']} disagree in {', '.join(r['bad_fields'])}"
                      if r["bad_samples"] else ""))
    return "\n".join(lines)


@dataclass(kw_only=True)
class VerifyOptions:
    """Re-run random samples of a hidden-state dataset through the target and compare the stored
    ids, aux states, teacher and argmax with what it computes now, against the storage mode's
    bound. Exit 0 clean, 1 findings, 2 usage error."""

    dataset: str = option(help="hidden-state dataset directory (from eyas extract)",
                          positional=True)
    target: str = option(help="model directory, hub id (org/name[@revision]) or preset name")
    samples: int = option(16, "samples to re-run, drawn at random (0: every sample)",
                          metavar="N", min=0)
    seed: int = option(0, "seed of the sample draw")
    tokens: str | None = option(
        None, "the token dataset extraction read (default: the manifest's)", metavar="DIR")
    compute_tol: float = option(
        COMPUTE_TOL, "room for the target's own rounding when it runs differently than at "
        "extraction (another device, padded batches): c x the row's RMS for states, c x the "
        "top-1 logit for logits; 0 on the extracting machine", metavar="C", min=0)
    dtype: str | None = option(None, "what the target runs in (default: the manifest's "
                               "target_dtype)", choices=("bfloat16", "float32"))
    device: str | None = option(None, "cpu, cuda:0, ... (default: the first GPU if there is "
                                "one, else the CPU)")
    json: str | None = option(
        None, "also write the report as JSON (default: none, the table only)", metavar="FILE")


def main(args: VerifyOptions) -> int:
    """`eyas verify DATASET --target MODEL [--samples N] [--seed S] [--json FILE]`."""
    report = verify(args.dataset, args.target, samples=args.samples, seed=args.seed,
                    tokens=args.tokens, device=args.device, dtype=args.dtype,
                    compute_tol=args.compute_tol)
    print(format_report(report))
    if args.json:
        from eyas.data.common.utils import atomic_write_json
        atomic_write_json(args.json, report)
    return 0 if report["ok"] else 1

