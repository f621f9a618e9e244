"""Loss weighting of the TTT unroll.

The fused loss (`kernels.eagle3_loss`) takes one fp32 weight per (step k, row t); everything
about masking, step decay and normalisation lives in that [K, T] tensor:

    mask(k, t)   = valid(k, t) · loss_mask[t+1+k] · t2d[target_argmax[t+1+k]]   (last factor: position_mask)
    weight(k, t) = step_weight^k · mask(k, t) / norm_k
    norm_k       = Σ_t mask(k, t)   "valid":     masked mean over valid rows per step (default;
                                                 speculators/ModelOpt) — the effective learning
                                                 rate does not move with the masked fraction
                 = T                "specforge": every row of the batch counts (EAGLE/SpecForge)

so that Σ_{k,t} weight(k, t) · CE(k, t) is the training loss. Both norms are per rank: with
data parallelism the gradient is the mean of the per-rank losses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.kernels.loss import Objective
from eyas.models.ttt import shifted_for_steps, structural_valid

NORMALISATIONS = ("valid", "specforge")
#: `loss.objective` -> the fused loss's term weights (mix: `loss.mix`'s)
OBJECTIVES = {"soft_ce": Objective(), "tv": Objective(kl=0.0, tv=1.0),
              "lk_alpha": Objective(kl=0.0, lk_alpha=1.0),
              "lk_lambda": Objective(kl=0.0, lk_lambda=1.0)}


def row_objective(loss_cfg) -> Objective:
    """The `kernels.loss.Objective` of the `loss` group (objective, lk_eta and mix)."""
    name = getattr(loss_cfg.objective, "value", loss_cfg.objective)
    eta = float(loss_cfg.lk_eta)
    if name == "mix":
        m = loss_cfg.mix
        return Objective(kl=float(m.kl), tv=float(m.tv), lk_alpha=float(m.lk_alpha),
                         lk_lambda=float(m.lk_lambda), eta=eta)
    if name not in OBJECTIVES:
        raise ValueError(f"loss.objective={name!r}; choose one of {sorted(OBJECTIVES)} or mix")
    return OBJECTIVES[name]._replace(eta=eta)


def metric_mask(valid: Tensor, loss_mask: Tensor) -> Tensor:
    """[K, T] bool rows that count for loss and metrics: valid(k,t) · loss_mask[t+1+k] (no position mask)."""
    return valid & shifted_for_steps(loss_mask.bool(), valid.shape[0], False)


def metric_rows(doc_ids: Tensor, loss_mask: Tensor, ttt_steps: int) -> Tensor:
    """[M] int64 ascending ids k·T + t of the `metric_mask` rows, from the batch alone.

    The trainer calls it on the host copy of a batch, so the fused loss can skip the lm_head
    GEMMs of every other row (``kernels.eagle3_loss(rows=...)``) without a device sync. Every
    row with a nonzero `row_weights` entry is listed (the position mask only removes rows).
    """
    mask = metric_mask(structural_valid(doc_ids, ttt_steps), loss_mask)   # [K, T]
    return mask.reshape(-1).nonzero().flatten()


def row_weights(valid: Tensor, loss_mask: Tensor, target_argmax: Tensor, t2d: Tensor, *,
                step_weight: float = 0.8, normalisation: str = "valid",
                position_mask: bool = True) -> Tensor:
    """[K, T] fp32 loss weight per (step, row) as in the module docstring.

    valid [K, T] bool (DrafterOutput.valid), loss_mask [T] bool, target_argmax [T] int64 (the
    target's full-vocab argmax at index t: its prediction of token t+1), t2d [V] bool.
    position_mask drops rows whose target argmax is outside the draft vocabulary (EAGLE/SpecForge).
    """
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"normalisation={normalisation!r}; choose one of {NORMALISATIONS}")
    K, T = valid.shape
    mask = metric_mask(valid, loss_mask)                                  # [K, T]
    if position_mask:
        in_vocab = t2d.bool()[target_argmax.clamp(0, t2d.shape[0] - 1)]  # [T]
        mask = mask & shifted_for_steps(in_vocab, K, False)
    w = mask.float()
    if normalisation == "valid":
        w = w / w.sum(dim=1, keepdim=True).clamp_min(1.0)
    else:
        w = w / float(T)
    decay = step_weight ** torch.arange(K, dtype=torch.float32, device=w.device)
    return w * decay[:, None]
