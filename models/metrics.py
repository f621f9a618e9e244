"""Draft accuracy and acceptance-length metrics of the TTT unroll, as exact integer counts.

Counts are int64 tensors computed on the device without host syncs; sum them over micro-batches
and ranks (all-reduce SUM), then `finalize` once when logging.

Definitions (eagle3-training.md §5). Row (k, t) COUNTS iff mask(k, t) = valid(k, t) ·
loss_mask[t+1+k] (`models.objective.metric_mask`; no position mask: a target argmax outside the
draft vocabulary is a miss, never dropped). It is CORRECT iff it counts and the draft argmax
mapped to a target id equals the target's argmax at index t+1+k:
    correct(k, t) = mask(k, t) · [draft_argmax[k, t] + d2t[draft_argmax[k, t]] == target_argmax[t+1+k]]

    acc_k       = Σ_t correct(k, t) / Σ_t mask(k, t)
    cond_acc_k  = Σ_t alive(k, t) / Σ_t mask(k, t)·alive(k-1, t)     alive(k, t) = Π_{j≤k} correct(j, t)
                  (alive(-1, t) = 1): the per-position acceptance of a greedy chain
    CHAIN STARTS are the rows with mask(0, t) — every assistant position a chain could start after.
    A chain starting at t accepts L(t) = Σ_k alive(k, t) ∈ [0, K] drafts (consecutive correct
    steps from step 0; it stops at the first miss, document end, or non-assistant token), plus
    the bonus token the target always contributes:
    accept_len  = Σ_starts (L(t) + 1) / #starts                         (exact greedy-chain τ)
    accept_len_independent = 1 + Σ_k Π_{j≤k} acc_j     (SpecForge's estimate Σ_k Π_{j≤k} acc_j,
                  which treats steps as independent, plus the same bonus token for comparability)
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.models.ttt import shifted_for_steps

COUNT_KEYS = ("correct", "total", "cond_correct", "cond_total", "accept_len_sum", "chain_starts")


def chain_alive(draft_argmax: Tensor, d2t: Tensor, target_argmax: Tensor, mask: Tensor
                ) -> tuple[Tensor, Tensor]:
    """(correct, alive) [K, T]: bool correct(k, t) and int64 alive(k, t) (module docstring).

    draft_argmax [K, T] int64 draft-vocabulary ids (−1 marks a row the loss skipped, which
    never counts), d2t [Vd] int64 offsets, target_argmax [T] int64, mask [K, T] bool.
    """
    K, T = draft_argmax.shape
    if mask.shape != (K, T) or target_argmax.shape != (T,):
        raise ValueError(f"shapes: draft_argmax {tuple(draft_argmax.shape)}, mask "
                         f"{tuple(mask.shape)} (want [K, T]), target_argmax "
                         f"{tuple(target_argmax.shape)} (want [T])")
    am = draft_argmax.clamp_min(0)
    drafted = am + d2t[am]                                                # [K, T] target ids
    wanted = shifted_for_steps(target_argmax, K, -1)                      # [K, T] argmax at t+1+k
    correct = mask.bool() & (drafted == wanted)                           # [K, T]
    return correct, torch.cumprod(correct.to(torch.int64), dim=0)


def accept_counts(draft_argmax: Tensor, d2t: Tensor, target_argmax: Tensor, mask: Tensor,
                  chain: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor]:
    """Exact int64 counts (see module docstring) of one batch.

    draft_argmax [K, T] int64 draft-vocabulary ids (e.g. LossOutput.draft_argmax), d2t [Vd] int64
    offsets, target_argmax [T] int64 (target's prediction of token t+1 at index t), mask [K, T]
    bool (`models.objective.metric_mask(valid, loss_mask)`); chain: `chain_alive` of the same
    arguments when the caller already has it. Returns correct/total/cond_correct/cond_total [K]
    and accept_len_sum/chain_starts [] (all int64, summable across ranks).
    """
    correct, alive = chain or chain_alive(draft_argmax, d2t, target_argmax, mask)
    mask = mask.bool()
    before = torch.cat([torch.ones_like(alive[:1]), alive[:-1]])          # alive(k-1, t)
    starts = mask[0].sum()
    return {
        "correct": correct.sum(dim=1),
        "total": mask.sum(dim=1),
        "cond_correct": alive.sum(dim=1),
        "cond_total": (mask.to(torch.int64) * before).sum(dim=1),
        "accept_len_sum": alive.sum() + starts,
        "chain_starts": starts,
    }


def add_counts(a: dict[str, Tensor] | None, b: dict[str, Tensor]) -> dict[str, Tensor]:
    """Element-wise sum of two count dicts with the same keys (a may be None: the first batch)."""
    return dict(b) if a is None else {key: a[key] + b[key] for key in b}


def finalize(counts: dict[str, Tensor]) -> dict[str, float]:
    """Turn (summed) counts into float64 metrics: acc_k, cond_acc_k, acc, accept_len(_independent).

    A ratio with a zero denominator is NaN (nothing was counted), never 0.
    """
    c = {k: counts[k].detach().to("cpu", torch.float64) for k in COUNT_KEYS}

    def ratio(num: Tensor, den: Tensor) -> Tensor:
        return torch.where(den > 0, num / den.clamp_min(1), torch.full_like(num, float("nan")))

    acc, cond = ratio(c["correct"], c["total"]), ratio(c["cond_correct"], c["cond_total"])
    out: dict[str, float] = {}
    for k in range(acc.shape[0]):
        out[f"acc_{k}"] = float(acc[k])
        out[f"cond_acc_{k}"] = float(cond[k])
    out["acc"] = float(ratio(c["correct"].sum(), c["total"].sum()))
    out["accept_len"] = float(ratio(c["accept_len_sum"], c["chain_starts"]))
    out["accept_len_independent"] = float(1.0 + torch.cumprod(acc, dim=0).sum())
    return out
