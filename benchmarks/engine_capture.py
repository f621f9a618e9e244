"""Capture throughput: vLLM's engine (`eyas extract --capture vllm`) against transformers.

The same token dataset (benchmarks/extract.py's: the shipped prompts with canned answers of
varied length) is captured both ways into the same storage mode, one after the other on the same
machine:
  hf      `data.produce.extract.extract` in this process (forward hooks, equal-length batches);
  engine  `data.produce.extract.extract(capture="vllm")`: a vLLM worker in its own venv, requests with
          max_tokens 1, the connector's files turned into the same fields.
Per path it reports the end-to-end wall time (the engine's includes its start), the capture
rate the run itself logs (tokens / seconds of capture, the engine's start excluded) and the
peak resident memory of this process; the engine's own process is reported by its log. Then
the two datasets are compared (ids, argmax equal; aux's largest relative error).

    python benchmarks/engine_capture.py --out engine_capture.json [--target smollm2]
        [--samples 48] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract import make_tokens  # noqa: E402

from eyas.data.store.dataset import open_dataset  # noqa: E402
from eyas.data.produce.extract import extract  # noqa: E402
from eyas.data.common.log import setup_logging  # noqa: E402
from eyas.data.common.targets import load_tokenizer  # noqa: E402


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def compare(a: Path, b: Path) -> dict:
    """Engine dataset `a` against HF dataset `b`: ids and argmax agreement, and per aux layer
    (and `last`) the largest absolute error and the error's rms relative to the state's rms."""
    x, y = open_dataset(a), open_dataset(b)
    ids = x.manifest["aux_layer_ids"]
    err = {str(k): [0.0, 0.0, 0.0] for k in ids} | {"last": [0.0, 0.0, 0.0]}   # max, Σd², Σv²
    argmax_equal = ids_equal = tokens = 0
    for i in range(len(x)):
        u, v = x.sample(i), y.sample(i)
        ids_equal += int(torch.equal(u["input_ids"], v["input_ids"]))
        argmax_equal += int((u["target_argmax"] == v["target_argmax"]).sum())
        tokens += int(u["input_ids"].numel())
        pairs = [(str(k), u["aux"][:, j].float(), v["aux"][:, j].float())
                 for j, k in enumerate(ids)]
        if "last" in u and "last" in v:
            pairs.append(("last", u["last"].float(), v["last"].float()))
        for name, p, q in pairs:
            d = p - q
            e = err[name]
            e[0] = max(e[0], float(d.abs().max()))
            e[1] += float((d * d).sum())
            e[2] += float((q * q).sum())
    layers = {name: {"max_abs": e[0], "rel_rms": (e[1] / e[2]) ** 0.5 if e[2] else None}
              for name, e in err.items() if e[2]}
    return {"samples": len(x), "tokens": tokens, "ids_equal": ids_equal,
            "argmax_equal_tokens": argmax_equal, "per_layer": layers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args()
    setup_logging()
    work = Path(tempfile.mkdtemp(prefix="eyas-bench-capture-"))
    try:
        tokens = make_tokens(work, args.target, load_tokenizer(args.target), args.samples,
                             40, 400)
        n_tokens = int(open_dataset(tokens).sample_lengths.sum())
        rows = {}
        t0 = time.perf_counter()
        s = extract(tokens, args.target, work / "hf", dtype=args.dtype, device="cpu",
                    teacher="both")
        rows["hf"] = {"wall_s": time.perf_counter() - t0, "capture_tok_s": s["tokens_per_s"]}
        rows["hf"]["peak_rss_gib"] = _peak_gib()
        t0 = time.perf_counter()
        s = extract(tokens, args.target, work / "engine", capture="vllm", dtype=args.dtype,
                    teacher="both")
        rows["engine"] = {"wall_s": time.perf_counter() - t0,
                          "capture_tok_s": s["tokens_per_s"]}
        rows["engine"]["peak_rss_gib"] = _peak_gib()
        same = compare(work / "engine", work / "hf")
    finally:
        keep = {d: open_dataset(work / d).manifest.get("capture") for d in ("engine",)
                if (work / d / "manifest.json").is_file()}
        shutil.rmtree(work, ignore_errors=True)
    for r in rows.values():
        r["end_to_end_tok_s"] = n_tokens / r["wall_s"]
    res = {"target": args.target, "dtype": args.dtype, "samples": args.samples,
           "tokens": n_tokens, "rows": rows, "agreement": same,
           "engine": keep.get("engine"),
           "ratio_capture": rows["engine"]["capture_tok_s"] / rows["hf"]["capture_tok_s"],
           "ratio_end_to_end": rows["engine"]["end_to_end_tok_s"] / rows["hf"]["end_to_end_tok_s"]}
    print(f"{'path':<8} {'wall s':>8} {'capture tok/s':>14} {'end-to-end tok/s':>17}")
    for name, r in rows.items():
        print(f"{name:<8} {r['wall_s']:>8.1f} {r['capture_tok_s']:>14.0f} "
              f"{r['end_to_end_tok_s']:>17.0f}")
    print(f"engine / hf: capture {res['ratio_capture']:.2f}x, end to end "
          f"{res['ratio_end_to_end']:.2f}x; {same}")
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
