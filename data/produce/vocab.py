"""Draft vocabulary: which target ids the drafter's `lm_head` rows stand for.

The draft vocabulary is a set of Vd target ids sorted ascending; `lm_head` row i is the i-th
smallest. It is stored as the (d2t offsets, t2d mask) pair of `data.store.vocab_map.VocabMap`, which
also holds its validator (models/serving/CONTRACT.md §3).

`build_vocab` counts token ids over a dataset, keeps the `size` most frequent (ties: lower id
first), always includes the forced ids (special and chat-template tokens), and sorts. When
fine-tuning an existing drafter keep ITS mapping instead (`load_vocab`): every `lm_head` row is
tied to its id. CLI: `eyas vocab --data DIR --size N --out FILE [--target TARGET]` (the special
tokens of the manifest's target are forced by default, as the trainer forces them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.common.options import option, shared
from eyas.data.common.settings import VocabSettings
from eyas.data.common.utils import atomic_path, progress
from eyas.data.store.vocab_map import VocabMap

log = logging.getLogger(__name__)

VOCAB_FORMAT = "eyas-vocab"
COUNT_MODES = ("auto", "target_argmax", "next_token", "masked_token")
#: count_tokens results of this process, by dataset (root, manifest, size), mode and V: the
#: trainer counts once for the vocabulary and again for the checkpoints' coverage figure
_counted: dict[tuple, np.ndarray] = {}


def _dataset_vocab_size(ds, target: str | None = None) -> int | None:
    """V of the dataset's target: its manifest's target_config (or vocab_size), else the config
    of `target` (default: the manifest's target). Never the tokenizer length: a target's
    embedding may have more rows than its tokenizer has tokens (Qwen3: 151936 of 151669)."""
    from eyas.data.common.targets import load_target_config, text_config

    m = ds.manifest
    v = text_config(m.get("target_config") or {}).get("vocab_size") or m.get("vocab_size")
    target = target or m.get("target")
    if not v and target:
        try:
            v = text_config(load_target_config(target)).get("vocab_size")
        except (OSError, ValueError) as e:
            raise ValueError(f"{ds.root}: cannot read the vocab_size of target {target!r} ({e}); "
                             f"pass --target-vocab-size V (target_vocab_size=V)") from None
    return v if isinstance(v, int) and v > 0 else None


def count_tokens(dataset, target_vocab_size: int, count: str = "auto") -> np.ndarray:
    """Occurrences of each target id among the prediction targets of `dataset` -> int64 [V].

    Which tokens are counted (`count`):
      - "target_argmax": target_argmax[t] for every t with loss_mask[t] == 1 — the target's own
        greedy prediction at trained positions: what the drafter must reproduce, and what the
        position mask t2d[target_argmax] tests.
      - "next_token": input_ids[t + 1] for every t with loss_mask[t] == 1 (inside the sample) —
        the data token that the teacher at t predicts.
      - "masked_token": input_ids[t] for every t with loss_mask[t] == 1 (SpecForge's count).
      - "auto" (default): "target_argmax" if the dataset stores that field, else (or while a
        streamed run has not captured it yet) "next_token".

    A dataset counted before in this process (same root, manifest and mode) is not read again.
    """
    if count not in COUNT_MODES:
        raise ValueError(f"count must be one of {COUNT_MODES}, got {count!r}")
    if count == "auto":
        count = ("target_argmax" if "target_argmax" in dataset.fields
                 and not getattr(dataset, "streamed", False) else "next_token")
    if count == "target_argmax" and "target_argmax" not in dataset.fields:
        raise ValueError(f"count='target_argmax' needs a dataset with target_argmax; "
                         f"{dataset.root} has {sorted(dataset.fields)}; use count='next_token'")
    manifest = json.dumps(dataset.manifest, sort_keys=True, default=str).encode()
    key = (str(Path(dataset.root).resolve()), hashlib.sha256(manifest).hexdigest(),
           len(dataset), count, int(target_vocab_size))
    counts = _counted.get(key)
    if counts is None:
        counts = _count(dataset, target_vocab_size, count)
        _counted.clear()                      # one dataset's counts at a time
        _counted[key] = counts
    return counts.copy()


def _count(dataset, target_vocab_size: int, count: str) -> np.ndarray:
    names = ("loss_mask", "target_argmax" if count == "target_argmax" else "input_ids")
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    for i in progress(range(len(dataset)), desc="counting tokens", unit="sample"):
        s = dataset.sample(i, names)
        mask = s["loss_mask"].numpy()
        if count == "target_argmax":
            ids = s["target_argmax"].numpy()[mask]
        elif count == "next_token":
            ids = s["input_ids"].numpy()[1:][mask[:-1]]
        else:
            ids = s["input_ids"].numpy()[mask]
        if ids.size and (ids.min() < 0 or ids.max() >= target_vocab_size):
            raise ValueError(f"sample {i} of {dataset.root} has token id {int(ids.max())} outside "
                             f"[0, {target_vocab_size}); wrong target_vocab_size?")
        counts += np.bincount(ids, minlength=target_vocab_size)
    log.info("counted %d tokens (%s) over %d samples", int(counts.sum()), count, len(dataset))
    return counts


def build_vocab(dataset_or_token_counts: Any, size: int = VocabSettings.draft_vocab_size,
                force_ids: Iterable[int] = (), target_vocab_size: int | None = None, *,
                count: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Select a draft vocabulary of exactly `size` target ids -> (d2t int64 [size], t2d bool [V]).

    Args:
        dataset_or_token_counts: a `Dataset` (counted with `count_tokens(…, count)`; see there for
            exactly which tokens count), or counts per target id: a 1-D tensor/array of length V
            or a mapping {id: count}.
        size: Vd. Must be <= V.
        force_ids: ids always selected (special / chat-template / tool tokens), even if unseen.
        target_vocab_size: V; default: the counts' length or the vocab_size of the dataset's
            target (its manifest's target_config, else the named target's config.json).

    Selection: forced ids, then the remaining ids by descending count, ties by ascending id.
    Ids never seen have count 0, so when fewer than `size` distinct ids occur the selection is
    filled with unseen ids in ascending id order; Vd is always exactly `size`.
    """
    counts = _as_counts(dataset_or_token_counts, target_vocab_size, count)
    V = len(counts)
    if not 1 <= size <= V:
        raise ValueError(f"draft vocab size {size} must be in [1, V={V}] (the target vocabulary)")
    forced = sorted({int(i) for i in force_ids})
    bad = [i for i in forced if not 0 <= i < V]
    if bad:
        raise ValueError(f"force_ids {bad[:5]} outside the target vocabulary [0, {V})")
    if len(forced) > size:
        raise ValueError(f"{len(forced)} forced ids do not fit a draft vocabulary of {size}")
    order = np.lexsort((np.arange(V), -counts))          # count desc, then id asc
    chosen = np.zeros(V, dtype=bool)
    chosen[forced] = True
    rest = order[~chosen[order]][:size - len(forced)]
    chosen[rest] = True
    ids = np.nonzero(chosen)[0]                           # ascending
    seen = int((counts > 0).sum())
    total = int(counts.sum())
    covered = int(counts[chosen].sum())
    log.info("draft vocab: %d ids (%d forced) of V=%d; %d distinct ids seen; covers %.4f of the "
             "counted tokens", size, len(forced), V, seen, covered / total if total else 0.0)
    if seen < size - len(forced):
        log.info("fewer distinct ids (%d) than the draft vocab size: filled with unseen ids in "
                 "ascending id order", seen)
    d2t = torch.from_numpy(ids - np.arange(size)).to(torch.int64)
    t2d = torch.from_numpy(chosen)
    VocabMap(d2t, t2d).validate()
    return d2t, t2d


def _as_counts(obj: Any, V: int | None, count: str) -> np.ndarray:
    if isinstance(obj, Mapping):
        if V is None:
            raise ValueError("target_vocab_size is required with a {id: count} mapping")
        counts = np.zeros(V, dtype=np.int64)
        for k, c in obj.items():
            if not 0 <= int(k) < V:
                raise ValueError(f"token id {k} outside [0, {V})")
            counts[int(k)] += int(c)
        return counts
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        counts = np.asarray(obj.cpu() if isinstance(obj, torch.Tensor) else obj).astype(np.int64)
        if counts.ndim != 1 or (V is not None and len(counts) != V):
            raise ValueError(f"token counts must be 1-D of length V={V}, got shape {counts.shape}")
        if (counts < 0).any():
            raise ValueError("token counts must be >= 0")
        return counts
    if hasattr(obj, "fields") and hasattr(obj, "sample"):
        V = V or _dataset_vocab_size(obj)
        if V is None:
            raise ValueError(f"the manifest of {obj.root} records no vocabulary size; pass "
                             f"target_vocab_size=V (the target model's vocab_size)")
        return count_tokens(obj, V, count)
    raise TypeError(f"expected a Dataset, token counts or a mapping, got {type(obj).__name__}")


def save_vocab(path: str | os.PathLike, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
    """Validate and write (d2t, t2d) to a safetensors file, atomically."""
    from safetensors.torch import save_file

    VocabMap(d2t, t2d).validate()
    meta = {"format": VOCAB_FORMAT, "draft_vocab_size": str(d2t.numel()),
            "target_vocab_size": str(t2d.numel())}
    with atomic_path(path) as tmp:
        save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp), metadata=meta)
    return Path(path)


def load_vocab(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a file written by `save_vocab` (or any safetensors with those keys, e.g.
    an exported drafter's model.safetensors), validated."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if not {"d2t", "t2d"} <= keys:
                raise ValueError(f"{path}: needs tensors 'd2t' and 't2d', found {sorted(keys)[:8]}")
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path}: unreadable vocab file ({e})") from None
    try:
        VocabMap(d2t, t2d).validate()
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return d2t, t2d


def special_token_ids(tokenizer) -> list[int]:
    """Ids to force into a draft vocabulary: every special token of `tokenizer` plus every added
    token that its chat template emits (end of turn, role headers, tool-call markers), sorted."""
    ids: set[int] = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])
                        if i is not None)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(template.values())
    for tid, tok in added.items():
        content = getattr(tok, "content", str(tok))
        if getattr(tok, "special", False) or (content and content in template):
            ids.add(int(tid))
    if template:
        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                tokenize=True)
            if isinstance(rendered, Mapping):
                rendered = rendered["input_ids"]
            ids.update(int(t) for t in rendered if int(t) in added)
        except Exception as e:  # a template may need extra kwargs; the string scan still applies
            log.debug("rendering the chat template failed (%s); using the template text only", e)
    return sorted(ids)


