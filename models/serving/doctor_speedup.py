"""Predicted speedup of serving an export (models/speedup.py's roofline model), for the doctor
and the model card.

The acceptance is the export's recorded evaluation (eyas_provenance.json `eval`): a_j, the
probability that drafts 1 … j of a round are all accepted, is the product of the recorded
conditional acceptances cond_acc_0 … cond_acc_{j-1} (`cond_acc_k` is draft k + 1's acceptance
given drafts 1 … k were; `acc_k` counts draft k + 1 also after a rejected one, so it is not a
chain's acceptance). The target's shape comes from its config.json, the drafter's from its own,
and the deployment from the user's settings: hardware, GPUs (default: the fewest whose memory
holds the target's weights with `ROOM` to spare), bytes per weight and concurrency.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from eyas.models.serving.contract import PROVENANCE, WARNING, read_record
from eyas.models.speedup import HARDWARE, RooflineCosts, TargetShape, tau

#: memory the weights may fill of the GPUs they are spread over (the rest: KV cache, activations)
ROOM = 1.2
#: the concurrencies of the model card's table
CARD_CONCURRENCY = (1, 4, 16, 64)
MEASURE = ("eyas evaluate --engine vllm --prompts PROMPTS --speedup 1,3,5,7 "
           "--concurrency 1,4,16")


def chain_acceptance(ev: Mapping[str, Any] | None) -> list[float] | None:
    """a_1, a_2, … from a recorded evaluation (module docstring); None when it records no
    finite conditional acceptance at position 1."""
    out, alive = [], 1.0
    for k in range(len(ev or {})):
        c = (ev or {}).get(f"cond_acc_{k}")
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not math.isfinite(c):
            break
        alive *= float(c)
        out.append(alive)
    return out or None


def drafter_params(cfg: Mapping[str, Any]) -> float:
    """Parameters one drafter step reads, from its config.json: fc, the decoder layer (its
    attention takes the embedding and hidden state concatenated) and lm_head."""
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    th = cfg.get("target_hidden_size") or H
    vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    attn = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H
    return 3 * th * H + attn + 3 * H * inter + H * vd


def fewest_gpus(shape: TargetShape, hardware: str, weight_bytes: float) -> int:
    """The fewest GPUs of `hardware` whose memory holds every weight of the target (all its
    experts) at `weight_bytes` per parameter, with `ROOM` to spare."""
    total = shape.dense_params + shape.moe_layers * shape.experts * shape.expert_params
    return max(1, math.ceil(total * weight_bytes * ROOM / HARDWARE[hardware].memory))


def roofline(tcfg: Mapping[str, Any], dcfg: Mapping[str, Any], hardware: str = "h100",
             gpus: int | None = None, weight_bytes: float = 2.0) -> RooflineCosts:
    """The roofline step costs of serving the drafter `dcfg` with the target `tcfg`."""
    shape = TargetShape.from_config(dict(tcfg))
    n = gpus if gpus is not None else fewest_gpus(shape, hardware, weight_bytes)
    return RooflineCosts(shape, drafter_params(dcfg), HARDWARE[hardware], gpus=n,
                         weight_bytes=weight_bytes)


def predict(costs: RooflineCosts, acc: list[float], k: int, concurrency: int) -> float:
    """Speedup at K drafts; positions past the recorded ones count as never accepted."""
    return costs.speedup(tau(acc + [0.0] * (k - len(acc)), k), k, concurrency)


def best_k(costs: RooflineCosts, acc: list[float], concurrency: int) -> tuple[int, float]:
    """(K, speedup) of the K in 1 … the recorded positions with the highest speedup."""
    return max(((k, predict(costs, acc, k, concurrency)) for k in range(1, len(acc) + 1)),
               key=lambda kv: kv[1])


def assumptions(costs: RooflineCosts) -> str:
    return (f"{costs.gpus} × {costs.hardware.name}, {costs.weight_bytes:g} bytes per weight, "
            f"{costs.context} tokens of context per sequence, roofline estimate "
            f"(models/speedup.py)")


def speedup_table(tcfg: Mapping[str, Any], dcfg: Mapping[str, Any], acc: list[float],
                  ttt_steps: int) -> dict[str, Any]:
    """The model card's table: predicted speedup at K = 1 … `ttt_steps` (rows) and each of
    `CARD_CONCURRENCY` (columns), on the default deployment (H100, fewest GPUs, bf16)."""
    costs = roofline(tcfg, dcfg)
    return {"concurrency": list(CARD_CONCURRENCY),
            "rows": [[k] + [predict(costs, acc, k, c) for c in CARD_CONCURRENCY]
                     for k in range(1, ttt_steps + 1)],
            "assumptions": assumptions(costs), "measure": MEASURE}


def deployment_error(concurrency: int, gpus: int | None, weight_bytes: float) -> str | None:
    """What is wrong with the doctor's deployment options, or None."""
    for name, v, ok, want in (("--concurrency", concurrency, concurrency >= 1, "an integer >= 1"),
                              ("--gpus", gpus, gpus is None or gpus >= 1, "an integer >= 1"),
                              ("--weight-bytes", weight_bytes, weight_bytes > 0,
                               "a number > 0 (bf16 2, fp8 1, int4 0.5)")):
        if not ok:
            return f"{name} {v}: expected {want}"
    return None


