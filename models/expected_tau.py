"""Acceptance length under speculative SAMPLING at temperature T, computed offline from stored
text that the target sampled at T.

The rejection rule of `train.evaluate.sampling` proposes draft x for the next token and accepts
it with probability min(1, p(x)/q(x)); on rejection it samples the residual ∝ max(p − q, 0).
The emitted token y is then distributed as p, the target at T, and

    P(draft accepted, y emitted) = min(p(y), q(y)),   so   β(y) = min(1, q(y)/p(y))

is the probability that the draft was accepted GIVEN the emitted token. With argmax drafts
(what vLLM and SGLang serve by default; q one-hot on d = argmax z) β(y) = 1[y = d]: a draft is
accepted exactly when the target's sample equals it. Real decoding at T is therefore the
target sampling a text token by token while each round's chain is scored against that text:

    β_k(t) = min(1, q_k(s)/p_k(s))      draft "sample": q_k = softmax(z_k / T)
    β_k(t) = 1[s = argmax z_k]          draft "argmax"

for the drafter's row (k, t) and the stored token s it predicts (token t+2+k), z_k the
drafter's logits over the draft vocabulary (q is 0 outside it) and p_k the target at T from
the stored last hidden state times the target's lm_head, or from the stored top-k logits
renormalised over those k ids (the top-k teacher over-states p of its ids and bounds a token
outside them by the k-th probability: both can only lower β). The drafter's later steps are
fed the stored tokens, which are exactly the tokens an accepted chain holds. So on a text the
target sampled at T the walk below is an unbiased estimate of served τ at T; for argmax drafts
it is exactly what real decoding of that text counts (`tests/train/evaluate/test_agreement.py`).
On greedy answers (or human text) it is not: the answers must be sampled at the temperature
being predicted (`eyas prepare --generate --temperature T`, or `eyas generate` against a
server); several answers per prompt lower the text's sampling noise.

A chain accepts draft k only if 0..k were all accepted, so with alive(k, t) = Π_{j≤k} β_j(t)
the expected number of accepted drafts from start t is Σ_k alive(k, t). β is 0 where a row
does not count (document end, a non-assistant token) and where no stored token follows.

`tau_trajectory` is the expected DECODER WALK, the figure that predicts serving (as the greedy
`tau_trajectory` of `models.metrics` does): on each assistant span the walk starts after the
span's first token and, from position t, accepts n drafts with probability
P(n ≥ j) = alive(j-1, t) and jumps to t + n + 1. Expected rounds R(t) = 1 + Σ_n P_t(n) R(t+n+1)
and accepted drafts A(t) = Σ_n P_t(n) (n + A(t+n+1)) are summed backwards over the span
(`expected_walk`); tau_trajectory = 1 + Σ A / Σ R over spans, the engines' acceptance length
(1 + accepted drafts per verification round), and `tau_trajectory_se` its standard error over
spans (`ratio_se`: the text's sampling noise, comparable to real decoding's `tau_se_prompts`).
`tau` averages over EVERY start instead and reads high where acceptance varies along the text,
exactly as the greedy `tau` does; `tau_se` is its standard error over chain starts.
Counts are float64 sums that add over batches and ranks (`add_expected`), summarised once.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

#: float64 sums of `expected_counts` (per step k: alive, before; scalars: starts, Σ L, Σ L²,
#: the expected walk's rounds and accepted drafts, and its per-span moments)
EXPECTED_KEYS = ("alive", "before", "starts", "length_sum", "length_sq_sum", "walk_rounds",
                 "walk_accepted", "walk_spans", "walk_rounds_sq", "walk_accepted_sq",
                 "walk_cross")


def _temp_softmax(logits: Tensor, temperature: float) -> Tensor:
    if temperature <= 0:
        raise ValueError(f"the expected τ under sampling needs a temperature > 0, got "
                         f"{temperature} (T = 0 is the exact greedy evaluation)")
    return torch.softmax(logits.float() / temperature, dim=-1)


def _beta(draft_logits: Tensor, p_token: Tensor, token_draft_id: Tensor, *, temperature: float,
          draft: str) -> Tensor:
    """β [N] float64 from p(s) [N] and the draft id of s [N] (−1 outside the draft vocabulary)."""
    inside = token_draft_id >= 0
    if draft == "argmax":
        return (inside & (draft_logits.argmax(-1) == token_draft_id)).double()
    q = _temp_softmax(draft_logits, temperature).gather(1, token_draft_id.clamp_min(0)[:, None])
    q = q[:, 0].double() * inside
    p = p_token.double()
    return torch.where(p > 0, torch.clamp(q / p.clamp_min(1e-300), max=1.0), (q > 0).double())


def step_acceptance(draft_logits: Tensor, target_logits: Tensor, to_draft: Tensor,
                    token: Tensor, *, temperature: float, draft: str) -> Tensor:
    """β [N] float64 with the full target distribution.

    draft_logits [N, Vd] (draft vocabulary), target_logits [N, V], to_draft [V] int64 (draft id
    of each target id, −1 outside the draft vocabulary), token [N] int64: the stored token.
    """
    p = _temp_softmax(target_logits, temperature).gather(1, token[:, None])[:, 0]
    return _beta(draft_logits, p, to_draft[token], temperature=temperature, draft=draft)


def topk_step_acceptance(draft_logits: Tensor, topk_ids: Tensor, topk_logits: Tensor,
                         to_draft: Tensor, token: Tensor, *, temperature: float,
                         draft: str) -> Tensor:
    """β [N] float64 with the top-k teacher (renormalised over its k ids; a token outside them
    gets the k-th probability, an upper bound of its own).

    topk_ids / topk_logits [N, k]; to_draft [V] int64; token [N] int64.
    """
    p = _temp_softmax(topk_logits, temperature)                          # [N, k]
    hit = topk_ids == token[:, None]
    p_token = torch.where(hit.any(-1), (p * hit).sum(-1), p.min(-1).values)
    return _beta(draft_logits, p_token, to_draft[token], temperature=temperature, draft=draft)


def expected_walk(alive: Tensor, mask0: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(expected rounds [S], expected accepted drafts [S]) of the decoder walk (module docstring),
    one entry per span of one batch. alive [K, T] float64, mask0 [T] bool (the chain starts;
    each maximal run [a, b] is one span). Runs on the host: for evaluation only."""
    K = alive.shape[0]
    surv = alive.detach().to("cpu", torch.float64).numpy()                # [K, T]
    m = mask0.detach().cpu().numpy().astype(np.int8)
    edges = np.diff(np.concatenate([[0], m, [0]]))
    rounds, accepted = [], []
    n = np.arange(K + 1)
    for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1):
        span = b - a                                        # the walk runs while t < span
        if span <= 0:
            continue
        R, A = np.zeros(span + K + 2), np.zeros(span + K + 2)
        for t in range(span - 1, -1, -1):
            S = np.concatenate([[1.0], surv[:, a + t], [0.0]])            # P(n >= j), j = 0..K+1
            P = S[:-1] - S[1:]                                            # P(n), n = 0..K
            R[t] = 1.0 + float((P * R[t + n + 1]).sum())
            A[t] = float((P * (n + A[t + n + 1])).sum())
        rounds.append(R[0])
        accepted.append(A[0])
    return np.asarray(rounds, dtype=np.float64), np.asarray(accepted, dtype=np.float64)


