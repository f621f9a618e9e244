"""Triton row kernels of the fused EAGLE-3 loss (the ``impl="triton"`` backend).

The lm_head GEMMs run in cuBLAS (see ``kernels/loss.py``); these kernels do everything that
touches a chunk of logits ``z [C, Vd]`` (fp32) row by row, one program per row:

    lse   = log Σ_v exp(z_v)                       (online max / sum-exp over Vd)
    Σp    = Σ_v p_v,   Σpz = Σ_v p_v z_v           (p = teacher row t+k, possibly unnormalised)
    loss  = w · (lse·Σp − Σpz)                      (= −w Σ_v p_v log softmax(z)_v, exact for any Σp)
    dz_v  = w · (softmax(z)_v · Σp − p_v)           (∂loss/∂z, written in the GEMM dtype)
    acc   = Σ_v min(p_v / Σp, softmax(z)_v)         (expected acceptance, optional)
    argmax = first index of max_v z_v               (for every row, weighted or not)

Rows with zero weight never read the teacher and write dz = 0 (masked loads issue no memory
traffic). Memory contract: nothing beyond the caller's chunk buffers; per row five scalars
(loss, argmax, accept, lse, Σp) are written at the row's global index ``row0 + program_id``.

Row r of the flattened [K·N] problem is step k = r // N, position t = r % N, and reads teacher
row min(t + k, N − 1), so the K shifted teachers are never materialised. All offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Widest vocabulary block one loop iteration loads; smaller vocabularies use next_pow2(Vd).
# Tuned on an H200 (benchmarks/README.md); tests lower it to exercise multi-block streaming.
MAX_BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _loss_rows_kernel(
    z_ptr, z_stride,          # [C, Vd] fp32 logits of this chunk (row stride z_stride)
    p_ptr, p_stride,          # [N, Vd] teacher probabilities (bf16/fp32), unnormalised allowed
    w_ptr,                    # [K*N] fp32 row weights, indexed by global row
    dz_ptr, dz_stride,        # [C, Vd] out: w·(softmax·Σp − p), only if WRITE_GRAD
    loss_ptr,                 # [K*N] fp32 out: w·(lse·Σp − Σpz)
    argmax_ptr,               # [K*N] int64 out: first index of the row maximum
    accept_ptr,               # [K*N] fp32 out: Σ min(p/Σp, softmax), only if WITH_ACCEPT
    lse_ptr, psum_ptr,        # [K*N] fp32 out: log-sum-exp and Σp (for a deferred backward)
    row0, N, V,               # first global row of the chunk, rows per step, vocabulary size
    BLOCK_V: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    WITH_ACCEPT: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = row0 + pid                                  # global row in [0, K*N)
    k = row // N
    t_row = tl.minimum(row - k * N + k, N - 1)       # teacher row t+k, clamped
    w = tl.load(w_ptr + row)
    active = w != 0.0
    V_act = tl.where(active, V, 0)                   # columns to read: none for inactive rows
    z_row = z_ptr + pid * z_stride
    p_row = p_ptr + t_row * p_stride
    offs = tl.arange(0, BLOCK_V)

    # Pass 1: online max / sum-exp and argmax over z; Σp and Σpz over the teacher.
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int64)
    sp_vec = tl.zeros((BLOCK_V,), tl.float32)
    spz_vec = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        z = tl.load(z_row + cols, mask=mask, other=float("-inf"))
        blk_max = tl.max(z, 0)
        blk_idx = tl.argmax(z, 0, tie_break_left=True).to(tl.int64) + v0
        better = blk_max > best_val                  # strict: earlier blocks win ties
        best_idx = tl.where(better, blk_idx, best_idx)
        best_val = tl.where(better, blk_max, best_val)
        m_new = tl.maximum(m, blk_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
        pmask = cols < V_act                         # inactive rows never read the teacher
        p = tl.load(p_row + cols, mask=pmask, other=0.0).to(tl.float32)
        sp_vec += p
        spz_vec += p * tl.where(pmask, z, 0.0)      # no 0·(−inf) on masked lanes
    lse = m + tl.log(s)
    sp = tl.sum(sp_vec, 0)
    spz = tl.sum(spz_vec, 0)
    tl.store(argmax_ptr + row, best_idx)
    tl.store(lse_ptr + row, lse)
    tl.store(psum_ptr + row, sp)
    tl.store(loss_ptr + row, tl.where(active, w * (lse * sp - spz), 0.0))

    # Pass 2 (the row is mostly in L2 by now): gradient and/or expected acceptance.
    if WRITE_GRAD or WITH_ACCEPT:
        inv_sp = tl.where(sp > 0.0, 1.0 / tl.maximum(sp, 1e-30), 0.0)
        acc_vec = tl.zeros((BLOCK_V,), tl.float32)
        dz_row = dz_ptr + pid * dz_stride
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            mask = cols < V
            lmask = cols < V_act
            z = tl.load(z_row + cols, mask=lmask, other=0.0)
            p = tl.load(p_row + cols, mask=lmask, other=0.0).to(tl.float32)
            q = tl.exp(z - lse)
            if WRITE_GRAD:
                g = tl.where(lmask, w * (q * sp - p), 0.0)
                tl.store(dz_row + cols, g.to(dz_ptr.dtype.element_ty), mask=mask)
            if WITH_ACCEPT:
                acc_vec += tl.where(lmask, tl.minimum(p * inv_sp, q), 0.0)
        if WITH_ACCEPT:
            tl.store(accept_ptr + row, tl.sum(acc_vec, 0))


@triton.jit
def _grad_rows_kernel(
    z_ptr, z_stride,          # [C, Vd] fp32 logits of this chunk (recomputed in backward)
    p_ptr, p_stride,          # [N, Vd] teacher probabilities
    coef_ptr,                 # [K*N] fp32: upstream grad of the row loss × row weight
    lse_ptr, psum_ptr,        # [K*N] fp32 saved by the forward
    dz_ptr, dz_stride,        # [C, Vd] out: coef·(softmax·Σp − p)
    row0, N, V,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = row0 + pid
    k = row // N
    t_row = tl.minimum(row - k * N + k, N - 1)
    c = tl.load(coef_ptr + row)
    V_act = tl.where(c != 0.0, V, 0)                 # columns to read: none for inactive rows
    lse = tl.load(lse_ptr + row)
    sp = tl.load(psum_ptr + row)
    z_row = z_ptr + pid * z_stride
    p_row = p_ptr + t_row * p_stride
    dz_row = dz_ptr + pid * dz_stride
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        lmask = cols < V_act
        z = tl.load(z_row + cols, mask=lmask, other=0.0)
        p = tl.load(p_row + cols, mask=lmask, other=0.0).to(tl.float32)
        g = tl.where(lmask, c * (tl.exp(z - lse) * sp - p), 0.0)
        tl.store(dz_row + cols, g.to(dz_ptr.dtype.element_ty), mask=mask)


def _block_v(V: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(V))


def loss_rows(z, teacher, w_flat, row0, N, out, dz, with_accept):
    """Row statistics (and dz when ``dz`` is given) for chunk rows ``row0 .. row0+len(z)``.

    z [c, Vd] fp32; teacher [N, Vd]; w_flat [K*N] fp32; out: ``RowStats`` with [K*N] buffers;
    dz [c, Vd] (GEMM dtype) or None.
    """
    c, V = z.shape
    write_grad = dz is not None
    dz_arg = dz if write_grad else z                 # never written when WRITE_GRAD is off
    acc_arg = out.accept if with_accept else out.loss
    _loss_rows_kernel[(c,)](
        z, z.stride(0), teacher, teacher.stride(0), w_flat,
        dz_arg, dz_arg.stride(0),
        out.loss, out.argmax, acc_arg, out.lse, out.psum,
        row0, N, V,
        BLOCK_V=_block_v(V), WRITE_GRAD=write_grad, WITH_ACCEPT=with_accept,
        num_warps=NUM_WARPS,
    )


def grad_rows(z, teacher, coef, lse, psum, row0, N, dz):
    """dz = coef·(softmax(z)·Σp − p) for chunk rows ``row0 .. row0+len(z)`` (deferred backward)."""
    c, V = z.shape
    _grad_rows_kernel[(c,)](
        z, z.stride(0), teacher, teacher.stride(0), coef, lse, psum,
        dz, dz.stride(0), row0, N, V,
        BLOCK_V=_block_v(V), num_warps=NUM_WARPS,
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
