"""Extraction throughput against the target's plain forward on the same tokens.

Builds a token dataset (the shipped default prompts with canned answers of varied length,
tokenised by data.prepare with the target's template), then times, on the same tokens and the
same batches (equal-length groups, as `data.extract` runs them):
  plain    `model(input_ids)`: the CausalLM forward with full-vocabulary logits, nothing stored;
  extract  `data.extract.extract(...)` end to end: pre-hooks on the aux layers, the final-norm
           hook, chunked argmax over the vocabulary, copies to CPU, shard writing (crc32,
           safetensors, fsync) and the manifest.
Runs alternate (plain, extract, plain, extract, ...) and the best of each is reported.
Overhead = t_extract / t_plain - 1 (goal: <= 10%).

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

from data.extract import extract, length_groups
from data.prepare import prepare
from data.prompts import prompts_path
from data.shards import open_dataset
from models.targets import load_target

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


@torch.no_grad()
def time_plain(model, groups) -> float:
    t0 = time.perf_counter()
    for x in groups:
        model(input_ids=x, use_cache=False)
    return time.perf_counter() - t0


def time_extract(model, tokens: Path, out: Path, target: str, **kw) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    extract(tokens, target, out, model=model, **kw)
    return time.perf_counter() - t0


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
    logging.basicConfig(level=logging.WARNING)
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
    res = {
        "target": args.target, "device": args.device, "threads": torch.get_num_threads(),
        "samples": len(ds), "tokens": n_tokens, "forwards": len(groups),
        "teacher": args.teacher, "batch_tokens": args.batch_tokens,
        "plain_s": [round(x, 3) for x in plain], "extract_s": [round(x, 3) for x in ext],
        "plain_tok_s": round(n_tokens / min(plain), 1),
        "extract_tok_s": round(n_tokens / min(ext), 1),
        "overhead": round(min(ext) / min(plain) - 1, 4),
        "hidden_bytes": int(hidden.manifest["bytes"]),
        "bytes_per_token": round(hidden.manifest["bytes"] / n_tokens, 1),
    }
    print(f"\n{'target':<10} {'tokens':>7} {'fwds':>5} {'plain tok/s':>12} {'extract tok/s':>14} "
          f"{'overhead':>9} {'B/token':>8}")
    print(f"{res['target']:<10} {n_tokens:>7} {len(groups):>5} {res['plain_tok_s']:>12.1f} "
          f"{res['extract_tok_s']:>14.1f} {100 * res['overhead']:>8.1f}% "
          f"{res['bytes_per_token']:>8.0f}")
    print(f"(best of {args.repeats}; threads={res['threads']}; plain runs {res['plain_s']} s, "
          f"extract runs {res['extract_s']} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