def recorded_eval(export_dir: str | Path) -> Mapping[str, Any] | None:
    """The `eval` of the export's eyas_provenance.json; None when absent or damaged (the
    validator names a damaged one)."""
    rec = read_record(export_dir, PROVENANCE)
    ev = rec.get("eval") if isinstance(rec, dict) else None
    return ev if isinstance(ev, dict) else None


def check_speedup(report: Any, ev: Mapping[str, Any] | None, dcfg: Mapping[str, Any],
                  tcfg: Mapping[str, Any] | None, k: int | None, *, concurrency: int,
                  hardware: str, gpus: int | None, weight_bytes: float) -> None:
    """The doctor's check: a warning when the predicted speedup at K and `concurrency` is below
    1, else the figure among the checked; `report.stats["speedup"]` either way."""
    acc = chain_acceptance(ev)
    if acc is None or tcfg is None or k is None:
        why = ("the export records no evaluation with per-position acceptance "
               "(eyas_provenance.json eval cond_acc_0, …): export from a run with an eval"
               if acc is None else "no K (pass --num-speculative-tokens)" if k is None
               else "no target config")
        report.not_checked.append(f"predicted speedup: {why}")
        return
    costs = roofline(tcfg, dcfg, hardware, gpus, weight_bytes)
    s = predict(costs, acc, k, concurrency)
    bk, bs = best_k(costs, acc, concurrency)
    t, a = tau(acc + [0.0] * (k - len(acc)), k), assumptions(costs)
    report.stats["speedup"] = {"k": k, "concurrency": concurrency, "predicted": s,
                               "tau": t, "best_k": bk, "best_predicted": bs, "assumptions": a}
    text = (f"predicted speedup {s:.2f}× at K={k}, concurrency {concurrency} (τ({k}) = {t:.2f};"
            f" {a})")
    if s >= 1:
        report.checked.append(text)
        return
    fix = (f"serve with K={bk} (predicted {bs:.2f}× at this concurrency)" if bs >= 1 else
           f"no K pays at this concurrency (best K={bk}: {bs:.2f}×): raise the acceptance "
           f"(more or target-generated data, longer training) or serve without speculation")
    report.add("SPEEDUP_BELOW_ONE", WARNING, text,
               "each round runs K drafter steps and verifies K + 1 tokens per sequence; at "
               "this acceptance the tokens gained do not pay for it, and serving with "
               "speculation is slower than without",
               f"{fix}; measure on the deployment with `{MEASURE}`")
