"""The EAGLE-3 loss for all K TTT steps in one call: lm_head GEMM + the row objective against
the teacher + draft argmax (+ expected acceptance), without [K·N, Vd] logits.

    loss = Σ_{k,t} w[k,t] · ℓ(p[t+k], softmax(hidden[k,t] @ weight.T))

The row objective ℓ (`Objective`) is soft cross-entropy by default (forward KL up to the
teacher's entropy, which has no gradient), or an acceptance-aligned mix: with
p̂ = p / Σp, q = softmax(z) and the expected acceptance α = Σ_v min(p̂_v, q_v) = 1 − TV(p̂, q),

    ℓ = a·CE + b·(1 − α) + c·(−log α)        CE = Σp·lse − Σ_v p_v z_v
    a = kl + lk_lambda·λ,  b = tv + lk_lambda·(1 − λ),  c = lk_alpha,  λ = exp(−η·sg[α])
    ∂ℓ/∂z_v = a·(q_v·Σp − p_v) − (b + c/α)·q_v·(m_v − S),  m_v = [q_v < p̂_v],  S = Σ_u m_u q_u

Every term is row-local, so it fuses like the cross-entropy: an objective with α terms reads
each logits row a third time (α and S must be known before dz is written).

Algorithm, over the flattened [K·N] rows in groups of G rows, each cut into chunks of C rows:
  1. per chunk: z = h_c @ W.T            cuBLAS, fp32 out               [C, Vd]
  2. per chunk: one row kernel over z    lse, Σpz, argmax, α, S, loss, dz = w·∂ℓ/∂z
  3. per group: dh_g = dz @ W; dW += dz.T @ h_g    cuBLAS; dW accumulated in fp32
Given ``rows`` (the ids of the rows that count, listed by a caller that knows the mask on the
host), only those rows are gathered into the GEMMs, a group at a time: masked rows cost nothing.
With ``reduction="sum"`` the gradient is computed in the forward pass (3 GEMMs per row, never 4)
and backward only scales it by grad_output. ``reduction="none"`` returns per-row losses with a
real graph: the forward saves lse and Σp per row and the backward recomputes z chunk by chunk,
so any function of the row losses differentiates correctly (cross-entropy rows only).

Memory contract: besides the outputs (dh, dW) only one z chunk [C, Vd] fp32, one dz group
[G, Vd] in the input dtype (the dh/dW GEMMs run once per group, which cuts the fp32 dW
read-modify-write traffic), the fp32 dW accumulator and O(K·N) row scalars. No host syncs.
The row kernels come from ``kernels/fused_loss.py`` (Triton) or ``kernels/loss_torch.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

import eyas.kernels.loss_torch as loss_torch

log = logging.getLogger(__name__)

IMPLS = ("torch", "triton")
# Buffer sizes (tuned on an H200, benchmarks/README.md): the fp32 logits chunk z [C, Vd] and
# the dz group [G, Vd] that feeds the dh/dW GEMMs. Vd = 32000 gives C = 1024, G = 6144.
Z_BYTES = 128 << 20
DZ_BYTES = 384 << 20


class Objective(NamedTuple):
    """The row objective as weights of its terms (module docstring); the default is soft CE.

    kl: the cross-entropy term (forward KL's gradient); tv: 1 − α; lk_alpha: −log α (LK^α);
    lk_lambda: λ·CE + (1 − λ)·(1 − α) with λ = exp(−eta·α) per row, α not differentiated.
    LK^λ reading: λ is set per row from that row's own α (stop-gradient), as the LK paper's
    hybrid objective writes it with η = 3; SpecForge sets one λ per batch from its mean α.
    """

    kl: float = 1.0
    tv: float = 0.0
    lk_alpha: float = 0.0
    lk_lambda: float = 0.0
    eta: float = 3.0

    @property
    def uses_alpha(self) -> bool:
        """Whether a term reads α (then dz needs a third pass over each logits row)."""
        return bool(self.tv or self.lk_alpha or self.lk_lambda)

    def args(self) -> tuple[float, float, float, float, float]:
        return (float(self.kl), float(self.tv), float(self.lk_alpha), float(self.lk_lambda),
                float(self.eta))


SOFT_CE = Objective()


class LossOutput(NamedTuple):
    """Result of ``eagle3_loss``.

    loss: 0-dim fp32, Σ_{k,t} w·ℓ (differentiable w.r.t. hidden and weight).
    draft_argmax: [K, N] int64, argmax of the draft logits (first index on ties), every row.
    accept: [K, N] fp32 Σ_v min(p/Σp, softmax) on weighted rows (0 elsewhere), or None.
    row_loss: [K, N] fp32 w·CE per row with a graph (``reduction="none"``), else None.
    step_loss: [K] fp32 Σ_t w·ℓ per TTT step, without a graph (for logging loss_k).
    """

    loss: torch.Tensor
    draft_argmax: torch.Tensor
    accept: torch.Tensor | None
    row_loss: torch.Tensor | None
    step_loss: torch.Tensor | None = None


@dataclass
class RowStats:
    """Per-row outputs of the row kernels, [K·N] each, written at global row indices."""

    loss: torch.Tensor      # fp32, w·ℓ
    argmax: torch.Tensor    # int64
    accept: torch.Tensor | None
    lse: torch.Tensor       # fp32
    psum: torch.Tensor      # fp32, Σp

    @classmethod
    def empty(cls, R: int, device, with_accept: bool, listed: bool = False) -> RowStats:
        """Buffers for R rows; ``listed``: only some rows get written, the rest read as
        loss 0, argmax −1, accept 0, lse 0, Σp 0."""
        f32 = dict(device=device, dtype=torch.float32)
        new = torch.zeros if listed else torch.empty
        argmax = (torch.full((R,), -1, device=device, dtype=torch.int64) if listed
                  else torch.empty(R, device=device, dtype=torch.int64))
        return cls(new(R, **f32), argmax, torch.zeros(R, **f32) if with_accept else None,
                   new(R, **f32), new(R, **f32))


# --------------------------------------------------------------------------- GEMM helpers
# bf16 x bf16 -> fp32 GEMMs (torch.mm/addmm out_dtype) exist on CUDA from torch 2.8.
_OUT_DTYPE_OK = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)
_warned_fallback = False


def _native_f32(a: torch.Tensor) -> bool:
    global _warned_fallback
    if not (a.is_cuda and a.dtype != torch.float32):
        return False
    if not _OUT_DTYPE_OK and not _warned_fallback:
        _warned_fallback = True
        log.warning("torch %s lacks mm(out_dtype=float32): the loss upcasts GEMM operands to "
                    "fp32 (slow); upgrade to torch >= 2.8", torch.__version__)
    return _OUT_DTYPE_OK


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (fp32) = a @ b with fp32 accumulation and output, for bf16/fp16/fp32 a, b."""
    if _native_f32(a):
        torch.mm(a, b, out_dtype=torch.float32, out=out)   # cuBLAS, no fp32 copies of a, b
    else:
        torch.mm(a.float(), b.float(), out=out)


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b with fp32 accumulation."""
    if _native_f32(a):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def triton_available() -> bool:
    """Whether Triton is installed (the fused kernels need it; their torch twins do not)."""
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def auto_chunk_size(vocab: int, rows: int) -> int:
    """Logit rows per chunk: the fp32 z buffer near ``Z_BYTES``, a multiple of 128 (≥ 128)."""
    c = max(128, Z_BYTES // (vocab * 4) // 128 * 128)
    return min(c, rows)


def _group_rows(chunk: int, vocab: int, rows: int) -> int:
    """Rows per dh/dW GEMM: a multiple of ``chunk`` with a dz buffer near ``DZ_BYTES``.

    The fp32 dW accumulator is read and written once per group, so larger groups cut that
    traffic; dz (2 bytes per logit) is cheaper to hold than z (4 bytes)."""
    g = max(chunk, DZ_BYTES // (vocab * 2) // chunk * chunk)
    return min(g, max(rows, chunk))


# --------------------------------------------------------------------------- chunk driver
def _chunk_loop(h2d, weight, chunk, row_op, grad_h: bool, grad_w: bool, rows=None):
    """Drive the GEMMs around ``row_op(z [c, Vd] fp32, row0, dz [c, Vd] | None)``.

    For each group of G rows: z = h @ W.T per chunk of C rows, row_op writes those dz rows,
    then dh = dz @ W and dW += dz.T @ h for the whole group. With ``rows`` ([M] int64 global
    row ids) only those rows of ``h2d`` enter the GEMMs: each group is gathered into a [G, H]
    buffer, its dh rows are scattered back and the other dh rows stay zero; ``row0`` then
    counts listed rows. Returns (dh | None, dW fp32 | None).
    """
    R, H = h2d.shape
    M = R if rows is None else rows.shape[0]
    Vd = weight.shape[0]
    dev = h2d.device
    want_grad = grad_h or grad_w
    C = max(1, min(chunk, M))
    G = _group_rows(C, Vd, M) if want_grad else C
    if grad_h:
        dh = torch.empty_like(h2d) if rows is None else torch.zeros_like(h2d)
    else:
        dh = None
    dW = torch.zeros(Vd, H, device=dev, dtype=torch.float32) if grad_w else None
    z_buf = torch.empty(C, Vd, device=dev, dtype=torch.float32)
    dz_buf = torch.empty(G, Vd, device=dev, dtype=h2d.dtype) if want_grad else None
    hg_buf = dh_buf = None
    if rows is not None:
        hg_buf = torch.empty(G, H, device=dev, dtype=h2d.dtype)
        if grad_h:                       # dh rows of a group: z_buf's bytes when they fit
            flat = z_buf.view(-1).view(h2d.dtype)
            dh_buf = flat[:G * H].view(G, H) if flat.numel() >= G * H else torch.empty_like(hg_buf)
    wt = weight.t()                                                  # [H, Vd] view
    for g0 in range(0, M, G):
        g1 = min(M, g0 + G)
        if rows is None:
            hg = h2d[g0:g1]
        else:
            hg = torch.index_select(h2d, 0, rows[g0:g1], out=hg_buf[:g1 - g0])
        for r0 in range(g0, g1, C):
            c = min(C, g1 - r0)
            z = z_buf[:c]
            _mm_f32(hg[r0 - g0:r0 - g0 + c], wt, z)                  # [c, Vd] fp32
            row_op(z, r0, dz_buf[r0 - g0:r0 - g0 + c] if want_grad else None)
        dzg = dz_buf[:g1 - g0] if want_grad else None
        if grad_h and rows is None:
            torch.mm(dzg, weight, out=dh[g0:g1])                     # [G, H]
        elif grad_h:                                                 # z_buf is free here
            torch.mm(dzg, weight, out=dh_buf[:g1 - g0])
            dh.index_copy_(0, rows[g0:g1], dh_buf[:g1 - g0])
        if grad_w:
            _addmm_f32_(dW, dzg.t(), hg)                             # [Vd, H] += [Vd, G] @ [G, H]
    return dh, dW


def _forward_chunks(backend, h2d, weight, teacher, w_flat, N, chunk, with_accept,
                    grad_h: bool, grad_w: bool, rows=None, objective: Objective = SOFT_CE):
    """Row stats for all rows (+ gradients); returns (RowStats, dh | None, dW fp32 | None)."""
    stats = RowStats.empty(h2d.shape[0], h2d.device, with_accept, listed=rows is not None)
    tsum = teacher.sum(1, dtype=torch.float32)                       # [N] Σp per teacher row

    def row_op(z, r0, dz):
        backend.loss_rows(z, teacher, tsum, w_flat, r0, N, stats, dz, with_accept, rows,
                          objective)

    dh, dW = _chunk_loop(h2d, weight, chunk, row_op, grad_h, grad_w, rows)
    return stats, dh, dW


# --------------------------------------------------------------------------- autograd
class _GradInForward(torch.autograd.Function):
    """reduction="sum": the gradient is formed in forward; backward scales it."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher, row_weight, backend, with_accept, chunk,
                grad_h, grad_w, rows, objective):
        K, N, H = hidden.shape
        stats, dh, dW = _forward_chunks(backend, hidden.reshape(K * N, H), weight, teacher,
                                        row_weight.reshape(-1), N, chunk, with_accept,
                                        grad_h, grad_w, rows, objective)
        ctx.grads = (dh, dW)
        ctx.backend = backend
        ctx.shapes = (hidden.shape, weight.dtype)
        argmax = stats.argmax.view(K, N)
        accept = stats.accept.view(K, N) if with_accept else stats.loss.new_empty(0)
        step_loss = stats.loss.view(K, N).sum(1)
        ctx.mark_non_differentiable(argmax, accept, step_loss)
        return stats.loss.sum(), argmax, accept, step_loss

    @staticmethod
    def backward(ctx, g_loss, _g_argmax, _g_accept, _g_step):
        if ctx.grads is None:
            raise RuntimeError("eagle3_loss(reduction='sum') supports one backward pass per "
                               "forward (its gradient is stored, not recomputed)")
        dh, dW = ctx.grads
        ctx.grads = None                                            # free as soon as returned
        shape, w_dtype = ctx.shapes
        g = g_loss.float().reshape(1)
        if dh is not None:                                          # in place, fp32 math
            dh = ctx.backend.scale_cast(dh, g, dh).view(shape)
        if dW is not None:                                          # fp32 -> weight dtype
            out = dW if w_dtype == torch.float32 else torch.empty_like(dW, dtype=w_dtype)
            dW = ctx.backend.scale_cast(dW, g, out)
        return dh, dW, None, None, None, None, None, None, None, None, None


