"""Where the HOST time of a training step goes, and which calls wait for the GPU.

    diagnose(step_fn, n) -> {"syncs": [...], "host_ms_per_step": float, "top_host_ops": [...]}

A step is host-bound when the Python side issues its kernels more slowly than the GPU runs
them (profile_breakdown's "idle" then grows as GEMMs get faster). Two views of that side:
  syncs         every call that made the host wait for the device during one step
                (torch.cuda.set_sync_debug_mode("warn")), each with the innermost frames of
                the Python stack that issued it, deduplicated
  top_host_ops  torch.profiler over n steps, CPU activity only: the operators with the most
                self CPU time per step (host work per launch: guards, autograd, launchers)
"""

from __future__ import annotations

import collections
import time
import traceback
import warnings

import torch


def syncs_of(step_fn, frames: int = 6) -> list[dict]:
    """The synchronising calls of one step_fn(0), with where they came from (CUDA only)."""
    seen: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        stack = traceback.extract_stack()[:-2]
        ours = [f for f in stack if "/torch/" not in f.filename and "warnings" not in f.filename]
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                            for f in reversed(ours[-frames:]))
        seen[(str(message).split("\n")[0][:120], where)] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step_fn(0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [{"message": m, "where": w, "count": c} for (m, w), c in seen.most_common()]


def host_ops(step_fn, n: int, top: int = 25) -> tuple[float, list[dict]]:
    """(host wall ms per step while profiling, the `top` ops by self CPU time per step)."""
    from torch.profiler import ProfilerActivity, profile
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for i in range(n):
            step_fn(i)
        host_ms = (time.perf_counter() - t) * 1e3 / n
        sync()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return host_ms, [{"name": e.key[:90], "self_ms_per_step": e.self_cpu_time_total / 1e3 / n,
                      "calls_per_step": e.count / n} for e in rows[:top]]


def diagnose(step_fn, n: int) -> dict:
    host_ms, ops = host_ops(step_fn, n)
    return {"syncs": syncs_of(step_fn), "host_ms_per_step": host_ms, "top_host_ops": ops}


def format_diagnosis(case: str, d: dict) -> str:
    lines = [f"host side of {case}: {d['host_ms_per_step']:.1f} ms issued per step (profiled); "
             f"{sum(s['count'] for s in d['syncs'])} synchronising call(s) per step"]
    lines += [f"  sync x{s['count']}: {s['message'][:60]} at {s['where']}" for s in d["syncs"]]
    lines += [f"  {o['self_ms_per_step']:7.2f} ms {o['calls_per_step']:6.0f}x  {o['name']}"
              for o in d["top_host_ops"][:15]]
    return "\n".join(lines)
