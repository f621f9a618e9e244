"""Draft accuracy and acceptance-length metrics of the TTT unroll, as exact integer counts.

Counts are int64 tensors computed on the device without host syncs; sum them over micro-batches
and ranks (all-reduce SUM), then `summarize` once when logging.

Definitions (used by the trainer and by `train.evaluate.offline`). Row (k, t) COUNTS iff mask(k, t) =
valid(k, t) · loss_mask[t+1+k] (`models.objective.metric_mask`; no position mask: a target argmax
outside the draft vocabulary is a miss, never dropped). It is CORRECT iff it counts and the draft
argmax mapped to a target id equals the target's argmax at index t+1+k:
    correct(k, t) = mask(k, t) · [draft_argmax[k, t] + d2t[draft_argmax[k, t]] == target_argmax[t+1+k]]

    acc_k       = Σ_t correct(k, t) / Σ_t mask(k, t)
    cond_acc_k  = Σ_t alive(k, t) / Σ_t mask(k, t)·alive(k-1, t)     alive(k, t) = Π_{j≤k} correct(j, t)
                  (alive(-1, t) = 1): the per-position acceptance of a greedy chain
    CHAIN STARTS are the rows with mask(0, t) — every assistant position a chain could start after.
    A chain starting at t accepts L(t) = Σ_k alive(k, t) ∈ [0, K] drafts (consecutive correct
    steps from step 0; it stops at the first miss, document end, or non-assistant token), plus
    the bonus token the target always contributes:
    tau         = Σ_starts (L(t) + 1) / #starts                         (exact greedy-chain τ)
    tau_independent = 1 + Σ_k Π_{j≤k} acc_j            (SpecForge's estimate Σ_k Π_{j≤k} acc_j,
                  which treats steps as independent, plus the same bonus token for comparability)
    tau_trajectory  = 1 + accepted drafts / rounds of a greedy decoder walking each assistant
                  span (`trajectory_counts`: start after the span's first token, accept
                  L = min(L(t), K') drafts, jump past them and the bonus, stop once the span's
                  last token is committed), counted the way vLLM and SGLang count their mean
                  acceptance length (`train.evaluate.specdec`): a round's accepted drafts are
                  all counted, also where they run past the span's end (the stored argmax of
                  the span's last token verifies one draft beyond it). On target-generated text
                  this is the τ real greedy decoding reports; `tau` averages over EVERY start
                  instead (including each span's last token, where a decoder has stopped), and
                  the two agree when acceptance is uniform along the text.
    tau_trajectory_capped = the walk within each span's first `walk_cap` tokens, the text real
                  decoding with max_new_tokens = walk_cap writes (the trainer's eval caps at
                  eval.max_new_tokens): later parts of long answers, often easier to draft,
                  drop out, so it compares with a real τ measured at that length.
    alpha_k     = Σ_t α(k, t) / #rows: the mean EXPECTED ACCEPTANCE of step k, α(k, t) =
                  Σ_v min(p̂_v, q_v) over the draft vocabulary (the chance a sampled draft is
                  accepted, `kernels.eagle3_loss`), on the rows the loss weighs (the position
                  mask drops rows whose target argmax is outside the draft vocabulary)
    tau_alpha   = 1 + Σ_k Π_{j≤k} alpha_j: the τ those rates imply for chains of independent
                  steps (`alpha_counts`; sampling acceptance, where `tau` is greedy's)
    *_by_k[K']  = the same for a chain capped at K' = 1..K drafts (`tau_curves`).

Key names, the same in logs, JSON, wandb and the README: `tau`, `tau_independent`,
`tau_trajectory`, `tau_trajectory_capped`, `acc_overall`, `acc_{k}`, `cond_acc_{k}` (k = 0..K-1,
the TTT step), the curves `tau_by_k`, `tau_independent_by_k`, `tau_trajectory_by_k`,
`tau_trajectory_capped_by_k`, `alpha_{k}`, `tau_alpha`, `tau_alpha_by_k`, and per context bucket
`by_context` / `tau_ctx_<bucket>` (`models.context`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from eyas.models.context import context_counts, ratio, zero_context_counts
from eyas.models.ttt import shifted_for_steps

#: counts of `accept_counts`
COUNT_KEYS = ("correct", "total", "cond_correct", "cond_total", "tau_sum", "chain_starts")
#: counts of `trajectory_counts` (per K' = 1..K); `chain_counts` returns both sets
TRAJECTORY_KEYS = ("traj_rounds", "traj_accepted")
#: the same within each span's first `walk_cap` tokens (`trajectory_counts` with a cap)
CAPPED_KEYS = ("traj_cap_rounds", "traj_cap_accepted")
#: counts of `alpha_counts` (per step k)
ALPHA_KEYS = ("alpha_sum", "alpha_rows")
#: `alpha_sum` counts α in units of 2⁻²⁴, so that it is an int64 that sums exactly across
#: micro-batches and ranks with the other counts (one α rounds by at most 2⁻²⁵)
ALPHA_UNIT = 2 ** 24


def alpha_counts(accept: Tensor, weight: Tensor) -> dict[str, Tensor]:
    """{alpha_sum, alpha_rows} [K] int64 of one batch: α per row (accept [K, T], e.g.
    LossOutput.accept) summed per step over the rows with a nonzero loss weight [K, T]."""
    rows = weight != 0
    units = torch.round(accept.detach().double() * ALPHA_UNIT).to(torch.int64)
    return {"alpha_sum": (units * rows).sum(1), "alpha_rows": rows.sum(1)}


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
    and tau_sum/chain_starts [] (all int64, summable across ranks).
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
        "tau_sum": alive.sum() + starts,
        "chain_starts": starts,
    }


def alpha_rates(counts: dict[str, Tensor]) -> list[float]:
    """α_k of summed `alpha_counts` (NaN where no row counted)."""
    total, rows = counts["alpha_sum"].tolist(), counts["alpha_rows"].tolist()
    return [ratio(float(a) / ALPHA_UNIT, float(n)) for a, n in zip(total, rows)]


def alpha_chain(rates: list[float]) -> list[float]:
    """1 + Σ_{k<K'} Π_{j≤k} α_j for K' = 1..K: the τ of chains of independent steps."""
    out, prod, run = [], 1.0, 1.0
    for a in rates:
        prod *= a
        run += prod
        out.append(run)
    return out


def add_counts(a: dict[str, Tensor] | None, b: dict[str, Tensor]) -> dict[str, Tensor]:
    """Element-wise sum of two count dicts with the same keys (a may be None: the first batch)."""
    return dict(b) if a is None else {key: a[key] + b[key] for key in b}


def trajectory_counts(alive: Tensor, mask0: Tensor, cap: int | None = None
                      ) -> dict[str, Tensor]:
    """Decoder-walk counts for every K' = 1..K: {traj_rounds, traj_accepted} [K] int64, and with
    `cap` also {traj_cap_rounds, traj_cap_accepted}: the same walk stopped once the span's first
    `cap` tokens are committed (what real decoding with max_new_tokens = cap writes; the last
    round's accepted drafts count in full, as the engines count them).

    alive [K, T] 0/1 (step k and all before it correct), mask0 [T] bool = mask(0, ·) (row t is a
    chain start). Each maximal run [a, b] of starts is one assistant span (tokens a+1..b+1); the
    walk starts at t = a and, while t < b, accepts L = min(L(t), K') drafts and moves to t+L+1.
    Runs on the host (a sync): for evaluation, not for the training step.
    """
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1 token, got {cap}")
    K = alive.shape[0]
    lengths = alive.sum(0).cpu().numpy()                                  # [T] L_K(t)
    m = mask0.cpu().numpy().astype(np.int8)
    edges = np.diff(np.concatenate([[0], m, [0]]))
    runs = zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1)   # [a, b] inclusive
    counts = [[0] * K for _ in range(4)]   # rounds, accepted; the same within the cap
    for a, b in runs:
        seg, n = lengths[a:b + 1].tolist(), int(b - a)
        within = n if cap is None else min(n, cap - 1)   # rounds at t < within are in the cap
        for kk in range(K):
            t = rounds = accepted = rounds_in = accepted_in = 0
            while t < n:
                acc = min(seg[t], kk + 1)
                rounds, accepted = rounds + 1, accepted + acc
                if t < within:
                    rounds_in, accepted_in = rounds_in + 1, accepted_in + acc
                t += acc + 1
            for row, x in enumerate((rounds, accepted, rounds_in, accepted_in)):
                counts[row][kk] += x
    keys = TRAJECTORY_KEYS + (CAPPED_KEYS if cap is not None else ())
    return {key: torch.tensor(row, dtype=torch.int64, device=alive.device)
            for key, row in zip(keys, counts)}


def chain_counts(draft_argmax: Tensor, d2t: Tensor, target_argmax: Tensor, mask: Tensor,
                 positions: Tensor | None = None, edges=None, walk_cap: int | None = None
                 ) -> dict[str, Tensor]:
    """`accept_counts` plus the trajectory counts (`trajectory_counts`, within the first
    `walk_cap` tokens of each span too when given): the eval counts; with positions [T] (each
    row's position in its document) and bucket edges, also the per-bucket counts of
    `models.context.context_counts`.

    draft_argmax [K, T] draft-vocab ids, d2t [Vd] offsets, target_argmax [T], mask [K, T] bool.
    """
    chain = chain_alive(draft_argmax, d2t, target_argmax, mask)
    counts = accept_counts(draft_argmax, d2t, target_argmax, mask, chain=chain)
    counts.update(trajectory_counts(chain[1], mask[0].bool(), walk_cap))
    if positions is not None and edges is not None:
        counts.update(context_counts(chain[1], mask.bool(), positions, edges))
    return counts


def zero_counts(k: int, device=None, edges=None, walk_cap: int | None = None,
                alpha: bool = False) -> dict[str, Tensor]:
    """`chain_counts` (and with `alpha`, `alpha_counts`) of no rows (a rank without a batch
    still joins the collective)."""
    z = torch.zeros(k, dtype=torch.int64, device=device)
    scalar = ("tau_sum", "chain_starts")
    keys = (COUNT_KEYS + TRAJECTORY_KEYS + (CAPPED_KEYS if walk_cap is not None else ())
            + (ALPHA_KEYS if alpha else ()))
    out = {key: (z[0].clone() if key in scalar else z.clone()) for key in keys}
    if edges is not None:
        out.update(zero_context_counts(k, edges, device))
    return out


def tau_curves(counts: dict[str, Tensor]) -> dict[str, list[float]]:
    """τ of chains capped at K' = 1..K: `tau_by_k`, `tau_independent_by_k` and, with trajectory
    counts, `tau_trajectory_by_k` (float64; a zero denominator gives NaN)."""
    c = {k: v.detach().to("cpu", torch.float64) for k, v in counts.items()}
    K = c["correct"].shape[0]
    starts = float(c["chain_starts"])
    alive_cum = torch.cumsum(c["cond_correct"], 0)                        # Σ_{k<K'} alive_k
    out = {"tau_by_k": [ratio(starts + float(alive_cum[k]), starts) for k in range(K)]}
    out["tau_independent_by_k"] = alpha_chain(                           # NaN stays NaN
        [ratio(float(c["correct"][k]), float(c["total"][k])) for k in range(K)])
    if "alpha_sum" in c:
        out["tau_alpha_by_k"] = alpha_chain(alpha_rates(c))
    for name, (rounds, accepted) in (("tau_trajectory_by_k", TRAJECTORY_KEYS),
                                     ("tau_trajectory_capped_by_k", CAPPED_KEYS)):
        if rounds in c:
            out[name] = [1.0 + ratio(float(c[accepted][k]), float(c[rounds][k]))
                         for k in range(K)]
    return out


def summarize(counts: dict[str, Tensor]) -> dict[str, float]:
    """The metrics of (summed) counts (module docstring): acc_{k}, cond_acc_{k}, acc_overall,
    tau, tau_independent and, with trajectory counts, tau_trajectory. float64 values; a ratio
    with a zero denominator is NaN (nothing was counted), never 0."""
    c = {k: v.detach().to("cpu", torch.float64) for k, v in counts.items()}
    out: dict[str, float] = {}
    for k in range(c["correct"].shape[0]):
        out[f"acc_{k}"] = ratio(float(c["correct"][k]), float(c["total"][k]))
        out[f"cond_acc_{k}"] = ratio(float(c["cond_correct"][k]), float(c["cond_total"][k]))
    out["acc_overall"] = ratio(float(c["correct"].sum()), float(c["total"].sum()))
    out["tau"] = ratio(float(c["tau_sum"]), float(c["chain_starts"]))
    curves = tau_curves(counts)
    out["tau_independent"] = curves["tau_independent_by_k"][-1]
    if "alpha_sum" in c:
        out.update({f"alpha_{k}": a for k, a in enumerate(alpha_rates(c))})
        out["tau_alpha"] = curves["tau_alpha_by_k"][-1]
    for name in ("tau_trajectory", "tau_trajectory_capped"):
        if f"{name}_by_k" in curves:
            out[name] = curves[f"{name}_by_k"][-1]
    return out
