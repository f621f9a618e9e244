"""The extraction plan both capture paths share (transformers: data/produce/extract.py, vLLM:
data/produce/engine_capture.py): `extract_plan.json` fixes the settings a resume must match, the shard
ranges (shard i always covers the same samples), each shard file's exact size and the manifest
the finished dataset gets; `finalize` writes that manifest once every planned shard exists. An
extraction whose shards still to write do not fit on the output's disk is refused before it
starts."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eyas.data.common.capture import ExtractError
from eyas.data.produce.forward import default_shard_tokens, plan_shards
from eyas.data.common.lock import writes_directory
from eyas.data.produce.outdir import PLAN_NAME, check_extract_out

log = logging.getLogger(__name__)

# plan keys that must match for a re-run to resume into an existing output directory
_RESUME_KEYS = ("target", "target_dtype", "capture_source", "aux_layer_ids", "teacher", "topk",
                "aux_format", "shards", "tokens_checksum")


def write_plan(out: Path, plan: dict[str, Any]) -> None:
    from eyas.data.common.utils import atomic_write_json
    path = out / PLAN_NAME
    if path.exists():
        old = json.loads(path.read_text())
        old.setdefault("target_dtype", plan["target_dtype"])   # plans written before it existed
        old.setdefault("capture_source", "hf")
        diff = [k for k in _RESUME_KEYS if old.get(k) != plan.get(k)]
        if diff:
            what = [f"{k}: {old.get(k)!r} -> {plan.get(k)!r}" for k in diff if k != "shards"]
            if "shards" in diff:
                what.append("the shard plan (shard_tokens / max_samples)")
            raise ExtractError(f"{path}: this output directory was started with different "
                               f"settings ({'; '.join(what)}); re-run with the same settings to "
                               f"resume, or choose a new --out")
        _check_room(out, plan)
        if old.get("tokens_dir") != plan["tokens_dir"]:   # same tokens (checksum), other spelling
            old["tokens_dir"] = plan["tokens_dir"]
            old["manifest"]["tokens_dataset"] = plan["manifest"]["tokens_dataset"]
            atomic_write_json(path, old)
        return
    _check_room(out, plan)
    atomic_write_json(path, plan)


#: bytes kept free beyond the shards and the index: the manifest and the plan (the target's
#: config, a few KiB) and their lines per shard
SMALL_FILES_BYTES, SMALL_FILES_BYTES_PER_SHARD = 64 * 1024, 256


def _check_room(out: Path, plan: dict[str, Any]) -> None:
    """Refuse (DiskFullError) an extraction whose shards not yet written, the index and the
    small files need more than the free space at `out`, or whose largest shard passes the
    file-size limit."""
    from eyas.data.common.space import require_free
    from eyas.data.store.shards import shard_name
    sizes = plan.get("file_bytes")
    if not sizes:
        return
    todo = [b for j, b in enumerate(sizes["shards"]) if not (out / shard_name(j)).exists()]
    if todo:
        small = SMALL_FILES_BYTES + SMALL_FILES_BYTES_PER_SHARD * len(sizes["shards"])
        require_free(out, sum(todo) + sizes["index"] + small,
                     what=f"the hidden-state dataset ({len(todo)} shard(s) to write)",
                     largest_file=max(todo),
                     fix="free space there or choose another --out (`eyas extract "
                         "--estimate` lists the size of each storage mode; --aux-format fp8 "
                         "halves aux)")


def open_tokens(tokens_dir: str | Path, target: str | Path, out_dir: str | Path):
    """The token dataset at `tokens_dir`, refused when it is not one, when `out_dir` is it or
    holds other data, or when the target serves another chat template than the one it was
    rendered with (`templates.template_mismatch`: its drafter would be trained on other turn
    markers than it meets when served)."""
    from eyas.data.common.templates import template_mismatch
    from eyas.data.store.shards import open_dataset
    check_extract_out(out_dir, tokens_dir)
    tokens = open_dataset(tokens_dir)
    for f in ("input_ids", "loss_mask"):
        if f not in tokens.fields:
            raise ExtractError(f"{tokens_dir} has no {f!r} field; expected a token dataset from "
                               f"data.produce.prepare")
    why = template_mismatch(tokens_dir, target)
    if why is not None:
        raise ExtractError(why)
    return tokens


def pending_shards(out: Path, ranges: list[list[int]], rank: int, world_size: int
                    ) -> tuple[list[int], list[int]]:
    """(shards this rank must compute, shards already complete) among i = rank (mod world)."""
    from eyas.data.store.shards import read_shard_meta, shard_name
    todo, resumed = [], []
    for j in range(rank, len(ranges), world_size):
        path, want = out / shard_name(j), ranges[j][1] - ranges[j][0]
        if path.exists():
            got = read_shard_meta(path)["n_samples"]
            if got == want:
                resumed.append(j)
                continue
            log.warning("%s holds %d samples, the plan says %d: recomputing it", path, got, want)
        todo.append(j)
    if resumed:
        log.info("rank %d: %d shard(s) already complete, %d to compute", rank, len(resumed),
                 len(todo))
    return todo, resumed


def make_plan(tokens, tokens_dir, target, lengths: list[int], fields: dict[str, Any], *,
              shard_tokens: int | None, shard_bytes: int, teacher: str, topk: int,
              aux_format: str) -> dict[str, Any]:
    """The extraction plan (`extract_plan.json`) of samples of these lengths: the settings a
    resume must match, the shard ranges and the manifest the finished dataset gets. `fields`:
    the capturer's `plan_fields()` (its `capture`: where the states come from, source hf or
    vllm, versions, the engine's layer ids); shard_tokens None: `default_shard_tokens`."""
    from eyas.data.produce.estimate import hidden_tensors, index_file_bytes, shard_file_bytes
    hidden, aux_ids, n = fields["hidden"], fields["aux_ids"], len(lengths)
    if shard_tokens is None:
        shard_tokens = default_shard_tokens(hidden, aux_format, teacher, topk, shard_bytes)
    src = tokens.manifest
    tokens_dir = str(Path(tokens_dir).resolve())    # found again from any working directory
    shards = plan_shards(lengths, shard_tokens)
    per_token = hidden_tensors(hidden, aux_format, teacher, topk)
    return {
        "format": "eyas-extract-plan", "tokens_dir": tokens_dir, "target": str(target),
        "target_dtype": fields["target_dtype"], "capture_source": fields["capture"]["source"],
        "tokens_checksum": json.dumps([s.get("checksum") for s in src.get("shards", [])]),
        "aux_layer_ids": aux_ids, "teacher": teacher, "topk": topk, "aux_format": aux_format,
        "shards": shards,
        "file_bytes": {"shards": [shard_file_bytes(j, lengths[a:b], per_token, aux_format)
                                  for j, (a, b) in enumerate(shards)],
                       "index": index_file_bytes(n, len(shards))},
        "manifest": {
            "kind": "hidden", "target": str(target),
            "target_config": fields["target_config"],
            "target_fingerprint": fields["fingerprint"], "capture": fields["capture"],
            "aux_layer_ids": aux_ids, "convention": "hf_hidden_states",
            "hidden_size": hidden, "num_layers": fields["num_layers"],
            "vocab_size": fields["vocab"], "target_dtype": fields["target_dtype"],
            "teacher": {"kind": teacher, "last": "post_norm" if teacher != "topk" else None,
                        "topk": topk or None, "target_argmax": True},
            "tokenizer": src.get("tokenizer"), "prepare": src.get("prepare"),
            "tokens_dataset": {"path": tokens_dir, "n_samples": n}},
    }


@writes_directory("out_dir", what="hidden-state dataset")
def finalize(out_dir: str | Path) -> dict[str, Any]:
    """Write the manifest of an extraction whose planned shards all exist (metas from headers)."""
    from eyas.data.store.shards import read_shard_meta, shard_name, write_manifest
    out = Path(out_dir)
    path = out / PLAN_NAME
    if not path.exists():
        raise ExtractError(f"{out} has no {PLAN_NAME}: not an extraction output directory")
    plan = json.loads(path.read_text())
    metas, missing = [], []
    for j, (a, b) in enumerate(plan["shards"]):
        f = out / shard_name(j)
        if not f.exists():
            missing.append(j)
            continue
        meta = read_shard_meta(f)
        if meta["n_samples"] != b - a:
            raise ExtractError(f"{f} holds {meta['n_samples']} samples, the plan says {b - a}; "
                               f"delete it and re-run extract")
        metas.append(meta)
    if missing:
        raise ExtractError(f"{out}: {len(missing)} planned shard(s) missing (first: "
                           f"{missing[:8]}); re-run extract with the same settings (it resumes)")
    return write_manifest(out, plan["manifest"], metas)
