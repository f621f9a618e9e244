"""Triton row kernels of the fused EAGLE-3 loss (the ``impl="triton"`` backend).

The lm_head GEMMs run in cuBLAS (see ``kernels/loss.py``); these kernels do everything that
touches a chunk of logits ``z [C, Vd]`` (fp32), row by row:

    lse   = log Σ_v exp(z_v)                       pass 1: online max / sum-exp, reads z only
    argmax = first index of max_v z_v               pass 1, for every row (weighted or not)
    Σpz   = Σ_v p_v z_v                            pass 2 (p = teacher row t+k, any row sum)
    α     = Σ_v min(p_v / Σp, softmax(z)_v)         pass 2, expected acceptance
    S     = Σ_v [q_v < p_v / Σp]·q_v                pass 2, objectives with α terms only
    loss  = w · (a·(lse·Σp − Σpz) + b·(1 − α) − c·log α)    (soft CE: a = 1, b = c = 0)
    dz_v  = w · (a·(q_v·Σp − p_v) − (b + c/α)·q_v·([q_v < p̂_v] − S))    ∂loss/∂z, GEMM dtype:
            pass 2 for soft CE, a third pass when b or c is nonzero (α and S come first)

a, b, c are the `kernels.loss.Objective` weights, with LK^λ's per-row λ = exp(−η·α) folded in
(that docstring and ``kernels/loss_torch.py``, the same formulas in plain torch).

One program per row; Σp comes precomputed per teacher row, so pass 1 reads z alone. Rows with
zero weight never read the teacher and write dz = 0 (masked loads issue no memory traffic).
Per row five scalars (loss, argmax, accept, lse, Σp) are written at the global row index.

Row r of the flattened [K·N] problem is step k = r // N, position t = r % N, and reads teacher
row min(t + k, N − 1), so the K shifted teachers are never materialised. Offsets are int64.
When the caller lists the rows to compute (``rows``), chunk row i is global row rows[row0 + i]
and the logits hold only those rows (the GEMMs skip the others).

Each row is streamed twice in ``MAX_BLOCK_V`` blocks. (Holding a whole 32768-wide row on chip
to read it once measured 37% slower per chunk on an H200: the row spills out of registers.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eyas.kernels.loss_torch import ALPHA_EPS

# Widest vocabulary block one loop iteration loads; smaller vocabularies use next_pow2(Vd).
# Tuned on an H200 (benchmarks/README.md); tests lower it to exercise multi-block streaming.
# (Persistent grids of 1-4 programs per SM, tried for L2 reuse, measured 10-200% slower.)
MAX_BLOCK_V = 8192
NUM_WARPS = 16


@triton.jit
def _loss_row(z_row, p_row, dz_row, sp, w, V, V_act, c_kl, c_tv, c_lka, c_lam, eta, alpha_eps,
              BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, USES_ALPHA: tl.constexpr):
    """One row: returns (argmax, lse, row objective before w, α); writes dz if WRITE_GRAD."""
    offs = tl.arange(0, BLOCK_V)
    # Pass 1 over z only: online max / sum-exp and argmax.
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
        blk_max = tl.max(z, 0)
        blk_idx = tl.argmax(z, 0, tie_break_left=True).to(tl.int64) + v0
        better = blk_max > best_val                  # strict: earlier blocks win ties
        best_idx = tl.where(better, blk_idx, best_idx)
        best_val = tl.where(better, blk_max, best_val)
        m_new = tl.maximum(m, blk_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    # Pass 2 (re-reads z): teacher, Σpz, α, S; dz of the cross-entropy-only objectives.
    inv_sp = tl.where(sp > 0.0, 1.0 / tl.maximum(sp, 1e-30), 0.0)
    spz_vec = tl.zeros((BLOCK_V,), tl.float32)
    acc_vec = tl.zeros((BLOCK_V,), tl.float32)
    s_vec = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        lmask = cols < V_act                         # no loads at all for inactive rows
        z = tl.load(z_row + cols, mask=lmask, other=0.0)
        p = tl.load(p_row + cols, mask=lmask, other=0.0).to(tl.float32)
        spz_vec += p * z
        q = tl.exp(z - lse)
        p_hat = p * inv_sp
        acc_vec += tl.where(lmask, tl.minimum(p_hat, q), 0.0)
        if USES_ALPHA:
            s_vec += tl.where(lmask & (q < p_hat), q, 0.0)
        elif WRITE_GRAD:
            g = tl.where(lmask, (w * c_kl) * (q * sp - p), 0.0)
            tl.store(dz_row + cols, g.to(dz_row.dtype.element_ty), mask=cols < V)
    alpha = tl.sum(acc_vec, 0)
    has_p = sp > 0.0                                 # α terms count where the teacher has mass
    lam_w = c_lam * tl.exp(-eta * alpha)             # λ·lk_lambda, α taken as a constant
    a = c_kl + lam_w
    b = tl.where(has_p, c_tv + c_lam - lam_w, 0.0)
    c = tl.where(has_p, c_lka, 0.0)
    a_safe = tl.maximum(alpha, alpha_eps)
    if USES_ALPHA and WRITE_GRAD:                    # pass 3: dz once α and S are known
        s_sum = tl.sum(s_vec, 0)
        coef = b + c / a_safe
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            lmask = cols < V_act
            z = tl.load(z_row + cols, mask=lmask, other=0.0)
            p = tl.load(p_row + cols, mask=lmask, other=0.0).to(tl.float32)
            q = tl.exp(z - lse)
            below = (q < p * inv_sp).to(tl.float32)
            g = a * (q * sp - p) - coef * q * (below - s_sum)
            g = tl.where(lmask, w * g, 0.0)
            tl.store(dz_row + cols, g.to(dz_row.dtype.element_ty), mask=cols < V)
    row = a * (lse * sp - tl.sum(spz_vec, 0)) + b * (1.0 - alpha) - c * tl.log(a_safe)
    return best_idx, lse, row, alpha


@triton.jit
def _loss_rows_kernel(
    z_ptr, z_stride,          # [C, Vd] fp32 logits of this chunk (row stride z_stride)
    p_ptr, p_stride,          # [N, Vd] teacher probabilities (bf16/fp32), unnormalised allowed
    tsum_ptr,                 # [N] fp32 Σ_v p of each teacher row
    w_ptr,                    # [K*N] fp32 row weights, indexed by global row
    dz_ptr, dz_stride,        # [C, Vd] out: w·(softmax·Σp − p), only if WRITE_GRAD
    loss_ptr,                 # [K*N] fp32 out: w·(lse·Σp − Σpz)
    argmax_ptr,               # [K*N] int64 out: first index of the row maximum
    accept_ptr,               # [K*N] fp32 out: Σ min(p/Σp, softmax), only if WITH_ACCEPT
    lse_ptr, psum_ptr,        # [K*N] fp32 out: log-sum-exp and Σp (for a deferred backward)
    rows_ptr,                 # [M] int64 global row of each computed row (if HAS_ROWS)
    row0, N, V,               # first (global or listed) row of the chunk, rows per step, Vd
    c_kl, c_tv, c_lka, c_lam, eta, alpha_eps,    # the objective (kernels.loss.Objective)
    BLOCK_V: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    WITH_ACCEPT: tl.constexpr,
    USES_ALPHA: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)                 # chunk row; int64 offsets from here
    if HAS_ROWS:
        row = tl.load(rows_ptr + row0 + r)            # global row in [0, K*N)
    else:
        row = row0 + r
    k = row // N
    t_row = tl.minimum(row - k * N + k, N - 1)       # teacher row t+k, clamped
    w = tl.load(w_ptr + row)
    active = w != 0.0
    V_act = tl.where(active, V, 0)                   # columns to read: none for inactive rows
    sp = tl.where(active, tl.load(tsum_ptr + t_row), 0.0)
    best_idx, lse, obj, acc = _loss_row(
        z_ptr + r * z_stride, p_ptr + t_row * p_stride, dz_ptr + r * dz_stride,
        sp, w, V, V_act, c_kl, c_tv, c_lka, c_lam, eta, alpha_eps, BLOCK_V, WRITE_GRAD,
        USES_ALPHA)
    tl.store(argmax_ptr + row, best_idx)
    tl.store(lse_ptr + row, lse)
    tl.store(psum_ptr + row, sp)
    tl.store(loss_ptr + row, tl.where(active, w * obj, 0.0))
    if WITH_ACCEPT:
        tl.store(accept_ptr + row, acc)


@triton.jit
def _grad_rows_kernel(
    z_ptr, z_stride,          # [C, Vd] fp32 logits of this chunk (recomputed in backward)
    p_ptr, p_stride,          # [N, Vd] teacher probabilities
    coef_ptr,                 # [K*N] fp32: upstream grad of the row loss × row weight
    lse_ptr, psum_ptr,        # [K*N] fp32 saved by the forward
    dz_ptr, dz_stride,        # [C, Vd] out: coef·(softmax·Σp − p)
    rows_ptr,                 # [M] int64 global rows (if HAS_ROWS)
    row0, N, V,
    BLOCK_V: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_V)
    r = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + row0 + r)
    else:
        row = row0 + r
    k = row // N
    t_row = tl.minimum(row - k * N + k, N - 1)
    c = tl.load(coef_ptr + row)
    V_act = tl.where(c != 0.0, V, 0)                 # columns to read: none for inactive rows
    lse = tl.load(lse_ptr + row)
    sp = tl.load(psum_ptr + row)
    z_row = z_ptr + r * z_stride
    p_row = p_ptr + t_row * p_stride
    dz_row = dz_ptr + r * dz_stride
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        lmask = cols < V_act
        z = tl.load(z_row + cols, mask=lmask, other=0.0)
        p = tl.load(p_row + cols, mask=lmask, other=0.0).to(tl.float32)
        g = tl.where(lmask, c * (tl.exp(z - lse) * sp - p), 0.0)
        tl.store(dz_row + cols, g.to(dz_ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def _scale_cast_kernel(src_ptr, g_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = src · g in fp32, stored in out's dtype (out may alias src)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr)
    tl.store(out_ptr + offs, (x * g).to(out_ptr.dtype.element_ty), mask=mask)


def scale_cast(src: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = src · g (g: [1] fp32) with fp32 math; src and out contiguous, same shape."""
    n = src.numel()
    block = 8192 if src.is_cuda else 1024
    _scale_cast_kernel[(triton.cdiv(n, block),)](src, g, out, n, BLOCK=block, num_warps=8)
    return out


