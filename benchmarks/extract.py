"""Extraction throughput against the target's plain forward on the same tokens.

Builds a token dataset (the shipped default prompts with canned answers of varied length,
tokenised by data.produce.prepare with the target's template), then times, on the same tokens and the
same batches (equal-length groups, as `data.produce.extract` runs them):
  plain    `model(input_ids)`: the CausalLM forward with full-vocabulary logits, nothing stored;
  extract  `data.produce.extract.extract(...)` end to end: pre-hooks on the aux layers, the final-norm
           hook, chunked argmax over the vocabulary, copies to CPU, shard writing (crc32,
           safetensors, fsync) and the manifest.
Runs alternate (plain, extract, plain, extract, ...); the best wall and CPU times of each are
reported. Overhead = t_extract / t_plain - 1 (goal: <= 10%), on wall and on process CPU time
(the steadier figure on a shared machine; use --threads 1 there to avoid OpenMP spin-waits).

    python benchmarks/extract.py --out extract.json [--target smollm2] [--samples 48]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eyas.data.produce.extract import extract
from eyas.data.produce.forward import length_groups
from eyas.data.common.log import setup_logging
from eyas.data.produce.prepare import prepare
from eyas.data.produce.prompts import prompts_path
from eyas.data.store.shards import open_dataset
from eyas.data.common.targets import load_target

FILLER = ("The answer depends on a few simple ideas. First, look at what is given and what is "
          "asked. Then work through the steps one at a time, checking each result before moving "
          "on. Small examples help: try the idea on numbers you can verify by hand. ")


def make_tokens(work: Path, target: str, tokenizer, samples: int, min_words: int,
                max_words: int) -> Path:
    src, out = work / "conv.jsonl", work / "tokens"
    prompts = [json.loads(x) for x in prompts_path("default").read_text().splitlines()]
    words = (FILLER * 40).split()
    with open(src, "w") as f:
        for i, p in enumerate(prompts[:samples]):
            n = min_words + (i * 37) % (max_words - min_words + 1)
            answer = " ".join(words[:n])
            f.write(json.dumps({"messages": p["messages"] + [
                {"role": "assistant", "content": answer}]}) + "\n")
    prepare(src, target, out, tokenizer=tokenizer, max_length=8192)
    return out


def batches(ds, batch_tokens: int) -> list[torch.Tensor]:
    """The equal-length groups `extract` forms, as [B, L] id tensors."""
    lengths = [int(x) for x in ds.sample_lengths]
    groups = length_groups(lengths, list(range(len(ds))), batch_tokens)
    return [torch.stack([ds[i]["input_ids"] for i in g]) for g in groups]


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of fn(). On a shared machine the CPU time
    is the steadier measure of the work done (other jobs inflate the wall time)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


@torch.no_grad()
def time_plain(model, groups) -> tuple[float, float]:
    def run():
        for x in groups:
            model(input_ids=x, use_cache=False)
    return _timed(run)


def time_extract(model, tokens: Path, out: Path, target: str, **kw) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    return _timed(lambda: extract(tokens, target, out, model=model, **kw))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--min-words", type=int, default=40)
    p.add_argument("--max-words", type=int, default=300)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--teacher", default="last", choices=("last", "topk", "both"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    setup_logging(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="eyas-bench-extract-"))
    work.mkdir(parents=True, exist_ok=True)
    model, tok = load_target(args.target, device=args.device)
    tokens = make_tokens(work, args.target, tok, args.samples, args.min_words, args.max_words)
    ds = open_dataset(tokens)
    groups = [g.to(args.device) for g in batches(ds, args.batch_tokens)]
    n_tokens = ds.num_tokens
    time_plain(model, groups[-1:])                                   # warm-up
    plain, ext = [], []
    for _ in range(args.repeats):
        plain.append(time_plain(model, groups))
        ext.append(time_extract(model, tokens, work / "hidden", args.target,
                                teacher=args.teacher, batch_tokens=args.batch_tokens,
                                device=args.device))
    hidden = open_dataset(work / "hidden")
    best = {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in
            (("plain", plain), ("extract", ext))}
    res = {
        "target": args.target, "device": args.device, "threads": torch.get_num_threads(),
        "samples": len(ds), "tokens": n_tokens, "forwards": len(groups),
        "teacher": args.teacher, "batch_tokens": args.batch_tokens,
        "plain_wall_s": [round(w, 3) for w, _ in plain],
        "plain_cpu_s": [round(c, 3) for _, c in plain],
        "extract_wall_s": [round(w, 3) for w, _ in ext],
        "extract_cpu_s": [round(c, 3) for _, c in ext],
        "plain_tok_s": round(n_tokens / best["plain"][0], 1),
        "extract_tok_s": round(n_tokens / best["extract"][0], 1),
        "overhead_wall": round(best["extract"][0] / best["plain"][0] - 1, 4),
        "overhead_cpu": round(best["extract"][1] / best["plain"][1] - 1, 4),
        "hidden_bytes": int(hidden.manifest["bytes"]),
        "bytes_per_token": round(hidden.manifest["bytes"] / n_tokens, 1),
    }
    print(f"\n{'target':<10} {'tokens':>7} {'fwds':>5} {'plain tok/s':>12} {'extract tok/s':>14} "
          f"{'overhead (wall)':>16} {'overhead (cpu)':>15} {'B/token':>8}")
    print(f"{res['target']:<10} {n_tokens:>7} {len(groups):>5} {res['plain_tok_s']:>12.1f} "
          f"{res['extract_tok_s']:>14.1f} {100 * res['overhead_wall']:>15.1f}% "
          f"{100 * res['overhead_cpu']:>14.1f}% {res['bytes_per_token']:>8.0f}")
    print(f"(best of {args.repeats}; threads={res['threads']}; wall plain {res['plain_wall_s']} "
          f"extract {res['extract_wall_s']} s; cpu plain {res['plain_cpu_s']} extract "
          f"{res['extract_cpu_s']} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
