"""Builds the Accelerator (DDP or DeepSpeed ZeRO) from the `dist` group.

Topology (how many processes, nodes) comes from `accelerate launch` (see launch.sh and
conf/accelerate/); the engine (DDP vs ZeRO stage) comes from the Hydra `dist` group, so a
sweep can change it without touching launcher files.

CPU facts this file encodes (accelerate 1.x):
- DDP over gloo needs `Accelerator(cpu=True)` under `accelerate launch --multi_gpu`;
  `--cpu --num_processes N` silently starts one process.
- DeepSpeed on CPU needs an explicit gloo process group and must NOT get `cpu=True`
  (accelerate then silently falls back to DDP).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import DistributedType, InitProcessGroupKwargs, ProjectConfiguration

from eyas.data.targets import fast_device
from eyas.train.config import ConfigError, DistBackend

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class MissingDependency(ConfigError):
    """An optional part of the stack (wandb, deepspeed) that the chosen config needs but that
    cannot be imported; the message is one line with the fix."""


def _missing(module: str, used_by: str, fix: str, e: Exception) -> MissingDependency:
    first = " ".join(str(e).split())[:160]
    return MissingDependency(f"{used_by} needs {module}, which cannot be imported "
                             f"({type(e).__name__}: {first}). Fix: pip install {module} (part "
                             f"of eyas's default install), or {fix}")


# wandb and deepspeed are imported only here, on the paths that use them, so a broken or
# absent one costs only those paths (ImportError, or whatever a broken install raises).
def require_deepspeed(used_by: str) -> None:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:
        raise _missing("deepspeed", used_by, "dist=ddp", e) from None


def require_wandb(used_by: str) -> None:
    try:
        import wandb  # noqa: F401
    except Exception as e:
        raise _missing("wandb", used_by, "tracker=none", e) from None


def set_cpu_threads(threads: int | None, processes_per_node: int) -> int:
    """Intra-op threads of this process on CPU (see train.cpu_threads)."""
    import os
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // max(1, processes_per_node) - 1)
    torch.set_num_threads(threads)
    log.info("CPU: %d torch thread(s) per process", threads)
    return threads


def deepspeed_config(dist_cfg, grad_accum: int, clip: float, bf16: bool) -> dict:
    """The DeepSpeed JSON for this run, with the 'auto' fields filled from the config."""
    name = dist_cfg.deepspeed_config or f"zero{dist_cfg.zero_stage}.json"
    path = Path(name) if Path(name).is_absolute() else CONF_DIR / "deepspeed" / name
    if not path.is_file():
        raise FileNotFoundError(f"dist.deepspeed_config: {path} does not exist; use one of "
                                f"{sorted(p.name for p in (CONF_DIR / 'deepspeed').glob('*.json'))}")
    ds = json.loads(path.read_text())
    ds.setdefault("zero_optimization", {})["stage"] = dist_cfg.zero_stage
    ds["gradient_accumulation_steps"] = grad_accum
    ds["gradient_clipping"] = clip if clip > 0 else 0.0
    ds["train_micro_batch_size_per_gpu"] = 1
    # bf16 parameters: DeepSpeed keeps the fp32 master weights and optimizer state itself.
    ds["bf16"] = {"enabled": bf16}
    return ds


def build_accelerator(dist_cfg, optim_cfg, project_dir: str | Path, *, bf16: bool,
                      cpu_threads: int | None = None, log_with=None) -> Accelerator:
    """Accelerator for the `dist` group on whatever device this process has.

    optim_cfg: grad_accum and clip_grad_norm (DeepSpeed applies them itself); bf16: the
    parameters are bf16 (`Resolved.param_dtype`); cpu_threads: train.cpu_threads."""
    on_cpu = not fast_device()
    deepspeed = dist_cfg.backend == DistBackend.deepspeed
    if deepspeed:
        require_deepspeed(f"dist=zero{dist_cfg.zero_stage} (dist.backend=deepspeed)")
    if log_with == "wandb" or (isinstance(log_with, (list, tuple)) and "wandb" in log_with):
        require_wandb("tracker=wandb")
    kwargs = dict(
        gradient_accumulation_steps=optim_cfg.grad_accum,
        project_config=ProjectConfiguration(project_dir=str(project_dir),
                                            automatic_checkpoint_naming=False),
        log_with=log_with,
    )
    if deepspeed:
        ds = deepspeed_config(dist_cfg, optim_cfg.grad_accum, optim_cfg.clip_grad_norm, bf16=bf16)
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds)
        if on_cpu:
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    elif on_cpu:
        kwargs["cpu"] = True
    acc = Accelerator(**kwargs)
    if on_cpu:
        set_cpu_threads(cpu_threads, acc.num_processes)
    expected = DistributedType.DEEPSPEED if deepspeed else None
    if expected and acc.distributed_type != expected:
        raise RuntimeError(f"dist.backend=deepspeed but accelerate set up "
                           f"{acc.distributed_type}; launch through launch.sh or "
                           f"`accelerate launch --multi_gpu ...`")
    log.info("accelerator: %s, %d process(es), device %s", acc.distributed_type.value,
             acc.num_processes, acc.device)
    return acc