def expected_counts(alpha: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sums of one batch: alpha [K, T] acceptance probabilities, mask [K, T] bool (rows that
    count; `models.objective.metric_mask`). Chain starts are the rows with mask[0]."""
    a = alpha.double() * mask
    alive = torch.cumprod(a, dim=0)                                      # [K, T]
    before = torch.cat([torch.ones_like(alive[:1]), alive[:-1]]) * mask
    starts = mask[0]
    length = alive.sum(0)[starts]                                        # [S] expected L(t)
    R, A = expected_walk(alive, starts)
    f64 = dict(dtype=torch.float64, device=alpha.device)
    walk = {"walk_rounds": R.sum(), "walk_accepted": A.sum(), "walk_spans": float(len(R)),
            "walk_rounds_sq": (R * R).sum(), "walk_accepted_sq": (A * A).sum(),
            "walk_cross": (A * R).sum()}
    return {"alive": alive[:, starts].sum(1), "before": before[:, starts].sum(1),
            "starts": starts.sum().double(), "length_sum": length.sum(),
            "length_sq_sum": (length * length).sum(),
            **{key: torch.tensor(float(v), **f64) for key, v in walk.items()}}


def add_expected(acc: dict[str, Tensor] | None, new: dict[str, Tensor]) -> dict[str, Tensor]:
    return new if acc is None else {key: acc[key] + new[key] for key in EXPECTED_KEYS}


def ratio_se(n: float, sum_a: float, sum_r: float, sum_aa: float, sum_rr: float,
             sum_ar: float) -> float:
    """Standard error of ΣA / ΣR over n units (spans, prompts) from the sums of A, R, A², R² and
    A·R (the delta method: √(Σ (A_i − r R_i)² / (n (n−1))) / mean R); NaN below 2 units."""
    if n < 2 or sum_r <= 0:
        return float("nan")
    r = sum_a / sum_r
    resid = max(sum_aa - 2 * r * sum_ar + r * r * sum_rr, 0.0)
    return math.sqrt(resid / (n * (n - 1))) / (sum_r / n)


def ratio_se_of(units: list[tuple[float, float]]) -> float:
    """`ratio_se` of (A_i, R_i) pairs, e.g. (accepted drafts, rounds) of each decoded prompt."""
    a = np.asarray([u[0] for u in units], dtype=np.float64)
    r = np.asarray([u[1] for u in units], dtype=np.float64)
    return ratio_se(len(a), a.sum(), r.sum(), (a * a).sum(), (r * r).sum(), (a * r).sum())


def paired_ratio_se(ref: list[tuple[float, float]], other: list[tuple[float, float]]) -> float:
    """Standard error of τ_other / τ_ref, with τ = 1 + ΣA / ΣR, when both were measured on the
    same units: (A_i, R_i) of unit i in each list is the same prompt (two drafters decoding the
    same held-out prompts). The delta method over units on log(τ_other / τ_ref): what the
    prompts share (their difficulty) cancels, so the figure is far tighter than the two τ's
    errors combined. NaN below 2 units."""
    if len(ref) != len(other):
        raise ValueError(f"paired units: {len(ref)} against {len(other)}; both lists must hold "
                         f"the same prompts in the same order")
    n = len(ref)
    x = np.asarray(ref, dtype=np.float64).reshape(n, 2)
    y = np.asarray(other, dtype=np.float64).reshape(n, 2)
    if n < 2 or x[:, 1].sum() <= 0 or y[:, 1].sum() <= 0:
        return float("nan")

    def tau_and_influence(u: np.ndarray) -> tuple[float, np.ndarray]:
        q = u[:, 0].sum() / u[:, 1].sum()                      # accepted drafts per round
        return 1.0 + q, (u[:, 0] - q * u[:, 1]) / u[:, 1].mean()

    tx, ex = tau_and_influence(x)
    ty, ey = tau_and_influence(y)
    d = ey / ty - ex / tx
    return ty / tx * math.sqrt(float((d * d).sum()) / (n * (n - 1)))


def summarize_expected(counts: dict[str, Tensor]) -> dict:
    """tau, tau_se, tau_trajectory (the expected decoder walk) and tau_trajectory_se, tau_by_k
    (chains capped at K' = 1..K), cond_acc_{k} (expected P(draft k accepted | 0..k-1 accepted))
    and chain_starts of the summed counts."""
    n = float(counts["starts"])
    alive = counts["alive"].tolist()
    nan = float("nan")
    if n == 0:
        return {"tau": nan, "tau_se": nan, "tau_trajectory": nan, "tau_trajectory_se": nan,
                "tau_by_k": [nan] * len(alive), "chain_starts": 0,
                **{f"cond_acc_{k}": nan for k in range(len(alive))}}
    mean = float(counts["length_sum"]) / n
    var = (float(counts["length_sq_sum"]) - n * mean * mean) / (n - 1) if n > 1 else nan
    by_k, run = [], 0.0
    for a in alive:
        run += a
        by_k.append(1.0 + run / n)
    before = counts["before"].tolist()
    c = {key: float(counts[key]) for key in EXPECTED_KEYS[5:]}
    walk = c["walk_rounds"]
    return {"tau": 1.0 + mean, "tau_se": math.sqrt(max(var, 0.0) / n) if n > 1 else nan,
            "tau_trajectory": 1.0 + c["walk_accepted"] / walk if walk > 0 else nan,
            "tau_trajectory_se": ratio_se(c["walk_spans"], c["walk_accepted"], walk,
                                          c["walk_accepted_sq"], c["walk_rounds_sq"],
                                          c["walk_cross"]),
            "tau_by_k": by_k, "chain_starts": int(n),
            **{f"cond_acc_{k}": a / b if b > 0 else nan
               for k, (a, b) in enumerate(zip(alive, before))}}
