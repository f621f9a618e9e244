"""Token dataset -> hidden-state dataset: run the target and keep what EAGLE-3 training needs.

Per token t of every sample (see data/FORMAT.md for the stored layout):
- ``aux [T, 3, tH]``: HF ``hidden_states[k][t]`` for k in the aux layer ids a < b < c, i.e. the
  residual stream ENTERING decoder layer k (no norm). Captured with forward pre-hooks on
  ``layers[k]`` only; ``output_hidden_states`` (all N+1 states) is never requested.
- ``last [T, tH]`` (teacher "last"/"both"): the output of the target's final norm, i.e. what its
  ``lm_head`` consumes (HF ``hidden_states[-1]``). Captured with a forward hook on the norm.
- ``target_argmax [T]``: argmax of the target's full-vocabulary logits at t (its prediction of
  token t+1). The logits are never materialised as ``[T, V]``: ``lm_head`` is applied to row
  chunks of tokens and, for large V, to row chunks of the head (running max across chunks).
- ``topk_ids / topk_logits [T, k]`` (teacher "topk"/"both"): the k largest logits (float32 of
  the target's bf16 logits, soft-capping/scale applied where the config has them).

Only the target's text model is run (no logits); finding it, the hooks and the chunked argmax
live in ``data/capture.py``, the shard plan, the forward groups and one forward's fields in
``data/forward.py`` (which `eyas verify` and `eyas extract --estimate` run too).

Batching: the samples of one output shard are sorted by length and run up to `batch_tokens`
tokens per forward. By default a forward holds only samples of EQUAL length (no padding), which
makes every stored value bitwise equal to a plain forward of the sample alone (padding can
change the kernels' rounding); ``pad_batches=True`` pads different lengths together (right
padding + attention mask) for throughput on many short samples.

Resumable: output shard i always covers the same sample range (the plan, fixed by the token
dataset and `shard_tokens`, is stored in ``extract_plan.json``). A shard file that exists is
complete (data.shards writes atomically); its meta is read back from its header and it is not
recomputed. The manifest is written last, once every planned shard exists.

Several GPUs:
- data parallel (the target fits one GPU): launch one process per GPU, e.g.
  ``accelerate launch --num_processes 8 -m eyas.data.extract --tokens T --target M --out O``
  (or through ``eyas extract``). Process r takes shards i ≡ r (mod world) on ``cuda:<local
  rank>``; after a barrier rank 0 writes the manifest. If the ranks ran as separate jobs,
  ``eyas extract ... --finalize-only`` collects the metas from the shard headers and writes it.
- a target too large for one GPU: ``--device-map auto`` loads it across every visible GPU
  (transformers/accelerate place the layers; the hooks work unchanged). One process.
CPU works with one process (the default).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eyas.data.capture import (Capture, ExtractError, check_aux_layers, find_text_model,
                               logit_transform, target_fingerprint)
from eyas.data.forward import (DTYPES, TEACHERS, default_shard_tokens, length_groups,  # noqa: F401
                               load_model, plan_shards, run_batch)
from eyas.data.lock import lock_for_ranks, writes_directory
from eyas.data.log import HelpFormatter
from eyas.data.parent import exit_with_launcher
from eyas.data.outdir import PLAN_NAME, check_extract_out
from eyas.data.settings import (DTYPE_CHOICES, AuxFormat, ExtractionSettings, TargetSettings,
                                default, field_help)
from eyas.data.targets import target_dtype_name

log = logging.getLogger(__name__)

# plan keys that must match for a re-run to resume into an existing output directory
_RESUME_KEYS = ("target", "target_dtype", "aux_layer_ids", "teacher", "topk", "aux_format",
                "shards", "tokens_checksum")


# ---------------------------------------------------------------------------------------------
# Plan, run, finalize


def _write_plan(out: Path, plan: dict[str, Any]) -> None:
    from eyas.data.utils import atomic_write_json
    path = out / PLAN_NAME
    if path.exists():
        old = json.loads(path.read_text())
        old.setdefault("target_dtype", plan["target_dtype"])   # plans written before it existed
        diff = [k for k in _RESUME_KEYS if old.get(k) != plan.get(k)]
        if diff:
            what = [f"{k}: {old.get(k)!r} -> {plan.get(k)!r}" for k in diff if k != "shards"]
            if "shards" in diff:
                what.append("the shard plan (shard_tokens / max_samples)")
            raise ExtractError(f"{path}: this output directory was started with different "
                               f"settings ({'; '.join(what)}); re-run with the same settings to "
                               f"resume, or choose a new --out")
        if old.get("tokens_dir") != plan["tokens_dir"]:   # same tokens (checksum), other spelling
            old["tokens_dir"] = plan["tokens_dir"]
            old["manifest"]["tokens_dataset"] = plan["manifest"]["tokens_dataset"]
            atomic_write_json(path, old)
        return
    atomic_write_json(path, plan)


def _pending_shards(out: Path, ranges: list[list[int]], rank: int, world_size: int
                    ) -> tuple[list[int], list[int]]:
    """(shards this rank must compute, shards already complete) among i = rank (mod world)."""
    from eyas.data.shards import read_shard_meta, shard_name
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


def _write(out: Path, j: int, samples: list[dict], aux_format: str) -> tuple[int, int]:
    from eyas.data.shards import write_shard
    write_shard(out, j, samples, aux_format=aux_format)
    return j, len(samples)


def _written(done: tuple[int, int], rank: int, tokens: int, t0: float, bar) -> None:
    rate = tokens / max(time.perf_counter() - t0, 1e-9)
    bar.set_postfix(shard=done[0], tok_s=f"{rate:.0f}")
    log.info("rank %d: shard %d (%d samples) written; %.0f tokens/s", rank, *done, rate)


def _check_settings(teacher: str, topk: int, vocab_chunk: int, rank: int,
                    world_size: int) -> None:
    """Refuse an unknown teacher, a top-k outside [1, vocab_chunk] or a rank outside the world."""
    if teacher not in TEACHERS:
        raise ExtractError(f"teacher must be one of {TEACHERS}, got {teacher!r}")
    if teacher != "last" and not 1 <= topk <= vocab_chunk:
        raise ExtractError(f"topk must be in [1, vocab_chunk={vocab_chunk}], got {topk}")
    if not 0 <= rank < world_size:
        raise ExtractError(f"rank {rank} is not in [0, world_size={world_size})")


def _plan(tokens, tokens_dir, target, model: nn.Module, n: int, lengths: list[int],
          shard_tokens: int, *, aux_ids: list[int], teacher: str, topk: int, aux_format: str,
          hidden: int, vocab: int, num_layers: int) -> dict[str, Any]:
    """The extraction plan (`extract_plan.json`): the settings a resume must match, the shard
    ranges and the manifest the finished dataset gets."""
    src = tokens.manifest
    target_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    tokens_dir = str(Path(tokens_dir).resolve())    # found again from any working directory
    return {
        "format": "eyas-extract-plan", "tokens_dir": tokens_dir, "target": str(target),
        "target_dtype": target_dtype,
        "tokens_checksum": json.dumps([s.get("checksum") for s in src.get("shards", [])]),
        "aux_layer_ids": aux_ids, "teacher": teacher, "topk": topk, "aux_format": aux_format,
        "shards": plan_shards(lengths, shard_tokens),
        "manifest": {
            "kind": "hidden", "target": str(target),
            "target_config": json.loads(model.config.to_json_string()),
            "target_fingerprint": target_fingerprint(model),
            "aux_layer_ids": aux_ids, "convention": "hf_hidden_states",
            "hidden_size": hidden, "num_layers": num_layers, "vocab_size": vocab,
            "target_dtype": target_dtype,
            "teacher": {"kind": teacher, "last": "post_norm" if teacher != "topk" else None,
                        "topk": topk or None, "target_argmax": True},
            "tokenizer": src.get("tokenizer"), "prepare": src.get("prepare"),
            "tokens_dataset": {"path": tokens_dir, "n_samples": n}},
    }


def _run_shards(model: nn.Module, found: tuple, tokens, tokens_dir, out: Path,
                shards: list[list[int]], todo: list[int], lengths: list[int], *,
                aux_ids: list[int], rank: int,
                teacher: str, topk: int, aux_format: str, batch_tokens: int,
                pad_batches: bool, row_chunk: int, vocab_chunk: int) -> int:
    """Compute and write shards `todo` of the plan; returns the tokens processed. Shard j is
    written on a thread while the target computes shard j + 1 (at most one shard in flight,
    so host memory holds two shards' features at most). found: `find_text_model(model)`."""
    from eyas.data.utils import progress
    text, dec_layers, norm, head = found
    vocab = int(head.weight.shape[0])
    logit_tf = logit_transform(model.config)
    capture = Capture(dec_layers, aux_ids, norm)
    total = sum(sum(lengths[a:b]) for a, b in (shards[j] for j in todo))
    bar = progress(None, total=total, unit="tok", unit_scale=True, desc=f"extract[{rank}]")
    done_tokens, t0 = 0, time.perf_counter()
    writer, pending = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer"), None
    try:
        for j in todo:
            a, b = shards[j]
            results: dict[int, dict] = {}
            for idx in length_groups(lengths, list(range(a, b)), batch_tokens, pad_batches):
                batch = [tokens.sample(i, fields=("input_ids", "loss_mask")) for i in idx]
                top = max(int(s["input_ids"].max()) for s in batch)
                if top >= vocab:
                    raise ExtractError(f"{tokens_dir}: token id {top} in samples {idx} is outside "
                                       f"the target's vocabulary ({vocab}); was the dataset "
                                       f"prepared with another tokenizer?")
                outs = run_batch(text, capture, head, batch, teacher=teacher, topk=topk,
                                 row_chunk=row_chunk, vocab_chunk=vocab_chunk, logit_tf=logit_tf)
                results.update(zip(idx, outs))
                ntok = sum(lengths[i] for i in idx)
                done_tokens += ntok
                bar.update(ntok)
            if pending is not None:
                _written(pending.result(), rank, done_tokens, t0, bar)
            pending = writer.submit(_write, out, j, [results[i] for i in range(a, b)],
                                    aux_format)
        if pending is not None:
            _written(pending.result(), rank, done_tokens, t0, bar)
    finally:
        writer.shutdown(wait=True)
        capture.remove()
        bar.close()
    return done_tokens


@writes_directory("out_dir", what="hidden-state dataset",
                  when=lambda a: a["world_size"] == 1)  # several ranks: cli_main's rank 0
def extract(tokens_dir: str | Path, target: str | Path, out_dir: str | Path, *,
            layers: list[int] | None = None, aux_format: str = ExtractionSettings.aux_format.value,
            teacher: str = ExtractionSettings.teacher.value,
            topk: int = 32, batch_tokens: int = 8192, shard_tokens: int | None = None,
            shard_bytes: int = 1 << 30, max_samples: int | None = None,
            device: str | torch.device | None = None, device_map: str | dict | None = None,
            max_memory: dict | None = None,
            rank: int = 0, world_size: int = 1, finalize_manifest: bool | None = None,
            pad_batches: bool = ExtractionSettings.extract_pad_batches, row_chunk: int = 1024,
            vocab_chunk: int = 65536,
            dtype: str = "bfloat16", model: nn.Module | None = None) -> dict[str, Any]:
    """Run `target` over the token dataset at `tokens_dir`; write a hidden dataset to `out_dir`.

    Args:
        layers: aux layer ids (HF hidden_states indices, 2 <= a < b < c < N); None = the
            default [2, N//2, N-3].
        aux_format: "bf16" (exact) or "fp8" (see data/FORMAT.md for the error bound).
        teacher: "last" (post-norm last state), "topk" (top-k ids + logits) or "both";
            target_argmax is always stored.
        topk: k for the top-k teacher.
        batch_tokens: tokens per forward (a longer sample runs alone).
        pad_batches: False (default): a forward holds only samples of equal length, so every
            stored value is bitwise what a plain forward of that sample alone gives. True: pad
            samples of different lengths together (faster for many short samples on a GPU;
            values then differ from the unpadded forward by bf16 rounding).
        dtype: "bfloat16" or "float32": what the target runs in when `model` is None. Match
            the precision the target serves in; float32 costs ~2x the time on a GPU.
        shard_tokens: tokens per output shard; None = shard_bytes / bytes per token.
        max_samples: use only the first N samples of the token dataset.
        device / device_map: where the target runs ("cuda:0", "cpu"; None: the first GPU if
            there is one, else the CPU), or device_map "auto" to spread one large target over
            all visible GPUs (or a dict module name -> device, as transformers takes it).
        max_memory: with device_map, the most memory per device ({0: "60GiB", "cpu":
            "200GiB"}); layers that do not fit the GPUs go to the CPU.
        rank, world_size: data parallel: this process does shards i = rank (mod world_size).
        finalize_manifest: write the manifest at the end (default: when world_size == 1).
        row_chunk, vocab_chunk: logits chunk (tokens x vocabulary rows) for argmax/top-k.
        model: an already loaded target (skips loading `target`).

    Returns a summary dict (shards computed/resumed, tokens, tokens/s).
    """
    from eyas.data.shards import open_dataset

    _check_settings(teacher, topk, vocab_chunk, rank, world_size)
    check_extract_out(out_dir, tokens_dir)
    tokens = open_dataset(tokens_dir)
    for f in ("input_ids", "loss_mask"):
        if f not in tokens.fields:
            raise ExtractError(f"{tokens_dir} has no {f!r} field; expected a token dataset from "
                               f"data.prepare")
    n = len(tokens) if max_samples is None else min(max_samples, len(tokens))
    if model is None:
        from eyas.data.targets import default_device
        model = load_model(target, device or default_device(), device_map, dtype, max_memory)
    found = find_text_model(model)
    text, dec_layers, _, head = found
    num_layers = min(len(dec_layers), getattr(text.config, "num_hidden_layers", len(dec_layers)))
    aux_ids = check_aux_layers(layers, num_layers)
    hidden, vocab = int(head.weight.shape[1]), int(head.weight.shape[0])
    topk = topk if teacher != "last" else 0
    if shard_tokens is None:
        shard_tokens = default_shard_tokens(hidden, aux_format, teacher, topk, shard_bytes)
    lengths = [int(x) for x in tokens.sample_lengths[:n]]
    plan = _plan(tokens, tokens_dir, target, model, n, lengths, shard_tokens, aux_ids=aux_ids,
                 teacher=teacher, topk=topk, aux_format=aux_format, hidden=hidden, vocab=vocab,
                 num_layers=num_layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_plan(out, plan)

    todo, resumed = _pending_shards(out, plan["shards"], rank, world_size)
    t0 = time.perf_counter()
    done_tokens = _run_shards(model, found, tokens, tokens_dir, out, plan["shards"], todo, lengths,
                              aux_ids=aux_ids, rank=rank, teacher=teacher, topk=topk,
                              aux_format=aux_format, batch_tokens=batch_tokens,
                              pad_batches=pad_batches, row_chunk=row_chunk,
                              vocab_chunk=vocab_chunk)
    dt = time.perf_counter() - t0
    summary = {"out_dir": str(out), "shards": len(plan["shards"]), "computed": todo,
               "resumed": resumed, "tokens": done_tokens, "seconds": round(dt, 3),
               "tokens_per_s": round(done_tokens / dt, 1) if dt > 0 and done_tokens else None,
               "aux_layer_ids": aux_ids}
    if finalize_manifest if finalize_manifest is not None else world_size == 1:
        summary["manifest"] = str(out / "manifest.json")
        finalize(out)
    return summary


@writes_directory("out_dir", what="hidden-state dataset")
def finalize(out_dir: str | Path) -> dict[str, Any]:
    """Write the manifest of an extraction whose planned shards all exist (metas from headers)."""
    from eyas.data.shards import read_shard_meta, shard_name, write_manifest
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


def parse_max_memory(text: str | None) -> dict | None:
    """`0=60GiB,cpu=200GiB` -> {0: "60GiB", "cpu": "200GiB"} (None stays None)."""
    if not text:
        return None
    out: dict = {}
    for item in text.split(","):
        dev, sep, size = item.partition("=")
        dev, size = dev.strip(), size.strip()
        if not sep or not dev or not size:
            raise ExtractError(f"--max-memory {text!r}: expected DEVICE=SIZE pairs separated by "
                               f"commas, e.g. 0=60GiB,cpu=200GiB")
        out[int(dev) if dev.isdigit() else dev] = size
    return out


def build_parser() -> argparse.ArgumentParser:
    """The `eyas extract` arguments (defaults shared with training come from `data.settings`)."""
    p = argparse.ArgumentParser(formatter_class=HelpFormatter,
        prog="eyas extract", description="Run the target over a token dataset and store the "
        "EAGLE-3 training features (aux states, teacher, target argmax). Resumable; launch with "
        "`accelerate launch --num_processes G` for data parallel over G GPUs.")
    p.add_argument("--tokens", required=True, help="token dataset (from eyas prepare)")
    p.add_argument("--target", required=True, help="model directory, hub id (org/name[@revision]) or preset name")
    p.add_argument("--out", default=None,
                   help="output hidden-state dataset directory (none with --estimate, required "
                        "otherwise; locked while written; resumes its own run, refuses other "
                        "data and --tokens itself)")
    p.add_argument("--layers", default=TargetSettings.aux_layer_ids, metavar="A,B,C",
                   help=field_help(TargetSettings, "aux_layer_ids", "target.aux_layer_ids"))
    ex = ExtractionSettings
    p.add_argument("--aux-format", choices=[f.value for f in AuxFormat],
                   default=default(ex, "aux_format"),
                   help=field_help(ex, "aux_format", "data.aux_format"))
    p.add_argument("--teacher", choices=TEACHERS, default=default(ex, "teacher"),
                   help=field_help(ex, "teacher", "data.teacher", "both: the two."))
    p.add_argument("--topk", type=int, default=32, help="k of the top-k teacher")
    p.add_argument("--max-samples", type=int, default=None,
                   help="use only the first N samples of the token dataset (default: all)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="tokens per forward (a longer sample runs alone)")
    p.add_argument("--pad-batches", action="store_true", default=ex.extract_pad_batches,
                   help=field_help(ex, "extract_pad_batches", "data.extract_pad_batches"))
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=TargetSettings.dtype,
                   help=field_help(TargetSettings, "dtype", "target.dtype",
                                   "Match the precision the target is served in."))
    p.add_argument("--shard-tokens", type=int, default=None,
                   help="tokens per output shard (default: about 1 GiB of features per shard)")
    p.add_argument("--device", default="auto", help="auto (cuda:<local rank> if available), "
                   "cpu, cuda:0, ...")
    p.add_argument("--device-map", default=None,
                   help="'auto': one large target across GPUs (default: none, the whole target "
                        "on --device)")
    p.add_argument("--max-memory", default=None, metavar="DEV=SIZE,...",
                   help="(none: no cap) with --device-map, the most memory per device, e.g. "
                        "0=60GiB,cpu=200GiB; what does not fit the GPUs stays in host memory")
    p.add_argument("--finalize-only", action="store_true",
                   help="only write the manifest from the shards present")
    p.add_argument("--estimate", action="store_true",
                   help="capture nothing: print the bytes on disk of every storage mode and the "
                        "expected time (a few timed forwards of the target on this device)")
    p.add_argument("--estimate-batches", type=int, default=3, metavar="N",
                   help="with --estimate: forwards timed after one warm-up")
    p.add_argument("--tokens-per-s", type=float, default=None, metavar="RATE",
                   help="with --estimate: a stated capture rate instead of timing the target "
                        "(default: none, the target is loaded and timed)")
    return p


def cli_main(argv: list[str] | None = None) -> int:
    """`eyas extract --tokens DIR --target MODEL --out DIR [--layers a,b,c] ...`; with
    `--estimate` (no --out) the bytes and time it would take, capturing nothing."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.estimate:
        from eyas.data.estimate import cli_estimate
        return cli_estimate(args)
    if args.out is None:
        parser.error("the following arguments are required: --out (or --estimate)")
    exit_with_launcher()  # a rank of `accelerate launch -m eyas.data.extract` ends with it
    if args.finalize_only:
        print(json.dumps({k: v for k, v in finalize(args.out).items() if k != "shards"}, indent=1))
        return 0
    from accelerate import PartialState
    use_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    state = PartialState(cpu=use_cpu)
    device = state.device if args.device == "auto" else torch.device(args.device)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    lock = lock_for_ranks(state, args.out, what="hidden-state dataset",
                          check=lambda out: check_extract_out(out, args.tokens))
    try:
        _extract_ranks(args, state, device, layers)
    finally:
        if lock is not None:
            lock.release()
    return 0


def _extract_ranks(args, state, device, layers) -> None:
    summary = extract(args.tokens, args.target, args.out, layers=layers,
                      aux_format=args.aux_format, teacher=args.teacher, topk=args.topk,
                      batch_tokens=args.batch_tokens, shard_tokens=args.shard_tokens,
                      max_samples=args.max_samples, device=device, device_map=args.device_map,
                      max_memory=parse_max_memory(args.max_memory),
                      pad_batches=args.pad_batches,
                      dtype=target_dtype_name(args.dtype, device),
                      rank=state.process_index, world_size=state.num_processes,
                      finalize_manifest=False)
    state.wait_for_everyone()
    if state.is_main_process:
        finalize(args.out)
        summary["manifest"] = str(Path(args.out) / "manifest.json")
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    from eyas.data.log import run_main
    run_main(cli_main)