def forced_special_ids(target: str | None, cache_dir: str | os.PathLike | None = None
                       ) -> list[int]:
    """`special_token_ids` of `target`'s tokenizer, or [] when it has none (a config-only
    target): the ids the trainer forces into the draft vocabulary it builds."""
    if not target:
        return []
    from eyas.data.common.targets import load_tokenizer
    try:
        return special_token_ids(load_tokenizer(target, cache_dir))
    except Exception as e:  # config-only targets have no tokenizer here
        log.info("no tokenizer for %s (%s): no special tokens forced into the draft vocab",
                 target, e)
        return []


@dataclass(kw_only=True)
class VocabOptions:
    """Build a draft vocabulary (d2t offsets, t2d mask) from the most frequent prediction targets
    of a dataset. When fine-tuning an existing drafter, keep its mapping instead of building a new
    one."""

    data: str = option(help="dataset directory (tokens or hidden)")
    size: int = shared(VocabSettings, "draft_vocab_size", "drafter.draft_vocab_size",
                       "Target presets may train with another size (smollm2: 8192): pass the "
                       "run's drafter.draft_vocab_size.")
    out: str = option(help="output .safetensors file")
    target: str | None = option(
        None, "force the special and chat-template tokens of TARGET's tokenizer, as the trainer "
        "does (directory, hub id (org/name[@revision]) or preset name; default: the dataset "
        "manifest's target)", flags=("--target", "--force-special-from"), metavar="TARGET")
    no_special: bool = option(False, "force no special tokens (the trainer always forces them)")
    cache_dir: str | None = option(
        None, "where target presets are materialised (default: ~/.cache/eyas)")
    force_ids: str = option("", "extra ids to force, comma-separated")
    count: str = option("auto", "which tokens are counted (see data.vocab.count_tokens)",
                        choices=COUNT_MODES)
    target_vocab_size: int | None = option(
        None, "V (default: the vocab_size of the manifest's target_config, else of the config of "
        "--target or the manifest's target)")


def main(args: VocabOptions) -> int:
    """`eyas vocab`: build a draft vocabulary from a dataset and save it."""
    from eyas.data.store.dataset import open_dataset

    ds = open_dataset(args.data)
    forced = [int(x) for x in args.force_ids.split(",") if x.strip()]
    target = None if args.no_special else (args.target or ds.manifest.get("target"))
    if target:
        special = forced_special_ids(target, args.cache_dir)
        print(f"forcing {len(special)} special/template token ids of {target}'s tokenizer")
        forced += special
    else:
        print("forcing no special tokens (" + ("--no-special" if args.no_special else
              "the manifest names no target: pass --target") + ")")
    V = args.target_vocab_size or _dataset_vocab_size(ds, args.target)
    size = min(args.size, V) if V else args.size      # as the trainer caps it
    d2t, t2d = build_vocab(ds, size, forced, V, count=args.count)
    save_vocab(args.out, d2t, t2d)
    print(f"wrote {args.out}: Vd={d2t.numel()} of V={t2d.numel()}")
    return 0
