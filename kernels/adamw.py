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

Compact masters (`masters` int16): the fp32 master is kept as its bf16 parameter plus the
16 low bits it lacks, `lo = bits(master) − bits(param) << 16` with the parameter rounded as
`(bits + 0x8000) >> 16` (to nearest; exact ties away from zero instead of to even), so lo
always fits an int16. The kernel rebuilds the exact fp32 master from the two, updates it and
splits it again: the same fp32 trajectory as separate fp32 masters at 2 bytes per parameter
instead of 4 (24 bytes of traffic per parameter instead of 28). `split_master` / `join_master`
are the torch twins of the split and the rebuild.

bf16 moments (`exp_avgs`/`exp_avg_sqs` in bf16, `optim.moments=bf16`): the kernel reads them,
updates in fp32 as above, and stores them rounded stochastically (the fp32 value is rounded up
in magnitude with probability equal to the dropped 16 bits / 2^16), so the stored moments are
unbiased and a slow decay of v is not lost to rounding. The random bits are a hash of (element,
step, tensor index): the same inputs give the same state, so resume stays exact. 4 bytes of
state per parameter instead of 8. `master_adamw_reference_` is the torch twin of the whole
update (the CPU path of `optim.moments=bf16`).

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
def _hash32(x):
    """A 32-bit integer mix (uint32 in, uint32 out); `hash32` is its torch twin."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x1B873593
    return x ^ (x >> 16)


@triton.jit
def _round_bf16(x, r):
    """fp32 → bf16 bits (int16), `r` (in [0, 2^16)) added below the kept half; NaN stays NaN
    (0x7FC0) instead of carrying into an infinity or wrapping. `stochastic_bf16` is the twin."""
    rounded = ((x.to(tl.int32, bitcast=True) + r) >> 16).to(tl.int16)
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _master_adamw_kernel(param_ptr, grad_ptr, master_ptr, m_ptr, v_ptr, step_ptr, skip_ptr, n,
                         seed, lr, beta1, beta2, eps, weight_decay, BLOCK: tl.constexpr,
                         HAS_SKIP: tl.constexpr, COMPACT: tl.constexpr,
                         BF16_MOMENTS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    step = tl.load(step_ptr).to(tl.float32)                 # already incremented (if not skipped)
    if HAS_SKIP:                                # a skipped step reads and writes nothing
        n = tl.where(tl.load(skip_ptr) == 0, n, 0)
        step = tl.maximum(step, 1.0)            # a skipped first step: bias correction stays finite
    mask = offs < n
    bc1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if COMPACT:             # master bits = (param bits << 16) + lo, in wrapping int32
        hi = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True)
        lo = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32)
        w = (((hi.to(tl.int32) & 0xFFFF) << 16) + lo).to(tl.float32, bitcast=True)
    else:
        w = tl.load(master_ptr + offs, mask=mask, other=0.0)
    if BF16_MOMENTS:        # bf16 bits (int16 views) → fp32, exactly
        m = (tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32,
                                                                             bitcast=True)
        v = (tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32,
                                                                             bitcast=True)
    else:
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    w = w * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    w = w - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    if BF16_MOMENTS:        # stochastic rounding: add 16 random bits, keep the high half
        key = _hash32(_hash32(step.to(tl.uint32)) ^ seed)
        h = _hash32(offs.to(tl.uint32) ^ key)
        tl.store(m_ptr + offs, _round_bf16(m, (h & 0xFFFF).to(tl.int32)), mask=mask)
        tl.store(v_ptr + offs, _round_bf16(v, (h >> 16).to(tl.int32)), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    if COMPACT:
        bits = w.to(tl.int32, bitcast=True)
        hi = (bits + 0x8000) >> 16                       # the low 16 bits are the bf16 bits
        tl.store(master_ptr + offs, (bits - (hi << 16)).to(tl.int16), mask=mask)
        tl.store(param_ptr + offs, hi.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(master_ptr + offs, w, mask=mask)
        tl.store(param_ptr + offs, w.to(param_ptr.dtype.element_ty), mask=mask)


@torch.no_grad()
def master_adamw_(params: list[torch.Tensor], grads: list[torch.Tensor],
                  masters: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  skip: torch.Tensor | None = None, first_seed: int = 0) -> None:
    """One AdamW step in place (see the module docstring); all lists are parallel.

    params: tensors of any float dtype (bf16 usually), contiguous; grads: same shapes, any float
    dtype; masters: fp32, or int16 low halves of bf16 params (compact, module docstring);
    exp_avgs, exp_avg_sqs: fp32, or both bf16 (stochastically rounded, module docstring),
    contiguous; steps: 0-dim fp32 counters on the
    same device (incremented by one here); first_seed: the random bits of tensor i come from
    stream first_seed + i (a caller with several lists gives each its own range); skip: None,
    or a 0-dim tensor of any dtype (moved to the parameters' device): when nonzero, params,
    masters, moments and steps stay bitwise unchanged.
    """
    if not params:
        return
    for name, ts in (("grads", grads), ("masters", masters), ("exp_avgs", exp_avgs),
                     ("exp_avg_sqs", exp_avg_sqs), ("steps", steps)):
        if len(ts) != len(params):
            raise ValueError(f"master_adamw_: {len(params)} params but {len(ts)} {name}")
    for p, w, m, v in zip(params, masters, exp_avgs, exp_avg_sqs):   # before any update
        _check_state(p, w, m, v)
    flag = None if skip is None else _skip_flag(skip, params[0].device)
    if flag is None:
        torch._foreach_add_(steps, 1.0)
    else:       # a list of device tensors: the 0-dim tensor overload reads it on the host
        torch._foreach_add_(steps, [(flag == 0).float()] * len(steps))
    block = BLOCK if params[0].is_cuda else 1024
    for seed, (p, g, w, m, v, s) in enumerate(zip(params, grads, masters, exp_avgs,
                                                  exp_avg_sqs, steps), start=first_seed):
        compact, low = w.dtype == torch.int16, m.dtype == torch.bfloat16
        g = g.contiguous()
        n = p.numel()
        _master_adamw_kernel[(triton.cdiv(n, block),)](
            p, g, w, m.view(torch.int16) if low else m, v.view(torch.int16) if low else v, s,
            s if flag is None else flag, n, seed, float(lr), float(beta1), float(beta2),
            float(eps), float(weight_decay), BLOCK=block, HAS_SKIP=flag is not None,
            COMPACT=compact, BF16_MOMENTS=low, num_warps=8 if p.is_cuda else 4)


def _check_state(p: torch.Tensor, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    """ValueError unless a parameter and its state are what `master_adamw_` updates."""
    if not (p.is_contiguous() and w.is_contiguous() and m.is_contiguous()
            and v.is_contiguous()):
        raise ValueError("master_adamw_: parameters and optimizer state must be contiguous")
    compact = w.dtype == torch.int16
    if compact and p.dtype != torch.bfloat16:
        raise ValueError(f"master_adamw_: int16 (compact) masters need bf16 parameters, "
                         f"got {p.dtype}")
    if not (compact or w.dtype == torch.float32) or m.dtype != v.dtype \
            or m.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"master_adamw_: masters must be fp32 or int16 and both moments "
                         f"fp32 or both bf16, got {w.dtype}, {m.dtype}, {v.dtype}")


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Torch twin of the kernel's `_hash32`: uint32 values held in int64."""
    m = 0xFFFFFFFF
    x = (x ^ (x >> 16)) & m
    x = (x * 0x7FEB352D) & m
    x = (x ^ (x >> 15)) & m
    x = (x * 0x1B873593) & m
    return x ^ (x >> 16)


def stochastic_bf16(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 → bf16, rounded up in magnitude when the dropped 16 bits + `random16` (in
    [0, 2^16)) carry into the kept half: probability (dropped bits) / 2^16 (torch twin)."""
    x = x.float().contiguous()
    bits = x.view(torch.int32).to(torch.int64) + random16
    out = _as_int16(((bits & 0xFFFFFFFF) >> 16) & 0xFFFF)
    return torch.where(x.isnan(), 0x7FC0, out).to(torch.int16).view(torch.bfloat16)


@torch.no_grad()
def master_adamw_reference_(params, grads, masters, exp_avgs, exp_avg_sqs, steps, *, lr: float,
                            beta1: float, beta2: float, eps: float, weight_decay: float,
                            skip: torch.Tensor | None = None, first_seed: int = 0) -> None:
    """Torch twin of `master_adamw_` with fp32 masters: the same fp32 update, the same
    stochastic rounding of bf16 moments. Equal to the kernel up to the fp32 rounding of
    exp2/log2/fused multiply-adds; the CPU path of bf16 moments."""
    if skip is not None and bool(skip):
        return
    f32 = torch.float32
    for seed, (p, g, w, m, v, s) in enumerate(zip(params, grads, masters, exp_avgs,
                                                  exp_avg_sqs, steps), start=first_seed):
        s.add_(1.0)
        step = s.to(f32)
        bc1 = 1.0 - torch.exp2(step * torch.log2(torch.tensor(beta1, dtype=f32)))
        bc2_sqrt = torch.sqrt(1.0 - torch.exp2(step * torch.log2(torch.tensor(beta2, dtype=f32))))
        g32 = g.to(f32)
        new_w = w * (1.0 - lr * weight_decay)
        new_m = beta1 * m.to(f32) + (1.0 - beta1) * g32
        new_v = beta2 * v.to(f32) + (1.0 - beta2) * g32 * g32
        new_w = new_w - (lr / bc1) * new_m / (torch.sqrt(new_v) / bc2_sqrt + eps)
        if m.dtype == torch.bfloat16:
            key = hash32(hash32(torch.tensor(int(step), dtype=torch.int64)) ^ seed)
            index = torch.arange(m.numel(), dtype=torch.int64, device=m.device) & 0xFFFFFFFF
            h = hash32(index ^ key.to(m.device)).view(m.shape)
            m.copy_(stochastic_bf16(new_m, h & 0xFFFF))
            v.copy_(stochastic_bf16(new_v, h >> 16))
        else:
            m.copy_(new_m)
            v.copy_(new_v)
        w.copy_(new_w)
        p.copy_(new_w)


def _skip_flag(skip: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`skip` as a 0-dim tensor on `device` the kernel can load (bool viewed as uint8: no copy)."""
    if skip.dim() != 0:
        raise ValueError(f"master_adamw_: skip must be a 0-dim tensor, got shape "
                         f"{tuple(skip.shape)}")
    skip = skip.to(device, non_blocking=True)
    return skip.view(torch.uint8) if skip.dtype == torch.bool else skip


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master → (bf16 parameter, int16 low bits), as the kernel splits it (torch twin)."""
    bits = master.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = (bits + 0x8000) >> 16                                       # in [0, 2^16]
    lo = bits - (hi << 16)                                           # in [-2^15, 2^15)
    return _as_int16(hi & 0xFFFF).view(torch.bfloat16), lo.to(torch.int16)


def join_master(param: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """(bf16 parameter, int16 low bits) → the exact fp32 master (torch twin of the rebuild)."""
    hi = param.detach().contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + lo.to(torch.int64)) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _as_int16(u: torch.Tensor) -> torch.Tensor:
    """Unsigned 16-bit values held in int64 → the int16 with the same bits."""
    return torch.where(u >= 1 << 15, u - (1 << 16), u).to(torch.int16)
