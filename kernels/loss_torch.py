"""Torch twin of the fused EAGLE-3 loss (``impl="torch"``): the same chunked algorithm as the
Triton backend (``kernels/fused_loss.py``), with each row kernel written as plain torch ops.

It runs anywhere torch runs (CPU included), is the reference the Triton kernels are tested
against, and shares the chunk driver and autograd functions in ``kernels/loss.py``, so the
chunking, the teacher shift and the gradient plumbing are exercised by both backends. The row
functions below mirror ``loss_rows`` / ``grad_rows`` in ``kernels/fused_loss.py`` one to one.
"""

from __future__ import annotations

import torch

#: α below this counts as this in −log α and in its gradient's 1/α (a row the drafter misses
#: entirely would otherwise give an infinite loss); the Triton kernels use the same value
ALPHA_EPS = 1e-5


def _global_rows(row0: int, c: int, device, rows) -> torch.Tensor:
    """[c] global rows of chunk rows row0 .. row0+c (listed in ``rows``, or contiguous)."""
    if rows is not None:
        return rows[row0:row0 + c]
    return torch.arange(row0, row0 + c, device=device)


def _teacher_index(g: torch.Tensor, N: int) -> torch.Tensor:
    """Teacher row min(t + k, N − 1) of global rows g (row = k·N + t)."""
    k = torch.div(g, N, rounding_mode="floor")
    return torch.clamp(g - k * N + k, max=N - 1)


def loss_rows(z, teacher, tsum, w_flat, row0, N, out, dz, with_accept, rows=None,
              objective=None):
    """Torch version of ``kernels.fused_loss.loss_rows`` (same arguments, same outputs)."""
    kl, tv, lka, lam, eta = (1.0, 0.0, 0.0, 0.0, 3.0) if objective is None else objective.args()
    uses_alpha = bool(tv or lka or lam)
    c = z.shape[0]
    sl = _global_rows(row0, c, z.device, rows)
    t_row = _teacher_index(sl, N)
    w = w_flat[sl]                                                         # [c]
    active = w != 0
    p = torch.where(active[:, None], teacher.index_select(0, t_row).float(), 0.0)   # [c, Vd]
    sp = torch.where(active, tsum[t_row], 0.0)                             # [c]
    lse = torch.logsumexp(z, dim=1)                                        # [c]
    spz = (p * z).sum(1)
    out.argmax[sl] = z.argmax(1)                                           # first index on ties
    out.lse[sl] = lse
    out.psum[sl] = sp
    ce = lse * sp - spz
    if dz is None and not with_accept and not uses_alpha:
        out.loss[sl] = torch.where(active, w * kl * ce, 0.0)
        return
    q = torch.exp(z - lse[:, None])                                        # [c, Vd] softmax
    p_hat = p * torch.where(sp > 0, 1.0 / sp, 0.0)[:, None]
    alpha = torch.where(active, torch.minimum(p_hat, q).sum(1), 0.0)       # [c]
    if with_accept:
        out.accept[sl] = alpha
    # the α terms count only where the teacher has mass (Σp > 0); λ, 1/α take no gradient
    has_p = (sp > 0).float()
    lam_w = lam * torch.exp(-eta * alpha)
    a = kl + lam_w
    b = (tv + lam - lam_w) * has_p
    c_lka = lka * has_p
    a_safe = alpha.clamp_min(ALPHA_EPS)
    row = a * ce + b * (1.0 - alpha) - c_lka * torch.log(a_safe)
    out.loss[sl] = torch.where(active, w * row, 0.0)
    if dz is None:
        return
    g = a[:, None] * (q * sp[:, None] - p)
    if uses_alpha:
        m = q < p_hat
        s_m = torch.where(m, q, 0.0).sum(1, keepdim=True)                  # S
        g = g - (b + c_lka / a_safe)[:, None] * q * (m.float() - s_m)
    dz.copy_(torch.where(active[:, None], w[:, None] * g, 0.0))


def grad_rows(z, teacher, coef, lse, psum, row0, N, dz, rows=None):
    """Torch version of ``kernels.fused_loss.grad_rows``."""
    c = z.shape[0]
    sl = _global_rows(row0, c, z.device, rows)
    cf = coef[sl].unsqueeze(1)                                             # [c, 1]
    active = cf != 0
    t_row = _teacher_index(sl, N)
    p = torch.where(active, teacher.index_select(0, t_row).float(), 0.0)
    q = torch.exp(z - lse[sl].unsqueeze(1))
    dz.copy_(torch.where(active, cf * (q * psum[sl].unsqueeze(1) - p), 0.0))


def scale_cast(src: torch.Tensor, g: torch.Tensor, out: torch.Tensor,
               rows: int = 4096) -> torch.Tensor:
    """Torch version of ``kernels.fused_loss.scale_cast`` (fp32 math, a few rows at a time)."""
    for r0 in range(0, src.shape[0], rows):
        out[r0:r0 + rows] = src[r0:r0 + rows].float() * g
    return out
