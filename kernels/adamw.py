"""AdamW over fp32 master weights of bf16 parameters, one fused Triton pass per tensor.

    master_adamw_(params, grads, masters, exp_avgs, exp_avg_sqs, steps, lr=..., ...)

For every element, in fp32 (the update of torch's fused AdamW, decoupled weight decay):

    w   = master · (1 − lr·wd)
    m   = β1·m + (1 − β1)·g                 g = the parameter's (bf16) gradient, read as is
    v   = β2·v + (1 − β2)·g²
    w  −= lr / (1 − β1^step) · m / (sqrt(v) / sqrt(1 − β2^step) + eps)
    master = w,  param = bf16(w)

One kernel reads g (2 bytes), master, m, v (12) and writes master, m, v, param (14): 28 bytes
per parameter, against 46 bytes plus an fp32 copy of every gradient for "cast the gradients,
run torch's fused AdamW on the masters, copy back". `steps` are torch AdamW's own per-tensor
step counters (fp32 scalars on the device, incremented here without a host sync), so the
state stays a torch AdamW state: checkpoints load into either implementation.

`skip` (optional 0-dim device tensor, nonzero = skip) turns the whole step into a no-op without
a host sync, for a step whose gradients hold NaN/inf: every program loads the flag and masks
off all its loads and stores, and the step counters advance by (skip == 0). The caller can
decide to skip on the device (e.g. from the gradient norm) and keep queueing work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _master_adamw_kernel(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, step_ptr, skip_ptr, n,
                         lr, beta1, beta2, eps, weight_decay, BLOCK: tl.constexpr,
                         HAS_SKIP: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    step = tl.load(step_ptr).to(tl.float32)                 # already incremented (if not skipped)
    if HAS_SKIP:                                # a skipped step reads and writes nothing
        n = tl.where(tl.load(skip_ptr) == 0, n, 0)
        step = tl.maximum(step, 1.0)            # a skipped first step: bias correction stays finite
    mask = offs < n
    bc1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    w = w * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    w = w - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(master_ptr + offs, w, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(param_ptr + offs, w.to(param_ptr.dtype.element_ty), mask=mask)


@torch.no_grad()
def master_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor],
                  masters: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  skip: torch.Tensor | None = None) -> None:
    """One AdamW step in place (see the module docstring); all lists are parallel.

    params: tensors of any float dtype (bf16 usually), contiguous; grads: same shapes, any float
    dtype; masters, exp_avgs, exp_avg_sqs: fp32, contiguous; steps: 0-dim fp32 counters on the
    same device (incremented by one here); skip: None, or a 0-dim tensor of any dtype (moved to
    the parameters' device): when nonzero, params, masters, moments and steps stay bitwise
    unchanged.
    """
    if not params:
        return
    for name, ts in (("grads", grads), ("masters", masters), ("exp_avgs", exp_avgs),
                     ("exp_avg_sqs", exp_avg_sqs), ("steps", steps)):
        if len(ts) != len(params):
            raise ValueError(f"master_adamw_: {len(params)} params but {len(ts)} {name}")
    flag = None if skip is None else _skip_flag(skip, params[0].device)
    torch._foreach_add_(steps, 1.0 if flag is None else (flag == 0).float())
    block = BLOCK if params[0].is_cuda else 1024
    for p, g, w, m, v, s in zip(params, grads, masters, exp_avgs, exp_avg_sqs, steps):
        if not (p.is_contiguous() and w.is_contiguous() and m.is_contiguous()
                and v.is_contiguous()):
            raise ValueError("master_adamw_: parameters and fp32 state must be contiguous")
        if w.dtype != torch.float32 or m.dtype != torch.float32 or v.dtype != torch.float32:
            raise ValueError(f"master_adamw_: masters and moments must be fp32, got {w.dtype}, "
                             f"{m.dtype}, {v.dtype}")
        g = g.contiguous()
        n = p.numel()
        _master_adamw_kernel[(triton.cdiv(n, block),)](
            p, g, w, m, v, s, s if flag is None else flag, n, float(lr), float(beta1),
            float(beta2), float(eps), float(weight_decay), BLOCK=block,
            HAS_SKIP=flag is not None, num_warps=8 if p.is_cuda else 4)


def _skip_flag(skip: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`skip` as a 0-dim tensor on `device` the kernel can load (bool viewed as uint8: no copy)."""
    if skip.dim() != 0:
        raise ValueError(f"master_adamw_: skip must be a 0-dim tensor, got shape "
                         f"{tuple(skip.shape)}")
    skip = skip.to(device, non_blocking=True)
    return skip.view(torch.uint8) if skip.dtype == torch.bool else skip