def _block_v(V: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(V))


def loss_rows(z, teacher, tsum, w_flat, row0, N, out, dz, with_accept, rows=None,
              objective=None):
    """Row statistics (and dz when ``dz`` is given) for chunk rows ``row0 .. row0+len(z)``.

    z [c, Vd] fp32; teacher [N, Vd]; tsum [N] fp32 row sums of teacher; w_flat [K*N] fp32;
    out: ``RowStats`` with [K*N] buffers; dz [c, Vd] (GEMM dtype) or None; rows: [M] int64
    global row ids (then z row i is global row rows[row0 + i]) or None (global row row0 + i);
    objective: `kernels.loss.Objective` (None: soft cross-entropy).
    """
    kl, tv, lka, lam, eta = (1.0, 0.0, 0.0, 0.0, 3.0) if objective is None else objective.args()
    c, V = z.shape
    write_grad = dz is not None
    dz_arg = dz if write_grad else z                 # never written when WRITE_GRAD is off
    acc_arg = out.accept if with_accept else out.loss
    _loss_rows_kernel[(c,)](
        z, z.stride(0), teacher, teacher.stride(0), tsum, w_flat,
        dz_arg, dz_arg.stride(0),
        out.loss, out.argmax, acc_arg, out.lse, out.psum,
        w_flat if rows is None else rows, row0, N, V, kl, tv, lka, lam, eta, ALPHA_EPS,
        BLOCK_V=_block_v(V), WRITE_GRAD=write_grad, WITH_ACCEPT=with_accept,
        USES_ALPHA=bool(tv or lka or lam), HAS_ROWS=rows is not None, num_warps=NUM_WARPS,
    )


def grad_rows(z, teacher, coef, lse, psum, row0, N, dz, rows=None):
    """Deferred backward: dz = coef·(softmax(z)·Σp − p) for chunk rows (as in ``loss_rows``)."""
    c, V = z.shape
    _grad_rows_kernel[(c,)](
        z, z.stride(0), teacher, teacher.stride(0), coef, lse, psum,
        dz, dz.stride(0), coef if rows is None else rows, row0, N, V,
        BLOCK_V=_block_v(V), HAS_ROWS=rows is not None, num_warps=NUM_WARPS,
    )


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (its own runtime knob)."""
    try:
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # pragma: no cover - older triton
        return False


def check_device(device: torch.device) -> None:
    """Raise if Triton cannot launch on ``device`` (CPU tensors need the interpreter)."""
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return
    raise RuntimeError(
        f"loss impl 'triton' cannot run on {device} tensors: Triton needs a CUDA device "
        "(or its CPU interpreter, TRITON_INTERPRET=1, for tests). Set loss.impl=torch."
    )