class _Deferred(torch.autograd.Function):
    """reduction="none": per-row losses; backward recomputes logits chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher, row_weight, backend, with_accept, chunk, rows):
        K, N, H = hidden.shape
        stats, _, _ = _forward_chunks(backend, hidden.reshape(K * N, H), weight, teacher,
                                      row_weight.reshape(-1), N, chunk, with_accept,
                                      False, False, rows)
        ctx.save_for_backward(hidden, weight, teacher, row_weight, stats.lse, stats.psum)
        ctx.cfg = (backend, chunk, rows)
        argmax = stats.argmax.view(K, N)
        accept = stats.accept.view(K, N) if with_accept else stats.loss.new_empty(0)
        ctx.mark_non_differentiable(argmax, accept)
        return stats.loss.view(K, N), argmax, accept

    @staticmethod
    def backward(ctx, g_rows, _g_argmax, _g_accept):
        hidden, weight, teacher, row_weight, lse, psum = ctx.saved_tensors
        backend, chunk, rows = ctx.cfg
        K, N, H = hidden.shape
        grad_h, grad_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        coef = (g_rows.float() * row_weight).reshape(-1).contiguous()   # [K*N]

        def row_op(z, r0, dz):      # recompute z per chunk, dz = coef·(softmax·Σp − p)
            backend.grad_rows(z, teacher, coef, lse, psum, r0, N, dz, rows)

        dh, dW = _chunk_loop(hidden.reshape(K * N, H), weight, chunk, row_op, grad_h, grad_w,
                             rows)
        dh = dh.view(K, N, H) if dh is not None else None
        dW = dW.to(weight.dtype) if dW is not None else None
        return dh, dW, None, None, None, None, None, None


# --------------------------------------------------------------------------- public API
def _load_backend(impl: str, device: torch.device):
    """The row-kernel module of `impl`; Triton is imported only when asked for (it may be absent)."""
    if impl not in IMPLS:
        raise ValueError(f"loss impl must be one of {sorted(IMPLS)}, got {impl!r}; "
                         "set loss.impl=triton or loss.impl=torch")
    if impl == "torch":
        return loss_torch
    try:
        import eyas.kernels.fused_loss as fused_loss
    except ImportError as e:
        raise RuntimeError(f"loss impl 'triton' needs the triton package ({e}); install triton "
                           "or set loss.impl=torch") from e
    fused_loss.check_device(device)
    return fused_loss


def _validate(hidden, weight, teacher, row_weight, reduction, chunk_size, rows, objective):
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [K, N, H], got shape {tuple(hidden.shape)}")
    K, N, H = hidden.shape
    if K < 1 or N < 1:
        raise ValueError(f"hidden [K, N, H] needs K >= 1 and N >= 1, got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"weight must be [Vd, H={H}], got {tuple(weight.shape)}")
    Vd = weight.shape[0]
    if tuple(teacher.shape) != (N, Vd):
        raise ValueError(f"teacher must be [N={N}, Vd={Vd}] (one row per position, shifted "
                         f"inside by k), got {tuple(teacher.shape)}")
    if tuple(row_weight.shape) != (K, N):
        raise ValueError(f"row_weight must be [K={K}, N={N}], got {tuple(row_weight.shape)}")
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.bfloat16, torch.float16,
                                                             torch.float32):
        raise ValueError(f"hidden and weight must share a float dtype (bf16/fp16/fp32), got "
                         f"{hidden.dtype} and {weight.dtype}")
    if not teacher.is_floating_point():
        raise ValueError(f"teacher must hold float probabilities, got {teacher.dtype}")
    devs = {t.device for t in (hidden, weight, teacher, row_weight)}
    if len(devs) != 1:
        raise ValueError(f"hidden, weight, teacher, row_weight must be on one device, got {devs}")
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
    if not isinstance(objective, Objective) or min(objective.args()) < 0:
        raise ValueError(f"objective must be an Objective with weights >= 0, got {objective!r}")
    if reduction == "none" and (objective.uses_alpha or objective.kl != 1.0):
        raise ValueError(f"reduction='none' recomputes cross-entropy gradients only, got "
                         f"{objective!r}; use reduction='sum'")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64
                             or rows.device != hidden.device):
        raise ValueError(f"rows must be a 1-D int64 tensor of global row ids k*N+t on "
                         f"{hidden.device}, got {tuple(rows.shape)} {rows.dtype} on {rows.device}")


def eagle3_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor,
                row_weight: torch.Tensor, *, impl: str = "triton", with_accept: bool = False,
                reduction: str = "sum", chunk_size: int | None = None,
                rows: torch.Tensor | None = None,
                objective: Objective = SOFT_CE) -> LossOutput:
    """Fused lm_head + row objective (soft cross-entropy by default) + argmax for all K steps.

    Args:
        hidden: [K, N, H] draft hidden states after the final norm (bf16/fp16/fp32).
        weight: [Vd, H] draft lm_head, same dtype as ``hidden``; receives an fp32-accumulated
            gradient returned in its dtype.
        teacher: [N, Vd] teacher probabilities over the draft vocabulary (bf16 or fp32, any
            row sum: the loss is exact for unnormalised rows). Step k row t reads row t+k
            (clamped to N−1); no gradient.
        row_weight: [K, N] fp32, mask × step weight / normaliser. Zero rows cost no teacher
            reads and get zero loss and gradient. Rows with t+k >= N must be zero. No gradient.
        impl: "triton" (CUDA, or CPU under Triton's interpreter) or "torch" (any device).
        with_accept: also return Σ_v min(p/Σp, softmax) per weighted row.
        reduction: "sum" (gradient formed in forward, backward once) or "none" (per-row
            ``row_loss`` with a recomputing backward, for objectives non-linear in it).
        chunk_size: logit rows per chunk (default: a ~128 MiB fp32 z buffer); the dh/dW GEMMs
            take groups of chunks (a ~384 MiB dz buffer).
        rows: optional [M] int64 global row ids (k·N + t, distinct) to compute. Only these rows
            enter the GEMMs, so masked rows cost nothing; every other row gets loss 0,
            draft_argmax −1, accept 0 and no gradient. Every row with a nonzero weight must be
            listed (not checked: that would need a device sync). Callers that know the mask on
            the host build it there (``models.objective.metric_rows``).
        objective: the row objective's term weights (`Objective`; module docstring).

    Returns:
        LossOutput(loss, draft_argmax, accept, row_loss); see its docstring.
    """
    _validate(hidden, weight, teacher, row_weight, reduction, chunk_size, rows, objective)
    backend = _load_backend(impl, hidden.device)
    K, N, H = hidden.shape
    Vd = weight.shape[0]
    chunk = chunk_size or auto_chunk_size(Vd, K * N if rows is None else max(1, rows.numel()))
    rows = None if rows is None else rows.contiguous()
    hidden = hidden.contiguous()
    weight = weight.contiguous()
    if teacher.stride(1) != 1:
        teacher = teacher.contiguous()
    row_weight = row_weight.detach().to(torch.float32).contiguous()
    teacher = teacher.detach()
    log.debug("eagle3_loss impl=%s K=%d N=%d H=%d Vd=%d chunk=%d", impl, K, N, H, Vd, chunk)
    if reduction == "none":
        row_loss, argmax, accept = _Deferred.apply(hidden, weight, teacher, row_weight,
                                                   backend, with_accept, chunk, rows)
        return LossOutput(row_loss.sum(), argmax, accept if with_accept else None, row_loss,
                          row_loss.detach().sum(1))
    grad_on = torch.is_grad_enabled()
    grad_h = grad_on and hidden.requires_grad
    grad_w = grad_on and weight.requires_grad
    loss, argmax, accept, step_loss = _GradInForward.apply(hidden, weight, teacher, row_weight,
                                                           backend, with_accept, chunk, grad_h,
                                                           grad_w, rows, objective)
    return LossOutput(loss, argmax, accept if with_accept else None, None, step_loss)
