"""Every "auto" of the typed config decided once, for the device this process trains on.

`resolve(cfg, device)` applies the device rule (`data.common.targets.fast_device`): the fast paths on
CUDA, the reference paths elsewhere; explicit settings are kept. The entry point calls it once
and hands the `Resolved` values to the components.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from eyas.data.common.targets import fast_device, target_dtype
from eyas.kernels.loss import triton_available
from eyas.train.config import ConfigError, EyasConfig

@dataclass(frozen=True)
class Resolved:
    """Every "auto" of the config decided for one device (`resolve`)."""

    attention: str
    """drafter attention: "flex" or "eager" (drafter.attention)"""
    compile: bool
    """torch.compile the drafter layer and flex attention (drafter.compile, CUDA only)"""
    loss_impl: str
    """fused loss: "triton" or "torch" (loss.impl)"""
    optim_impl: str
    """MasterAdamW update: "triton" (the fused kernel) or "torch" (torch AdamW on fp32 copies)"""
    compact_masters: bool
    """fp32 masters held as bf16 parameter + int16 low bits (optim.compact_masters; the triton
    update on bf16 parameters only)"""
    param_dtype: torch.dtype
    """drafter parameters (train.param_dtype)"""
    target_dtype: torch.dtype
    """the target in generation and extraction (target.dtype)"""
    pin_memory: bool
    """pinned host batches (copies to the device overlap compute)"""
    host_embedding: bool = False
    """the frozen embedding table in host memory, rows sent with each batch
    (drafter.host_embedding)"""
    device_prefetch: bool = False
    """the next batch copied to the device on a side stream (data.device_prefetch)"""
    moments: str = "fp32"
    """AdamW moment storage, "fp32" or "bf16" (optim.moments)"""


def resolve(cfg: EyasConfig, device: torch.device | str) -> Resolved:
    """Every "auto" of the config decided for `device` (module docstring)."""
    fast = fast_device(device)

    def pick(choice: Enum, fast_path: str, reference: str) -> str:
        return (fast_path if fast else reference) if choice.value == "auto" else choice.value

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    optim_impl = "triton" if fast and triton_available() else "torch"
    param_dtype = dtypes[pick(cfg.train.param_dtype, "bf16", "fp32")]
    if cfg.optim.moments.value == "bf16" and param_dtype != torch.bfloat16:
        raise ConfigError(f"optim.moments=bf16 needs bf16 parameters, but train.param_dtype="
                          f"{cfg.train.param_dtype.value} is fp32 on {device}: set "
                          f"train.param_dtype=bf16, or optim.moments=fp32")
    return Resolved(
        attention=pick(cfg.drafter.attention, "flex", "eager"),
        compile=bool(cfg.drafter.compile) and fast,
        loss_impl=pick(cfg.loss.impl, "triton", "torch"),
        optim_impl=optim_impl,
        compact_masters=(bool(cfg.optim.compact_masters) and optim_impl == "triton"
                         and param_dtype == torch.bfloat16),
        param_dtype=param_dtype,
        moments=cfg.optim.moments.value,
        target_dtype=target_dtype(cfg.target.dtype, device),
        pin_memory=fast,
        host_embedding=(fast if cfg.drafter.host_embedding is None
                        else bool(cfg.drafter.host_embedding)),
        device_prefetch=(fast if cfg.data.device_prefetch is None
                         else bool(cfg.data.device_prefetch)))
