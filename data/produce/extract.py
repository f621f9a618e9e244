"""Token dataset -> hidden-state dataset: run the target and keep what EAGLE-3 training needs.

Per token t of every sample (see data/store/FORMAT.md for the stored layout):
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
live in ``data/common/capture.py``, the shard plan, the forward groups and one forward's fields in
``data/produce/forward.py`` (which `eyas verify` and `eyas extract --estimate` run too).

Batching: the samples of one output shard are sorted by length and run up to `batch_tokens`
tokens per forward. By default a forward holds only samples of EQUAL length (no padding), which
makes every stored value bitwise equal to a plain forward of the sample alone (padding can
change the kernels' rounding); ``pad_batches=True`` pads different lengths together (right
padding + attention mask) for throughput on many short samples.

Resumable: output shard i always covers the same sample range (the plan, fixed by the token
dataset and `shard_tokens`, is stored in ``extract_plan.json``). A shard file that exists is
complete (data.store.shards writes atomically); its meta is read back from its header and it is not
recomputed. The manifest is written last, once every planned shard exists.

Several GPUs:
- data parallel (the target fits one GPU): launch one process per GPU, e.g.
  ``accelerate launch --num_processes 8 -m eyas.data.produce.extract --tokens T --target M --out O``
  (or through ``eyas extract``). Process r takes shards i ≡ r (mod world) on ``cuda:<local
  rank>``; after a barrier rank 0 writes the manifest. If the ranks ran as separate jobs,
  ``eyas extract ... --finalize-only`` collects the metas from the shard headers and writes it.
- a target too large for one GPU: ``--device-map auto`` loads it across every visible GPU
  (transformers/accelerate place the layers; the hooks work unchanged). One process.
CPU works with one process (the default).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eyas.data.common.capture import ExtractError
from eyas.data.produce.forward import TEACHERS
from eyas.data.common.lock import lock_for_ranks, writes_directory
from eyas.data.produce.extract_plan import (finalize, make_plan, open_tokens, pending_shards,
                                            write_plan)
from eyas.data.common.parent import exit_with_launcher
from eyas.data.produce.outdir import check_extract_out
from eyas.data.common.options import option, shared
from eyas.data.common.settings import (DTYPE_CHOICES, Capture, ExtractionSettings,
                                       TargetSettings)
from eyas.data.common.targets import target_dtype_name

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Plan, run, finalize


def _written(meta: dict[str, Any], rank: int, tokens: int, t0: float, bar) -> None:
    rate = tokens / max(time.perf_counter() - t0, 1e-9)
    bar.set_postfix(shard=meta["index"], tok_s=f"{rate:.0f}")
    log.info("rank %d: shard %d (%d samples) written; %.0f tokens/s", rank, meta["index"],
             meta["n_samples"], rate)


def _check_settings(teacher: str, topk: int, vocab_chunk: int, rank: int,
                    world_size: int) -> None:
    """Refuse an unknown teacher, a top-k outside [1, vocab_chunk] or a rank outside the world."""
    if teacher not in TEACHERS:
        raise ExtractError(f"teacher must be one of {TEACHERS}, got {teacher!r}")
    if teacher != "last" and not 1 <= topk <= vocab_chunk:
        raise ExtractError(f"topk must be in [1, vocab_chunk={vocab_chunk}], got {topk}")
    if not 0 <= rank < world_size:
        raise ExtractError(f"rank {rank} is not in [0, world_size={world_size})")


def _run_shards(capturer, out: Path, shards: list[list[int]], todo: list[int],
                lengths: list[int], *, aux_format: str, rank: int) -> int:
    """Capture and write shards `todo` of the plan; returns the tokens processed. Shard j is
    written on a thread while the producer computes shard j + 1 (at most one shard in flight,
    so host memory holds two shards' features at most)."""
    from eyas.data.common.utils import progress
    from eyas.data.store.shards import write_shard
    total = sum(sum(lengths[a:b]) for a, b in (shards[j] for j in todo))
    bar = progress(None, total=total, unit="tok", unit_scale=True,
                   desc=f"extract[{capturer.kind.value}:{rank}]")
    done_tokens, t0 = 0, time.perf_counter()
    writer, pending = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer"), None
    try:
        for j in todo:
            a, b = shards[j]
            results = capturer.capture(list(range(a, b)))
            ntok = sum(lengths[a:b])
            done_tokens += ntok
            bar.update(ntok)
            if pending is not None:
                _written(pending.result(), rank, done_tokens, t0, bar)
            pending = writer.submit(write_shard, out, j, [results[i] for i in range(a, b)],
                                    aux_format=aux_format)
        if pending is not None:
            _written(pending.result(), rank, done_tokens, t0, bar)
    finally:
        writer.shutdown(wait=True)
        bar.close()
    return done_tokens


def _kept(out: Path, n_shards: int) -> str:
    """What an extraction stopped by its engine leaves, and how to go on."""
    from eyas.data.store.shards import shard_name
    done = sum((out / shard_name(j)).is_file() for j in range(n_shards))
    return (f"{done} of {n_shards} shard(s) of {out} are complete and kept: run the same "
            f"`eyas extract` command again to resume")


@writes_directory("out_dir", what="hidden-state dataset",
                  when=lambda a: a["world_size"] == 1)  # several ranks: main's rank 0
def extract(tokens_dir: str | Path, target: str | Path, out_dir: str | Path, *,
            capture: Capture | str = Capture.hf, endpoint: str | None = None,
            served_model: str | None = None,
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
        capture: who runs the target (data/produce/capturers.py): hf (here, transformers), vllm
            (a vLLM engine worker here) or endpoint (a `vllm serve` at `endpoint`, its model
            `served_model`, default the first it lists). The engines take one process.
        layers: aux layer ids (HF hidden_states indices, 2 <= a < b < c < N); None = the
            default [2, N//2, N-3].
        aux_format: "bf16" (exact) or "fp8" (see data/store/FORMAT.md for the error bound).
        teacher: "last" (post-norm last state), "topk" (top-k ids + logits) or "both";
            target_argmax is always stored.
        topk: k for the top-k teacher. batch_tokens: tokens per forward (a longer sample runs
            alone).
        pad_batches: pad samples of different lengths into one forward (module doc,
            "Batching": faster for many short samples, values differ by bf16 rounding).
        dtype: "bfloat16" or "float32": what the target runs in when `model` is None (match the
            precision it serves in; float32 costs ~2x the time on a GPU).
        shard_tokens: tokens per output shard; None = shard_bytes / bytes per token.
        max_samples: only the first N samples of the token dataset.
        device / device_map: where the target runs ("cuda:0", "cpu"; None: the first GPU if
            there is one, else the CPU), or device_map "auto" to spread one large target over
            all visible GPUs (or a dict module name -> device, as transformers takes it).
        max_memory: with device_map, the most memory per device ({0: "60GiB", "cpu":
            "200GiB"}); layers that do not fit the GPUs go to the CPU.
        rank, world_size: data parallel: this process does shards i = rank (mod world_size);
            finalize_manifest: write the manifest at the end (default: when world_size == 1).
        row_chunk, vocab_chunk: logits chunk (tokens x vocabulary rows) for argmax/top-k.
        model: an already loaded target (skips loading `target`).
    Returns a summary dict (shards computed/resumed, tokens, tokens/s)."""
    from eyas.data.produce.capturers import open_capturer
    from eyas.data.produce.engine_capture import STATES_DIR, engine_stops

    _check_settings(teacher, topk, vocab_chunk, rank, world_size)
    tokens, out = open_tokens(tokens_dir, target, out_dir), Path(out_dir)
    n = len(tokens) if max_samples is None else min(max_samples, len(tokens))
    topk, lengths = (topk if teacher != "last" else 0), [int(x) for x in tokens.sample_lengths[:n]]
    out.mkdir(parents=True, exist_ok=True)
    with open_capturer(capture, tokens, tokens_dir, target, storage=out / STATES_DIR,
                       layers=layers, teacher=teacher, topk=topk, dtype=dtype,
                       endpoint=endpoint, served_model=served_model, device=device,
                       device_map=device_map, max_memory=max_memory, model=model,
                       batch_tokens=batch_tokens, pad_batches=pad_batches, row_chunk=row_chunk,
                       vocab_chunk=vocab_chunk) as capturer:
        plan = make_plan(tokens, tokens_dir, target, lengths, capturer.plan_fields(),
                         shard_tokens=shard_tokens, shard_bytes=shard_bytes, teacher=teacher,
                         topk=topk, aux_format=aux_format)
        write_plan(out, plan)
        todo, resumed = pending_shards(out, plan["shards"], rank, world_size)
        t0 = time.perf_counter()
        with engine_stops(lambda: _kept(out, len(plan["shards"]))):
            done_tokens = _run_shards(capturer, out, plan["shards"], todo, lengths,
                                      aux_format=aux_format, rank=rank)
    dt = time.perf_counter() - t0
    summary = {"out_dir": str(out), "capture": capturer.kind.value, "shards": len(plan["shards"]),
               "computed": todo, "resumed": resumed, "tokens": done_tokens, "seconds": round(dt, 3),
               "tokens_per_s": round(done_tokens / dt, 1) if dt > 0 and done_tokens else None,
               "aux_layer_ids": plan["aux_layer_ids"]}
    if finalize_manifest if finalize_manifest is not None else world_size == 1:
        summary["manifest"] = str(out / "manifest.json")
        finalize(out)
    return summary


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


@dataclass(kw_only=True)
class ExtractOptions:
    """Run the target over a token dataset and store the EAGLE-3 training features (aux states,
    teacher, target argmax). Resumable; launch with `accelerate launch --num_processes G` for
    data parallel over G GPUs."""

    renamed = {"--engine": "--capture {}",
               "--endpoint": "--capture endpoint --capture-endpoint {}"}

    tokens: str = option(help="token dataset (from eyas prepare)")
    target: str = option(help="model directory, hub id (org/name[@revision]) or preset name")
    out: str | None = option(
        None, "output hidden-state dataset directory (none with --estimate, required otherwise; "
        "locked while written; resumes its own run, refuses other data and --tokens itself)",
        needed="out")
    layers: str | None = shared(TargetSettings, "aux_layer_ids", "target.aux_layer_ids",
                                metavar="A,B,C")
    aux_format: str = shared(ExtractionSettings, "aux_format", "data.aux_format")
    teacher: str = shared(ExtractionSettings, "teacher", "data.teacher", "both: the two.",
                          choices=TEACHERS)
    topk: int = option(32, "k of the top-k teacher")
    max_samples: int | None = option(
        None, "use only the first N samples of the token dataset (default: all)")
    batch_tokens: int = option(8192, "tokens per forward (a longer sample runs alone)")
    pad_batches: bool = shared(ExtractionSettings, "extract_pad_batches",
                               "data.extract_pad_batches")
    dtype: str = shared(TargetSettings, "dtype", "target.dtype",
                        "Match the precision the target is served in.", choices=DTYPE_CHOICES)
    shard_tokens: int | None = option(
        None, "tokens per output shard (default: about 1 GiB of features per shard)")
    device: str = option("auto", "auto (cuda:<local rank> if available), cpu, cuda:0, ...")
    device_map: str | None = option(
        None, "'auto': one large target across GPUs (default: none, the whole target on --device)")
    max_memory: str | None = option(
        None, "(none: no cap) with --device-map, the most memory per device, e.g. "
        "0=60GiB,cpu=200GiB; what does not fit the GPUs stays in host memory",
        metavar="DEV=SIZE,...")
    capture: str = shared(ExtractionSettings, "capture", "data.capture")
    capture_endpoint: str | None = shared(
        ExtractionSettings, "capture_endpoint", "data.capture_endpoint",
        "docs/engine.md has the server's command.", metavar="URL")
    capture_model: str | None = shared(ExtractionSettings, "capture_model", "data.capture_model",
                                       metavar="NAME")
    finalize_only: bool = option(False, "only write the manifest from the shards present")
    estimate: bool = option(
        False, "capture nothing: print the bytes on disk of every storage mode and the expected "
        "time (a few timed forwards of the target on this device)", needed="out")
    estimate_batches: int = option(3, "with --estimate: forwards timed after one warm-up",
                                   metavar="N")
    tokens_per_s: float | None = option(
        None, "with --estimate: a stated capture rate instead of timing the target (default: "
        "none, the target is loaded and timed)", metavar="RATE")


def main(args: ExtractOptions) -> int:
    """`eyas extract --tokens DIR --target MODEL --out DIR [--layers a,b,c] ...`; with
    `--estimate` (no --out) the bytes and time it would take, capturing nothing."""
    if args.estimate:
        from eyas.data.produce.estimate import cli_estimate
        return cli_estimate(args)
    exit_with_launcher()  # a rank of `accelerate launch -m eyas.data.produce.extract` ends with it
    if args.finalize_only:
        print(json.dumps({k: v for k, v in finalize(args.out).items() if k != "shards"}, indent=1))
        return 0
    settings = dict(layers=[int(x) for x in args.layers.split(",")] if args.layers else None,
                    aux_format=args.aux_format, teacher=args.teacher, topk=args.topk,
                    shard_tokens=args.shard_tokens, max_samples=args.max_samples)
    if args.capture != Capture.hf.value:     # an engine: one process
        device = "cuda" if torch.cuda.is_available() else "cpu"
        summary = extract(args.tokens, args.target, args.out, capture=args.capture,
                          endpoint=args.capture_endpoint, served_model=args.capture_model,
                          dtype=target_dtype_name(args.dtype, device), **settings)
        print(json.dumps(summary, indent=1))
        return 0
    from accelerate import PartialState
    use_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    state = PartialState(cpu=use_cpu)
    device = state.device if args.device == "auto" else torch.device(args.device)
    lock = lock_for_ranks(state, args.out, what="hidden-state dataset",
                          check=lambda out: check_extract_out(out, args.tokens))
    try:
        summary = extract(args.tokens, args.target, args.out, batch_tokens=args.batch_tokens,
                          device=device, device_map=args.device_map,
                          max_memory=parse_max_memory(args.max_memory),
                          pad_batches=args.pad_batches, dtype=target_dtype_name(args.dtype, device),
                          rank=state.process_index, world_size=state.num_processes,
                          finalize_manifest=False, **settings)
        state.wait_for_everyone()
        if state.is_main_process:
            finalize(args.out)
            summary["manifest"] = str(Path(args.out) / "manifest.json")
            print(json.dumps(summary, indent=1))
    finally:
        if lock is not None:
            lock.release()
    return 0


if __name__ == "__main__":
    from eyas.data.common.log import run_main
    from eyas.data.common.options import parse
    run_main(lambda argv: main(parse(ExtractOptions, "extract", argv)))
