"""The teacher the loss reads and the expected acceptance α it implies, from stored states.

    α(k, t) = Σ_v min(p̂_v, q_v)      p̂: the target's distribution at index t+1+k over the draft
                                     vocabulary (renormalised there), q: the draft's at step k

is the chance that a draft sampled from q is accepted by the target's rejection sampling (at
temperature 1): 1 − TV(p̂, q). The trainer logs its mean per TTT step (`models.metrics`,
`alpha_k`) from its own loss; `batch_alpha` computes the same for an exported drafter on any
dataset that stores a teacher (`eyas evaluate --data`, `eyas doctor --data`).

With a top-k teacher (`kernels.teacher.teacher_from_topk`) p̂ is the stored top-k renormalised,
so α is within 1 − P of the full-vocabulary α either way (P: the target's probability mass on
the stored ids); Σ over the stored ids of min(p_v, q_v) with the true p_v would be a lower
bound, but the stored logits do not give P (tests/kernels/test_loss_objectives.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.kernels.loss import eagle3_loss, triton_available
from eyas.kernels.teacher import teacher_from_topk, teacher_probs
from eyas.models.metrics import alpha_counts


def teacher_rows(head_rows: Tensor, t2d_index: Tensor, last: Tensor | None,
                 topk_ids: Tensor | None, topk_logits: Tensor | None) -> Tensor:
    """[T, Vd] teacher aligned for the loss kernel: row t holds the target at index t+1 (the
    last row zero), from the stored post-norm last state or the stored top-k. head_rows [Vd, tH]:
    `head[drafter.target_ids]`; t2d_index [V]: `drafter.t2d_index` (`VocabMap.t2d_index`)."""
    if last is not None:
        p = teacher_probs(last.to(head_rows.dtype), head_rows)
    elif topk_ids is not None:
        p = teacher_from_topk(topk_ids, topk_logits, t2d_index, head_rows.shape[0])
    else:
        raise ValueError("the batch has no teacher: neither `last` nor `topk_ids` is present "
                         "(re-extract with --teacher last or --teacher topk)")
    # shift by one: the kernel reads row t+k for step k; row t+1+k is the target we want.
    return torch.cat([p[1:], p[-1:].zero_()], dim=0)


@torch.no_grad()
def batch_alpha(drafter, hidden: Tensor, mask: Tensor, batch, head_rows: Tensor
                ) -> dict[str, Tensor]:
    """`models.metrics.alpha_counts` of one batch: α of every counted row (mask [K, T], the
    metric mask) of the drafter's unrolled hidden states [K, T, H] against the batch's teacher."""
    teacher = teacher_rows(head_rows.to(hidden.dtype), drafter.t2d_index, batch.last,
                           batch.topk_ids, batch.topk_logits)
    w = mask.to(torch.float32)
    impl = "triton" if hidden.is_cuda and triton_available() else "torch"
    res = eagle3_loss(hidden.contiguous(), drafter.lm_head.weight.to(hidden.dtype),
                      teacher.to(hidden.dtype), w, impl=impl, with_accept=True)
    return alpha_counts(res.accept, w)
