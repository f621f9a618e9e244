"""Deterministic packing plans: which samples go into which fixed-budget micro-batch, per rank.

A plan depends only on (sample lengths, token budget, seed, epoch, world size, options), so every
rank computes the same global plan independently and takes its own share; no communication.

Algorithm for one epoch:
1. order: the sample indices, permuted by `np.random.default_rng([seed, epoch])` if shuffling;
2. packing: consecutive windows of `window` samples (in that order) are packed best-fit-decreasing
   into bins of `budget` tokens (a sample longer than the budget counts as `budget`: it is
   truncated and fills a bin alone); bins keep their documents in insertion order;
3. with shuffling, the bins of the whole epoch are permuted again (same generator), so batch sizes
   and lengths mix across the epoch;
4. tail, so that every rank gets the same number of batches:
   - drop_last=True: the last `B % world_size` bins are dropped (their samples skip this epoch);
   - drop_last=False: bins holding the most documents are split in two (halves by token count)
     until `B` is a multiple of `world_size`, keeping coverage complete and disjoint; when no bin
     has two documents left, empty bins (all padding, num_tokens == 0) are appended;
5. rank r takes bins r, r + W, r + 2W, ….
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PlanStats:
    """Counts of one epoch's plan (global, not per rank)."""

    batches: int
    samples: int
    truncated: int        # samples longer than the budget (cut to it)
    dropped: int          # samples dropped by drop_last
    split_bins: int       # bins split to even out the tail
    empty_bins: int       # all-padding bins appended to even out the tail
    fill: float           # real tokens / (batches * budget)


def pack_window(idx: np.ndarray, lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Best-fit-decreasing packing of one window. lengths are already capped at `budget`."""
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    rems: list[int] = []       # sorted remaining capacities of open bins
    owners: list[int] = []     # bin id for each entry of rems
    for k in order:
        n = int(lengths[k])
        j = bisect.bisect_left(rems, n)       # the fullest bin that still fits
        if j < len(rems):
            b = owners.pop(j)
            rem = rems.pop(j) - n
        else:
            b = len(bins)
            bins.append([])
            rem = budget - n
        bins[b].append(int(idx[k]))
        if rem > 0:
            pos = bisect.bisect_left(rems, rem)
            rems.insert(pos, rem)
            owners.insert(pos, b)
    return bins


def _split(bin_: list[int], lengths: np.ndarray) -> tuple[list[int], list[int]]:
    """Split a bin into two non-empty parts with token counts as equal as possible."""
    total = int(lengths[bin_].sum())
    acc, cut = 0, 1
    for k in range(len(bin_) - 1):
        acc += int(lengths[bin_[k]])
        cut = k + 1
        if acc * 2 >= total:
            break
    return bin_[:cut], bin_[cut:]


def build_plan(sample_lengths: np.ndarray, indices: np.ndarray, budget: int, world_size: int,
               seed: int, epoch: int, *, shuffle: bool = True, drop_last: bool = False,
               window: int = 1024) -> tuple[list[list[int]], PlanStats]:
    """The global list of bins (lists of dataset indices) for one epoch, and its counts."""
    if budget <= 0:
        raise ValueError(f"token_budget must be positive, got {budget}")
    order = np.random.default_rng([seed, epoch]).permutation(indices) if shuffle else indices
    capped = np.minimum(sample_lengths[order], budget)
    truncated = int((sample_lengths[order] > budget).sum())
    bins: list[list[int]] = []
    for s in range(0, len(order), window):
        bins.extend(pack_window(order[s:s + window], capped[s:s + window], budget))
    if shuffle and bins:
        perm = np.random.default_rng([seed, epoch, 1]).permutation(len(bins))
        bins = [bins[p] for p in perm]

    cap = np.zeros(len(sample_lengths), dtype=np.int64)   # capped length by dataset index
    cap[order] = capped
    dropped = split = empty = 0
    rem = len(bins) % world_size
    if rem and drop_last:
        dropped = sum(len(b) for b in bins[len(bins) - rem:])
        bins = bins[:len(bins) - rem]
    elif rem:
        need = world_size - rem
        while need:
            k = max(range(len(bins)), key=lambda j: (len(bins[j]), -j), default=None)
            if k is None or len(bins[k]) < 2:
                bins.extend([] for _ in range(need))
                empty += need
                break
            bins[k], extra = _split(bins[k], cap)
            bins.append(extra)
            split += 1
            need -= 1
    real = int(sum(int(cap[b].sum()) for b in bins if b))
    stats = PlanStats(batches=len(bins), samples=sum(len(b) for b in bins), truncated=truncated,
                      dropped=dropped, split_bins=split, empty_bins=empty,
                      fill=real / max(1, len(bins) * budget))
    return bins, stats


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic held-out split of range(n): (train_idx, eval_idx), both sorted int64.

    eval size = round(n * eval_fraction), at least 1 when eval_fraction > 0 and n >= 2, and at
    most n - 1 (the train split is never empty). The same (n, fraction, seed) always gives the
    same split, independent of world size.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    k = int(round(n * eval_fraction))
    if eval_fraction > 0 and n >= 2:
        k = min(max(k, 1), n - 1)
    perm = np.random.default_rng([seed, 0x5EED]).permutation(n)
    return np.sort(perm[k:]).astype(np.int64), np.sort(perm[:k]).astype(np.int64)


def embedding_ids(input_ids: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """[T + K] input_ids followed by K padding ids (0): rows 1+k .. k+T are the tokens TTT step
    k is fed (`models.ttt.step_tokens(input_ids, k)`), so one embedding lookup of these serves
    all K steps as slices. The loader looks them up for a host embedding; the drafter itself
    otherwise."""
    return torch.cat([input_ids, input_ids.new_zeros(ttt_steps)])
