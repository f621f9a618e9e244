"""Predicted against measured speedup of a drafter, every K (and concurrency on an engine).

For each drafter, `eyas evaluate --engine vllm --speedup K… --concurrency C…` serves it with a
real vLLM engine at each K and without speculation, measures tokens/s at each concurrency, and
predicts each speedup from step costs measured in that sweep (models.speedup.MeasuredCosts:
the plain step, and the round time fitted linearly in K per concurrency) with τ(K) from the
per-position acceptance the engine counted at the largest K. With `--decoder eyas` the same
command without `--engine` measures eyas's own real decoding instead (one sequence at a time,
on --device), predicted from step costs it times apart from the decoding
(train/evaluate/decode_sweep.py). This script runs that command per drafter, prints one table
(measured, predicted, their ratio) and writes JSON.

    python benchmarks/speedup.py --drafter memorised=/tmp/memo/run/export \\
        --drafter main=runs/RUN/export --prompts P.jsonl --json out.json
    python benchmarks/speedup.py --decoder eyas --device cuda --max-new-tokens 64 \\
        --drafter memorised=/tmp/memo/run/export --prompts P.jsonl --json out.json
A drafter may name its own prompts: NAME=EXPORT@PROMPTS.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(name: str, drafter: str, prompts: str, args) -> dict:
    out = Path(tempfile.mkdtemp()) / f"{name}.json"
    cmd = [sys.executable, "-m", "eyas.train.cli", "evaluate", "--drafter", drafter,
           "--target", args.target, "--prompts", prompts, "--k", str(max(args.ks)),
           "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype,
           "--speedup", ",".join(map(str, args.ks)), "--out", str(out)]
    if args.decoder == "vllm":
        cmd += ["--engine", "vllm", "--concurrency", ",".join(map(str, args.concurrency))]
    else:
        cmd += ["--device", args.device]
    if args.num_prompts:
        cmd += ["--num-prompts", str(args.num_prompts)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    res = json.loads(out.read_text())
    return res["engine"]["speedup"] if args.decoder == "vllm" else res["speedup_sweep"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=EXPORT")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", default=None, help="for drafters that name none")
    ap.add_argument("--decoder", choices=("vllm", "eyas"), default="vllm")
    ap.add_argument("--device", default="cpu", help="--decoder eyas: cpu or cuda")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 5, 7])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4, 16])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results, lines = {}, ["| drafter | K | C | τ | measured | predicted | predicted / measured |",
                          "|---|---|---|---|---|---|---|"]
    for spec in args.drafter:
        name, _, path = spec.partition("=")
        path, _, prompts = path.partition("@")
        if not (prompts or args.prompts):
            ap.error(f"--drafter {spec}: no prompts (pass --prompts or NAME=EXPORT@PROMPTS)")
        res = results[name] = run(name, path, prompts or args.prompts, args)
        for r in res["rows"]:
            ratio = r["predicted"] / r["measured"]
            lines.append(f"| {name} | {r['k']} | {r['concurrency']} | {r['tau']:.3f} | "
                         f"{r['measured']:.3f} | {r['predicted']:.3f} | {ratio:.3f} |")
        if args.json:                    # after each drafter: a later failure keeps these
            Path(args.json).write_text(json.dumps({"results": results}, indent=1))
    print("\n".join(lines))
    worst = max(abs(r["predicted"] / r["measured"] - 1)
                for res in results.values() for r in res["rows"])
    print(f"largest |predicted / measured - 1|: {worst:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "worst": worst}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
