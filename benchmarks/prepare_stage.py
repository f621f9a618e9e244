"""The tokenising stage (`eyas prepare`) on one conversations file, once per worker count: wall
seconds, records/s, and whether every run wrote the same shards as the first.

    python benchmarks/prepare_stage.py --input conversations.jsonl --target smollm2 \\
        --workers 1,2 --json prepare_stage.json

Each run writes to a fresh directory under --tmp; benchmarks/README.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.safetensors"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="conversations JSONL")
    p.add_argument("--target", default="smollm2", help="preset or model directory (tokenizer)")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--tmp", default=None, help="where the datasets are written (then removed)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()

    from eyas.data.produce.prepare import prepare
    from eyas.data.common.targets import load_tokenizer
    tok = load_tokenizer(args.target)
    rows, first = [], None
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for w in (int(x) for x in args.workers.split(",")):
            out = Path(tmp) / f"w{w}"
            t0 = time.perf_counter()
            s = prepare(args.input, args.target, out, tokenizer=tok, on_error="skip", workers=w)
            sec = time.perf_counter() - t0
            shards = shard_bytes(out)
            first = shards if first is None else first
            rows.append({"workers": w, "seconds": round(sec, 2), "records": s["records"],
                         "records_per_s": round(s["records"] / sec), "tokens": s["tokens"],
                         "same_shards_as_first": shards == first})
            shutil.rmtree(out)
    print("| workers | seconds | records/s | tokens | same shards |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['seconds']:.2f} | {r['records_per_s']} | {r['tokens']} | "
              f"{r['same_shards_as_first']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
