"""The answer-generation stage as the recipes run it: `data.produce.generate.generate_conversations`
with the real SmolLM2-135M-Instruct in bf16 on the GPU, its dynamic KV cache against its static
one (`data.generation_cache`), on the same prompts in one process.

    python benchmarks/generate_stage.py --prompts 16384 --out generate_stage.json   # H200

The prompts are the shipped ones (`data/produce/prompts/default.jsonl`), repeated under new ids to
--prompts records, answered greedily with at most --new tokens at --batch rows per call (the
quality recipe's 256 and 4096). Each cache answers all of them into its own file; the static
one pays its decoding step's compile inside its time, as a recipe would. Prints one row per
cache (seconds, answer tokens, tokens/s, peak GiB) and the share of records whose answers are
identical in both (bf16 kernels may round differently), and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from eyas.data.produce.generate import generate_conversations
from eyas.data.common.log import setup_logging
from eyas.data.produce.prompts import prompts_path
from eyas.data.common.targets import load_target


def write_prompts(path: Path, n: int) -> Path:
    """`n` prompt records: the shipped prompts in order, repeated under new ids."""
    shipped = [json.loads(line) for line in prompts_path("default").read_text().splitlines()]
    with open(path, "w") as f:
        for i in range(n):
            rec = shipped[i % len(shipped)]
            f.write(json.dumps({"id": f"p{i:06d}", "messages": rec["messages"]}) + "\n")
    return path


def answers(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[rec["id"]] = rec["messages"][-1]["content"]
    return out


def run(model, tok, src: Path, out: Path, cache: str, new: int, batch: int) -> dict:
    """Answer every prompt of `src` with `cache`; time, answer tokens and peak memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    generate_conversations(src, "smollm2", out, model=model, tokenizer=tok, max_new_tokens=new,
                           batch_size=batch, cache=cache)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n = sum(len(tok(a, add_special_tokens=False)["input_ids"]) for a in answers(out).values())
    return dict(cache=cache, seconds=round(dt, 1), answer_tokens=n,
                tokens_per_s=round(n / dt), peak_gib=round(torch.cuda.max_memory_allocated()
                                                           / 2**30, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16384, help="records to answer")
    ap.add_argument("--new", type=int, default=256, help="answer token cap (max_new_tokens)")
    ap.add_argument("--batch", type=int, default=4096, help="prompts per generate() call")
    ap.add_argument("--caches", default="dynamic,static", help="comma list, run in this order")
    ap.add_argument("--out", help="write the rows here as JSON")
    args = ap.parse_args()
    setup_logging(logging.INFO)
    if not torch.cuda.is_available():
        raise SystemExit("generate_stage.py times CUDA generation; no GPU is visible")
    model, tok = load_target("smollm2", dtype=torch.bfloat16, device="cuda")
    rows, texts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        src = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        for cache in args.caches.split(","):
            out = Path(tmp) / f"{cache}.jsonl"
            rows.append(run(model, tok, src, out, cache, args.new, args.batch))
            texts[cache] = answers(out)
            r = rows[-1]
            print(f"{cache:>8}  {args.prompts} prompts  {r['seconds']:7.1f} s  "
                  f"{r['answer_tokens']:>9} tokens  {r['tokens_per_s']:>7} tok/s  "
                  f"{r['peak_gib']:5.1f} GiB", flush=True)
    if len(texts) == 2:
        a, b = texts.values()
        same = sum(a[k] == b.get(k) for k in a) / len(a)
        print(f"identical answers: {same:.1%}")
        rows.append(dict(identical_share=round(same, 4)))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
