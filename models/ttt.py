"""Alignment of the training-time-test (TTT) unroll over a packed batch.

A packed batch holds several documents back to back in one row of T tokens (`doc_ids` 0, 1, 2, …,
-1 for padding; `positions` restart at 0 in each document). Drafter row t at TTT step k
(0-based) reproduces draft step k of a serving chain that starts after token t:

    step 0 input:   hidden = fc(aux[t])          token = input_ids[t+1]     position = positions[t]
    step k input:   hidden = prenorm[k-1, t]     token = input_ids[t+1+k]   position = positions[t]+k
    step k target:  the token at t+2+k, i.e. the teacher (target distribution) at index t+1+k

    index:  0  1  2  3  4  5  6  7
    ids:    x0 x1 x2 x3 x4 y0 y1 y2      doc_ids: 0 0 0 0 0 1 1 1
    row t=1, k=0: aux[1] + embed(x2) at position 1  → teacher index 2 (target's distribution after x2)
    row t=1, k=2: p[1,1] + embed(x4) at position 3  → teacher index 4 (still document 0: valid)
    row t=1, k=3: token index 5 is y0, another document  → invalid (zero weight, never counted)

Row (k, t) is structurally valid iff t+1+k < T and doc_ids[t+1+k] == doc_ids[t] != -1.
"""

from __future__ import annotations

import torch


def structural_valid(doc_ids: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """[K, T] bool: row t at step k has its input token t+1+k inside its own (non-padding) document."""
    T = doc_ids.shape[0]
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    valid = torch.zeros(ttt_steps, T, dtype=torch.bool, device=doc_ids.device)
    for k in range(ttt_steps):
        n = T - 1 - k                                                    # rows with t+1+k < T
        if n <= 0:
            break
        valid[k, :n] = (doc_ids[1 + k:] == doc_ids[:n]) & (doc_ids[:n] >= 0)
    return valid


def shift_left(x: torch.Tensor, by: int, fill: int | float | bool = 0) -> torch.Tensor:
    """y[t] = x[t+by] along dim 0, `fill` where t+by >= T (same shape and dtype as x)."""
    if by == 0:
        return x
    out = torch.full_like(x, fill)
    if by < x.shape[0]:
        out[: x.shape[0] - by] = x[by:]
    return out


def step_tokens(input_ids: torch.Tensor, step: int) -> torch.Tensor:
    """[T] token ids fed at TTT step `step`: input_ids[t+1+step] (0 past the end; such rows are invalid)."""
    return shift_left(input_ids, 1 + step, 0)


def step_positions(positions: torch.Tensor, step: int) -> torch.Tensor:
    """[T] RoPE positions at TTT step `step`: positions[t] + step."""
    return positions + step


def shifted_for_steps(x: torch.Tensor, ttt_steps: int, fill: int | float | bool = 0) -> torch.Tensor:
    """[K, T, ...]: row (k, t) = x[t+1+k] (the per-token quantity a drafter row is scored against)."""
    return torch.stack([shift_left(x, 1 + k, fill) for k in range(ttt_steps)])
