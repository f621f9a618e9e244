"""Teacher distributions over the draft vocabulary, computed once per batch (never per step).

- ``teacher_probs``: exact, from the target's post-norm last hidden state and the rows of the
  target lm_head selected by t2d: p = softmax(last @ W_t2d.T), chunked over rows so the fp32
  logits never exceed one chunk [C, Vd].
- ``teacher_from_topk``: compact, from a stored top-k (ids, logits) of the target's full
  vocabulary: the ids inside the draft vocabulary are mapped to draft ids and renormalised.

Both return [N, Vd] rows that sum to 1 (or 0 when nothing of the top-k is in the draft vocab);
``kernels.eagle3_loss`` also accepts unnormalised rows.
"""

from __future__ import annotations

import torch

from eyas.kernels.loss import _mm_f32

_TEACHER_CHUNK_BYTES = 256 << 20      # fp32 logits of one chunk


@torch.no_grad()
def teacher_probs(last: torch.Tensor, target_head_rows: torch.Tensor, *,
                  chunk_size: int | None = None) -> torch.Tensor:
    """softmax(last @ target_head_rows.T) over the draft vocabulary, in fp32 math.

    Args:
        last: [N, tH] target hidden state after its final norm (bf16/fp16/fp32).
        target_head_rows: [Vd, tH] rows of the target lm_head for the draft ids (t2d order).
        chunk_size: rows per chunk (default: fp32 logits of ~256 MiB per chunk).

    Returns:
        [N, Vd] bf16 probabilities (no gradient).
    """
    if last.dim() != 2 or target_head_rows.dim() != 2:
        raise ValueError(f"last must be [N, tH] and target_head_rows [Vd, tH], got "
                         f"{tuple(last.shape)} and {tuple(target_head_rows.shape)}")
    if last.shape[1] != target_head_rows.shape[1]:
        raise ValueError(f"hidden sizes differ: last has tH={last.shape[1]}, target_head_rows "
                         f"has {target_head_rows.shape[1]}; pass the target's lm_head rows")
    if last.device != target_head_rows.device:
        raise ValueError(f"last on {last.device} but target_head_rows on "
                         f"{target_head_rows.device}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    N = last.shape[0]
    Vd = target_head_rows.shape[0]
    if last.dtype != target_head_rows.dtype:
        last = last.to(target_head_rows.dtype)
    C = chunk_size or max(1, _TEACHER_CHUNK_BYTES // (4 * Vd))
    C = min(C, max(N, 1))
    out = torch.empty(N, Vd, device=last.device, dtype=torch.bfloat16)
    z = torch.empty(C, Vd, device=last.device, dtype=torch.float32)
    wt = target_head_rows.t()                                        # [tH, Vd]
    for r0 in range(0, N, C):
        c = min(C, N - r0)
        _mm_f32(last[r0:r0 + c], wt, z[:c])                         # [c, Vd] fp32 logits
        out[r0:r0 + c] = torch.softmax(z[:c], dim=1)
    return out


@torch.no_grad()
def teacher_from_topk(topk_ids: torch.Tensor, topk_logits: torch.Tensor,
                      target_to_draft: torch.Tensor, Vd: int, *,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense [N, Vd] teacher from a stored top-k, renormalised over its in-vocab entries.

    Args:
        topk_ids: [N, k] int64 target-vocabulary ids (distinct per row).
        topk_logits: [N, k] float target logits of those ids.
        target_to_draft: [V] int64, draft id of each target id, −1 where not in the draft vocab.
        Vd: draft vocabulary size.
        dtype: output dtype (bf16 by default, like ``teacher_probs``).

    Returns:
        [N, Vd] probabilities: softmax over the row's in-vocab top-k logits scattered to their
        draft ids; a row with no in-vocab id is all zeros (it then adds no loss and no gradient).
    """
    if topk_ids.shape != topk_logits.shape or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids and topk_logits must both be [N, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_logits.shape)}")
    if target_to_draft.dim() != 1 or target_to_draft.dtype != torch.int64:
        raise ValueError(f"target_to_draft must be a [V] int64 tensor, got "
                         f"{tuple(target_to_draft.shape)} {target_to_draft.dtype}")
    if topk_ids.dtype != torch.int64:
        raise ValueError(f"topk_ids must be int64, got {topk_ids.dtype}")
    if Vd < 1:
        raise ValueError(f"Vd must be >= 1, got {Vd}")
    d_ids = target_to_draft.to(topk_ids.device)[topk_ids]          # [N, k], -1 = not in vocab
    valid = d_ids >= 0
    logits = torch.where(valid, topk_logits.float(), float("-inf"))
    m = logits.amax(dim=1, keepdim=True)                              # [N, 1]
    m = torch.where(torch.isfinite(m), m, 0.0)                        # rows with nothing valid
    e = torch.where(valid, torch.exp(logits - m), 0.0)
    s = e.sum(dim=1, keepdim=True)
    p = torch.where(s > 0, e / s.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    out = torch.zeros(topk_ids.shape[0], Vd, device=topk_ids.device, dtype=torch.float32)
    out.scatter_add_(1, d_ids.clamp_min(0), p)                        # invalid entries add 0
    return out.to(dtype)
