"""τ by context length: acceptance counted per bucket of the position where a round starts.

A bucket is the POSITION in the sequence at which a round starts: the chain start t, the
row whose aux state and next token x_{t+1} the first draft reads (`models.metrics`). Real
decoding verifies the last committed token at position L and drafts from row L - 1, so its
round is bucketed by L - 1: the same round lands in the same bucket offline and real. Edges
e_0 = 0 < e_1 < ... < e_{B-1} make B buckets [e_i, e_{i+1}), the last one open: the default
edges 0, 2048, 8192, 16384, 32768 give "0-2k", "2k-8k", "8k-16k", "16k-32k" and "32k+".

Offline counts (`context_counts`) are exact int64 tensors made on the device without host
syncs, summable across micro-batches and ranks like the other counts:
    ctx_starts[b]          chain starts in bucket b
    ctx_tau_sum[b]         Σ_starts (L(t) + 1): the all-starts τ numerator of bucket b
    ctx_cond_correct[b, k] Σ_t alive(k, t),  ctx_cond_total[b, k] Σ_t mask(k, t)·alive(k-1, t)

Each bucket of a result (`context_table`, `rounds_table`) is a `by_context` entry as
docs/acceptance.md ("τ by context length") shows it. Offline: tau = the all-starts τ of the
chains starting there, rounds = tokens = its chain starts (assistant positions scored); real:
tau = 1 + accepted drafts / rounds of the rounds starting there (the engines' acceptance
length), tokens = the tokens those rounds emitted.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: default bucket edges (`eval.context_buckets`, `eyas evaluate --context-buckets`)
DEFAULT_EDGES = (0, 2048, 8192, 16384, 32768)
#: counts of `context_counts`
CONTEXT_KEYS = ("ctx_starts", "ctx_tau_sum", "ctx_cond_correct", "ctx_cond_total")


def check_edges(edges) -> tuple[int, ...]:
    """The edges as a tuple of ints; ValueError unless they are integers 0 = e_0 < e_1 < ..."""
    try:
        out = tuple(int(e) for e in edges)
    except (TypeError, ValueError):
        raise ValueError(f"context bucket edges {edges!r}: expected integers such as "
                         f"0,2048,8192,16384,32768") from None
    if not out or out[0] != 0 or any(b <= a for a, b in zip(out, out[1:])) \
            or any(float(e) != int(e) for e in edges):
        raise ValueError(f"context bucket edges {list(edges)}: expected increasing integer "
                         f"positions starting at 0, such as 0,2048,8192,16384,32768")
    return out


def parse_edges(text: str) -> tuple[int, ...]:
    """`--context-buckets 0,2048,8192` → (0, 2048, 8192) (ValueError naming the text)."""
    try:
        return check_edges([int(x) for x in text.split(",")])
    except ValueError:
        raise ValueError(f"--context-buckets {text!r}: expected comma-separated increasing "
                         f"integer positions starting at 0, such as 0,2048,8192,16384,32768"
                         ) from None


def _short(n: int) -> str:
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


def bucket_names(edges) -> list[str]:
    """"0-2k", "2k-8k", ..., "32k+" (multiples of 1024 as k, other edges as written)."""
    e = check_edges(edges)
    return [f"{_short(lo)}-{_short(hi)}" for lo, hi in zip(e, e[1:])] + [f"{_short(e[-1])}+"]


def context_counts(alive: Tensor, mask: Tensor, positions: Tensor, edges) -> dict[str, Tensor]:
    """Per-bucket counts (module docstring) of one batch, on its device, without a host sync.

    alive [K, T] int64 (`models.metrics.chain_alive`), mask [K, T] bool (the metric mask),
    positions [T] int64: each row's position inside its document (`Batch.positions`).
    """
    e = check_edges(edges)
    K, T = alive.shape
    b = torch.zeros_like(positions)                                     # [T] bucket 0..B-1
    for edge in e[1:]:            # comparisons with Python ints: no host-to-device copy
        b += positions >= edge
    mask = mask.to(torch.int64)
    before = torch.cat([torch.ones_like(alive[:1]), alive[:-1]])        # alive(k-1, t)
    z = torch.zeros(len(e), K, dtype=torch.int64, device=alive.device)
    return {
        "ctx_starts": z[:, 0].clone().index_add_(0, b, mask[0]),
        "ctx_tau_sum": z[:, 0].clone().index_add_(0, b, alive.sum(0) + mask[0]),
        "ctx_cond_correct": z.clone().index_add_(0, b, alive.T.contiguous()),
        "ctx_cond_total": z.clone().index_add_(0, b, (mask * before).T.contiguous()),
    }


def zero_context_counts(k: int, edges, device=None) -> dict[str, Tensor]:
    """`context_counts` of no rows."""
    n = len(check_edges(edges))
    z = torch.zeros(n, k, dtype=torch.int64, device=device)
    return {"ctx_starts": z[:, 0].clone(), "ctx_tau_sum": z[:, 0].clone(),
            "ctx_cond_correct": z.clone(), "ctx_cond_total": z.clone()}


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _bucket(name: str, lo: int, hi: int | None, tau: float, cond: list[float], tokens: int,
            rounds: int) -> dict:
    return {"bucket": name, "lo": lo, "hi": hi, "tau": tau, "cond_acc": cond,
            "tokens": int(tokens), "rounds": int(rounds)}


def context_table(counts: dict[str, Tensor], edges) -> list[dict]:
    """The `by_context` list of (summed) offline counts; NaN where a bucket holds no start."""
    e = check_edges(edges)
    c = {k: counts[k].detach().cpu().tolist() for k in CONTEXT_KEYS}
    his = list(e[1:]) + [None]
    return [_bucket(name, lo, hi, ratio(c["ctx_tau_sum"][i], c["ctx_starts"][i]),
                    [ratio(a, b) for a, b in zip(c["ctx_cond_correct"][i],
                                                  c["ctx_cond_total"][i])],
                    c["ctx_starts"][i], c["ctx_starts"][i])
            for i, (name, lo, hi) in enumerate(zip(bucket_names(e), e, his))]


def rounds_table(rounds: list[tuple[int, int, int]], k: int, edges) -> list[dict]:
    """The `by_context` list of real decoding rounds [(verified position L, accepted drafts n,
    emitted tokens)], each bucketed by its chain start L - 1: a round reached draft j iff
    n >= j and accepted it iff n > j."""
    e = check_edges(edges)
    bounds = torch.tensor(e[1:], dtype=torch.int64)
    n_b = len(e)
    cnt, acc, emitted = [0] * n_b, [0] * n_b, [0] * n_b
    reached, accepted = [[0] * k for _ in e], [[0] * k for _ in e]
    for pos, n, out in rounds:
        i = int(torch.bucketize(torch.tensor(pos - 1), bounds, right=True))
        cnt[i] += 1
        acc[i] += n
        emitted[i] += out
        for j in range(min(n + 1, k)):
            reached[i][j] += 1
            accepted[i][j] += j < n
    his = list(e[1:]) + [None]
    return [_bucket(name, lo, hi, 1 + acc[i] / cnt[i] if cnt[i] else float("nan"),
                    [ratio(a, r) for a, r in zip(accepted[i], reached[i])], emitted[i], cnt[i])
            for i, (name, lo, hi) in enumerate(zip(bucket_names(e), e, his))]


def context_scalars(table: list[dict]) -> dict[str, float]:
    """`tau_ctx_<bucket>` per bucket (the trainer's `eval/tau_ctx_0-2k`, ...)."""
    return {f"tau_ctx_{b['bucket']}": b["tau"] for b in table}


def format_context(table: list[dict]) -> list[str]:
    """Lines of the stdout table: bucket, τ, per-position acceptance, tokens, rounds."""
    k = len(table[0]["cond_acc"]) if table else 0
    head = f"  {'context':>9} {'tau':>7} " + " ".join(f"{'ca_' + str(j):>6}" for j in range(k))
    lines = [head + f" {'tokens':>8} {'rounds':>7}"]
    for b in table:
        vals = " ".join(_fmt(x, 6) for x in b["cond_acc"])
        lines.append(f"  {b['bucket']:>9} {_fmt(b['tau'], 7)} {vals} {b['tokens']:>8} "
                     f"{b['rounds']:>7}")
    return lines


def _fmt(x, width: int) -> str:
    ok = x is not None and x == x and abs(x) != float("inf")
    return f"{x:>{width}.3f}" if ok else f"{'n/a':>{width}}"
