"""Where the GPU time of a training step goes: torch.profiler, kernels grouped by role.

    profile_steps(step_fn, n) -> {"step_ms", "per_step_ms": {category: ms}, "top_kernels": [...]}

Each GPU kernel of n profiled steps (synchronised one by one) goes to the first category
that matches:
  optimizer   launched inside `Optimizer.step` or the clip (`bench.clip`, the trainer's
              `eyas.clip`, `clip_grad_norm_`)
  loss        launched inside `eyas.loss` (teacher, lm_head GEMMs, row kernels: train/step.py)
              or a loss kernel by name (its backward only rescales the stored gradient)
  attention   flex-attention kernels (inductor templates `triton_tem_*`, `flex`)
  matmul      cuBLAS / CUTLASS GEMMs (the drafter's projections, their gradients, fc)
  elementwise everything else: norms, RoPE, SwiGLU, the diagonal merge, casts, copies, memsets
  idle        step wall time minus the union of kernel intervals (launch gaps, host syncs)
The launch → kernel link is the profiler's correlation id; ranges are the host-side
record_function annotations enclosing the launch.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import re
import tempfile
import time

import torch

from eyas.train.profiling import STEP_RANGE

MATMUL = re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm\d\d_|s16816|hmma|splitk|ampere_|"
                    r"dot_|matmul", re.I)
ATTENTION = re.compile(r"flex|triton_tem|attention|fmha|flash", re.I)
LOSS_NAMES = re.compile(r"_loss_rows|_grad_rows|_scale_cast", re.I)
CATEGORIES = ("matmul", "attention", "loss", "elementwise", "optimizer", "idle")


def _categorise(name: str, ranges: set[str]) -> str:
    if any(r.startswith("Optimizer.step") or r in ("bench.clip", "eyas.clip") or "clip_grad" in r
           for r in ranges):
        return "optimizer"
    if "eyas.loss" in ranges or LOSS_NAMES.search(name):
        return "loss"
    if ATTENTION.search(name):
        return "attention"
    if MATMUL.search(name):
        return "matmul"
    return "elementwise"


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1e30
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def breakdown(trace: dict, windows: list[tuple[float, float]]) -> dict:
    """Categorised GPU time of a chrome trace, restricted to the step windows (µs)."""
    ev = trace["traceEvents"] if isinstance(trace, dict) else trace
    launches, annotations = {}, collections.defaultdict(list)
    kernels = []
    for e in ev:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = (e["tid"], e["ts"])
        elif cat == "user_annotation" or (cat == "cpu_op" and "clip_grad" in e.get("name", "")):
            annotations[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
    for tid in annotations:
        annotations[tid].sort()
    starts = {tid: [a[0] for a in v] for tid, v in annotations.items()}

    def ranges_at(tid, ts) -> set[str]:
        out = set()
        lst = annotations.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), ts)
        for a, b, name in lst[:i]:
            if a <= ts <= b:
                out.add(name)
        return out

    per = collections.defaultdict(float)
    names = collections.defaultdict(float)
    spans = []
    wall = sum(b - a for a, b in windows) / 1e3
    for k in kernels:
        a, b = k["ts"], k["ts"] + k["dur"]
        if not any(wa <= a <= wb for wa, wb in windows):
            continue
        launch = launches.get(k.get("args", {}).get("correlation"))
        ranges = ranges_at(*launch) if launch else set()
        c = _categorise(k.get("name", ""), ranges)
        per[c] += k["dur"] / 1e3
        names[(c, k.get("name", "")[:90])] += k["dur"] / 1e3
        spans.append((a, b))
    busy = _union_ms(spans)
    n = max(len(windows), 1)
    per_step = {c: per.get(c, 0.0) / n for c in CATEGORIES if c != "idle"}
    per_step["idle"] = max(0.0, wall - busy) / n
    top = sorted(names.items(), key=lambda kv: -kv[1])[:25]
    return {"step_ms": wall / n, "busy_ms": busy / n, "per_step_ms": per_step,
            "top_kernels": [{"category": c, "name": nm, "ms_per_step": v / n}
                            for (c, nm), v in top]}


def profile_steps(step_fn, n: int) -> dict:
    """Profile n calls step_fn(i) (each synchronised) and return `breakdown` of them.

    Two more steps run first under the profiler's wait/warm-up phases: the first profiled
    iteration otherwise loses GPU events while the tracer starts."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=1, warmup=1, active=n, repeat=1)) as prof:
        for i in range(n + 2):
            torch.cuda.synchronize()
            with record_function("bench.step") as _:
                step_fn(i)
                torch.cuda.synchronize()
            prof.step()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    t = time.perf_counter()
    out = breakdown(trace, step_windows(trace, "bench.step"))
    out["parse_s"] = time.perf_counter() - t
    return out


def step_windows(trace: dict | list, name: str) -> list[tuple[float, float]]:
    """The host-side ranges called `name` (µs, sorted): one per profiled step. The trace
    mirrors every range on the GPU timeline ("gpu_user_annotation"), which must not count as
    a second step."""
    return sorted((e["ts"], e["ts"] + e["dur"])
                  for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)
                  if e.get("ph") == "X" and e.get("name") == name
                  and e.get("cat") == "user_annotation")


def main() -> None:
    """`python benchmarks/profile_breakdown.py TRACE`: a saved trace's steps by role, e.g. the
    trainer's own (train.profile_steps writes RUN/profile/trace-rank0.json)."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("trace", help="Chrome trace JSON from torch.profiler")
    ap.add_argument("--window", default=STEP_RANGE,
                    help="name of the range around each step (benchmarks: bench.step)")
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    windows = step_windows(trace, args.window)
    if not windows:
        raise SystemExit(f"{args.trace}: no {args.window!r} ranges (name them with --window)")
    out = breakdown(trace, windows)
    print(f"{len(windows)} steps of {out['step_ms']:.1f} ms (GPU busy {out['busy_ms']:.1f} ms)")
    print("| " + " | ".join(CATEGORIES) + " |\n|" + "---|" * len(CATEGORIES))
    print("| " + " | ".join(f"{out['per_step_ms'][c]:.1f}" for c in CATEGORIES) + " |")
    for k in out["top_kernels"][:15]:
        print(f"{k['ms_per_step']:8.2f} ms  {k['category']:<11} {k['name']}")


if __name__ == "__main__":
    main()
