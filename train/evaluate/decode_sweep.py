"""`eyas evaluate --prompts P --speedup K1,K2,...` without `--engine`: eyas's own real decoding
(`train.evaluate.specdec`, one sequence at a time, on --device) measured at each K against
target-only decoding, and predicted from the step costs it measured.

What is measured and predicted, and the result's keys: docs/acceptance.md, "Speedup by K".
The step costs are timed inside the decodes as the decoding waited for each step: the runners
hand back CPU argmaxes and drafts, so each timer stops after the device's work. The prediction
(`models.speedup.speedup(τ(K), K, t1, t_verify(K), t_draft)`, as the engine sweep predicts)
leaves out what a round costs beyond its forwards (the acceptance check, cache trimming,
bookkeeping) and the last round of each answer, cut at the token cap."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from eyas.models.speedup import speedup, tau

log = logging.getLogger(__name__)


def hardware(device: torch.device) -> str:
    """What the figures were measured on: the GPU's name, or the CPU threads."""
    if device.type == "cuda":
        return f"GPU: eyas real decoding on {torch.cuda.get_device_name(device)}"
    return (f"CPU: eyas real decoding, torch threads {torch.get_num_threads()} of "
            f"{len(os.sched_getaffinity(0))} cores")


def decode_rates(res: dict[str, Any]) -> tuple[float, float]:
    """(tokens/s with speculation, without) of the decoding phase of a `speculative_eval`
    result: tokens after each prompt's first over the seconds after its prompt forward."""
    spec = res["decode_tokens"] / (res["seconds"] - res["prefill_seconds"])
    base = ((res["baseline_tokens_generated"] - res["num_prompts"])
            / (res["baseline_seconds"] - res["baseline_prefill_seconds"]))
    return spec, base


def rows_from(results: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The sweep's rows from `speculative_eval` results by K (module docstring)."""
    top = results[max(results)]
    alive = [top[f"alive_{j}"] for j in range(max(results))]
    rows = []
    for k, r in sorted(results.items()):
        spec, base = decode_rates(r)
        tau_k, cost = tau(alive, k), r["step_seconds"]
        rows.append({
            "k": k, "concurrency": 1, "measured": spec / base,
            "predicted": speedup(tau_k, k, cost["target"], cost["verify"], cost["draft"]),
            "measured_end_to_end": r["speedup"], "tau": r["tau"], "tau_predicted_from": tau_k,
            "tau_emitted": r["tau_emitted"], "step_seconds": cost,
            "tokens_per_s": spec, "tokens_per_s_without_speculation": base,
            "rounds": r["decode_rounds"], "tokens": r["tokens_generated"],
            "identical_to_no_speculation": r["tokens_identical"]})
    return rows


def decode_sweep(drafter_dir: str | Path, target: str | Path, prompts_path: str | Path, *,
                 ks: list[int], num_prompts: int | None, max_new_tokens: int, model, tokenizer,
                 dtype: str = "fp32", device: str = "cpu", temperature: float = 0.0,
                 seed: int = 0, decoded: dict[int, dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    """The `speedup_sweep` object of `eyas evaluate --speedup` without an engine. decoded:
    `speculative_eval` results of these prompts already made, by K (`eyas evaluate`'s own
    run at --k), taken as they are instead of decoding that K again."""
    from eyas.train.evaluate.offline import speculative_eval
    results = dict(decoded or {})
    for k in sorted(set(ks) - set(results)):
        results[k] = speculative_eval(drafter_dir, target, prompts_path, k=k,
                                      num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                                      dtype=dtype, model=model, tokenizer=tokenizer,
                                      temperature=temperature, seed=seed, device=device)
        log.info("sweep K=%d: tau %.3f, speedup %.3f", k, results[k]["tau"],
                 results[k]["speedup"])
    results = {k: results[k] for k in set(ks)}
    rows = rows_from(results)
    return {"hardware": hardware(torch.device(device)), "decoder": "eyas", "dtype": dtype,
            "temperature": temperature, "num_prompts": results[max(results)]["num_prompts"],
            "max_new_tokens": max_new_tokens, "rows": rows,
            "best_k": {"1": max(rows, key=lambda r: r["measured"])["k"]}}
