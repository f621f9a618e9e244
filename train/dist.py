"""Builds the Accelerator (DDP or DeepSpeed ZeRO) from the `dist` group.

Topology (how many processes, nodes) comes from `accelerate launch` (see launch.sh and
conf/accelerate/); the engine (DDP vs ZeRO stage) comes from the Hydra `dist` group, so a
sweep can change it without touching launcher files.

CPU facts this file encodes (accelerate 1.x):
- DDP over gloo needs `Accelerator(cpu=True)` under `accelerate launch --multi_gpu`;
  `--cpu --num_processes N` starts one process (refused: `dropped_processes`).
- DeepSpeed on CPU needs an explicit gloo process group and must NOT get `cpu=True`
  (accelerate then silently falls back to DDP).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import DistributedType, InitProcessGroupKwargs, ProjectConfiguration

from eyas.data.common import deps
from eyas.data.common.targets import fast_device
from eyas.train.config import ConfigError, DistBackend

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class MissingDependency(ConfigError, deps.MissingDependency):
    """An optional part of the stack (wandb, deepspeed) that the chosen config needs but that
    cannot be imported; the message is one line with the fix."""


def set_cpu_threads(threads: int | None, processes_per_node: int) -> int:
    """Intra-op threads of this process on CPU (see train.cpu_threads)."""
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // max(1, processes_per_node) - 1)
    torch.set_num_threads(threads)
    log.info("CPU: %d torch thread(s) per process", threads)
    return threads


def deepspeed_config(dist_cfg, grad_accum: int, clip: float, bf16: bool,
                     world_size: int = 1) -> dict:
    """The DeepSpeed JSON for this run, as HF Trainer takes one: the file is used as given,
    except the fields set to "auto", which are filled from the config (gradient_clipping from
    optim.clip_grad_norm, gradient_accumulation_steps from optim.grad_accum, bf16.enabled from
    the parameter dtype, train_micro_batch_size_per_gpu = 1 packed batch, zero_optimization.stage
    from dist.zero_stage; with bf16, bf16.check_grad_overflow true). zero_optimization.overlap_comm
    "auto" (the shipped files) is on with more than one process and off with one: one process
    has no gradient communication to overlap, and the overlap's extra stream and buffers cost it
    ~3 % of a step (benchmarks/README.md). A given value the trainer cannot run with is refused
    (ConfigError). world_size: the number of processes."""
    name = dist_cfg.deepspeed_config or f"zero{dist_cfg.zero_stage}.json"
    path = Path(name).expanduser()
    if not path.is_file() and not path.is_absolute():
        path = CONF_DIR / "deepspeed" / name
    if not path.is_file():
        raise ConfigError(f"dist.deepspeed_config={name!r}: no such file (a path, or one of "
                          f"{sorted(p.name for p in (CONF_DIR / 'deepspeed').glob('*.json'))})")
    try:
        ds = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"dist.deepspeed_config={str(path)!r}: not JSON ({e})") from None
    zero = ds.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("overlap_comm") == "auto":
        zero["overlap_comm"] = world_size > 1
        log.info("DeepSpeed zero_optimization.overlap_comm=%s (%d process(es))",
                 zero["overlap_comm"], world_size)
    fill = {("gradient_clipping",): clip if clip > 0 else 0.0,
            ("gradient_accumulation_steps",): grad_accum,
            ("train_micro_batch_size_per_gpu",): 1,
            ("bf16", "enabled"): bf16,
            ("zero_optimization", "stage"): dist_cfg.zero_stage}
    must = {("gradient_accumulation_steps",): "optim.grad_accum",
            ("train_micro_batch_size_per_gpu",): "1 (one packed batch per micro-step)",
            ("bf16", "enabled"): "train.param_dtype",
            ("zero_optimization", "stage"): "dist.zero_stage"}
    for keys, value in fill.items():
        node = ds
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        given = node.get(keys[-1], "auto")
        dotted = ".".join(keys)
        if given == "auto":
            node[keys[-1]] = value
        elif keys in must and given != value:
            raise ConfigError(f"{path}: {dotted}={given!r} but this run needs {value!r} (from "
                              f"{must[keys]}): set it to \"auto\" or change {must[keys]}")
        elif given != value:
            log.info("DeepSpeed %s=%r as given in %s (the config would set %r)", dotted, given,
                     path, value)
    # bf16: the engine steps inside the backward, where the trainer cannot stop it, so only
    # its own check (bf16.check_grad_overflow; some releases default it to false) keeps a
    # NaN/inf gradient out of the weights: absent is set true, false refused
    given = ds.setdefault("bf16", {}).setdefault("check_grad_overflow", True) if bf16 else True
    if given is not True:
        raise ConfigError(f"{path}: bf16.check_grad_overflow={given!r} but bf16 training needs "
                          f"true (DeepSpeed steps inside the backward: only its own check skips "
                          f"a NaN/inf gradient). Fix: set it to true or remove it")
    return ds


def launcher_conflict(dist_cfg, env=None) -> str | None:
    """A one-line reason when `accelerate launch`'s DeepSpeed flags disagree with the Hydra
    `dist` group (which decides the engine), else None."""
    env = _LAUNCH_ENV if env is None else env
    use = str(env.get("ACCELERATE_USE_DEEPSPEED", "")).lower() in ("1", "true", "yes")
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    ours = f"dist={'ddp' if dist_cfg.backend == DistBackend.ddp else f'zero{dist_cfg.zero_stage}'}"
    if use and dist_cfg.backend == DistBackend.ddp:
        want = f"dist=zero{stage}" if stage and stage.isdigit() else "dist=zero2"
        return (f"accelerate launch --use_deepspeed asks for DeepSpeed but {ours}: the Hydra dist "
                f"group picks the engine; add {want} (or launch without --use_deepspeed)")
    if use and stage and stage.isdigit() and int(stage) != dist_cfg.zero_stage:
        return (f"accelerate launch --zero_stage {stage} but {ours}: the Hydra dist group picks "
                f"the stage; add dist=zero{stage} (or drop --zero_stage)")
    if use and file and dist_cfg.deepspeed_config and \
            Path(file).resolve() != Path(dist_cfg.deepspeed_config).resolve():
        return (f"accelerate launch --deepspeed_config_file {file} but dist.deepspeed_config="
                f"{dist_cfg.deepspeed_config}: name one file, as dist.deepspeed_config={file}")
    if use and file and not dist_cfg.deepspeed_config:
        return (f"accelerate launch --deepspeed_config_file {file} is not read: pass it as "
                f"dist.deepspeed_config={file}")
    return None


def launcher_argv(pid: int | None = None) -> list[str]:
    """The arguments of `accelerate launch` that started process `pid` (its parent by default):
    what follows `launch` in the parent's command line; [] for any other parent (Linux)."""
    try:
        with open(f"/proc/{os.getppid() if pid is None else pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []
    for i, arg in enumerate(argv):
        if arg == "launch" and i and Path(argv[i - 1]).name == "accelerate" or \
                arg == "accelerate.commands.launch":
            return argv[i + 1:]
    return []


def dropped_processes(argv: list[str], env=None) -> str | None:
    """A one-line reason when `accelerate launch --cpu` was asked for several processes, of
    which it starts one (its --cpu launcher runs the script once, as a world of one), else
    None. argv: the arguments of `accelerate launch` (`launcher_argv`)."""
    env = os.environ if env is None else env
    if not argv or "WORLD_SIZE" in env or str(env.get("ACCELERATE_USE_CPU")).lower() != "true":
        return None
    from accelerate.commands.launch import launch_command_parser
    try:
        args, _ = launch_command_parser().parse_known_args(argv)
    except SystemExit:       # not arguments accelerate takes: not for this check to say
        return None
    n, nodes = args.num_processes or 1, args.num_machines or 1
    if not args.cpu or (n == 1 and nodes == 1):
        return None
    asked = f"--num_processes {n}" if nodes == 1 else f"--num_machines {nodes}"
    return (f"accelerate launch --cpu {asked} started one process, not {max(n, nodes)}: its --cpu "
            f"launcher runs the script once. Fix: ./launch.sh --cpu {n}, or "
            f"CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes {n} (CPU "
            f"processes over gloo); for one process drop {asked.split()[0]}")


#: the launcher's ACCELERATE_* environment, before an Accelerator of this process adds its own
_LAUNCH_ENV = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
_SINGLE_ENV: dict[str, str] = {}   # what `_single_process_env` set (undone between jobs)


def _single_process_env() -> None:
    """A process started without a launcher (`python train/main.py dist=zero1`, or a --multirun
    job) is rank 0 of 1: DeepSpeed needs that said in the environment, as torchrun says it."""
    import socket
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    for k, v in env.items():
        if k not in os.environ:
            os.environ[k] = _SINGLE_ENV[k] = v


def reset_accelerate_state() -> None:
    """Forget the accelerate (and DeepSpeed) state a previous job of this process left, so the
    jobs of one `--multirun` sweep can each pick their own engine (dist=ddp,zero1)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    if not (AcceleratorState._shared_state or PartialState._shared_state):
        return
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()                 # ZeRO-3's global config of job 0
    except ImportError:
        pass
    import torch.distributed as tdist
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() == 1:
        tdist.destroy_process_group()               # job 0's one-process DeepSpeed group
    for k in list(_SINGLE_ENV):
        os.environ.pop(k, None)
        del _SINGLE_ENV[k]
    for k in [k for k in os.environ if k.startswith("ACCELERATE_") and k not in _LAUNCH_ENV]:
        del os.environ[k]                           # set by job 0's Accelerator
    os.environ.update(_LAUNCH_ENV)
    log.info("accelerate state of the previous job reset")


#: DeepSpeed's shared-memory all-reduce for CPUs (its ShareMemCommBuilder op)
SHM_COMM_OP = "deepspeed_shm_comm"


def skip_shm_comm_op() -> None:
    """Marks DeepSpeed's shared-memory all-reduce op unavailable, so its communication backend
    falls back to torch.distributed's (gloo) collectives. DeepSpeed's CPU accelerator otherwise
    compiles that C++ op when it starts, with no output for minutes on a machine's first
    dist=zero* run; only DeepSpeed's inference all-reduce calls it, never ZeRO training."""
    import deepspeed.ops
    ops = deepspeed.ops.__compatible_ops__   # DeepSpeed's probe of its ops, kept in the module
    if ops.get(SHM_COMM_OP):
        ops[SHM_COMM_OP] = False
        log.info("DeepSpeed's %s op not built: ZeRO's collectives run over gloo", SHM_COMM_OP)


def build_accelerator(dist_cfg, optim_cfg, project_dir: str | Path, *, bf16: bool,
                      cpu_threads: int | None = None, log_with=None) -> Accelerator:
    """Accelerator for the `dist` group on whatever device this process has.

    optim_cfg: grad_accum and clip_grad_norm (DeepSpeed applies them itself); bf16: the
    parameters are bf16 (`Resolved.param_dtype`); cpu_threads: train.cpu_threads."""
    conflict = launcher_conflict(dist_cfg) or dropped_processes(launcher_argv())
    if conflict:
        raise ConfigError(conflict)
    reset_accelerate_state()
    on_cpu = not fast_device()
    deepspeed = dist_cfg.backend == DistBackend.deepspeed
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if deepspeed and dist_cfg.zero_stage == 3 and world_size < 2:
        raise ConfigError("dist=zero3 with 1 process: expected 2 or more processes (ZeRO-3 "
                          "partitions the parameters across processes; one process has nothing "
                          "to partition and its backward fails). Fix: dist=zero2 or dist=ddp for "
                          "one process, or launch several (./launch.sh --gpus N or --cpu N)")
    # wandb and deepspeed are imported only on the paths that use them (data/common/deps.py:
    # these checks, train/trackers.py's wandb artifact, train/step.py under ZeRO-3, and the ZeRO
    # checkpoint reader of models/serving/importer.py), so a broken or absent one costs only
    # those paths.
    if deepspeed:
        deps.require_deepspeed(f"dist=zero{dist_cfg.zero_stage} (dist.backend=deepspeed)",
                               "dist=ddp", MissingDependency)
    if log_with == "wandb" or (isinstance(log_with, (list, tuple)) and "wandb" in log_with):
        deps.require_wandb("tracker=wandb", "tracker=none", MissingDependency)
    kwargs = dict(
        gradient_accumulation_steps=optim_cfg.grad_accum,
        project_config=ProjectConfiguration(project_dir=str(project_dir),
                                            automatic_checkpoint_naming=False),
        log_with=log_with,
    )
    if deepspeed:
        ds = deepspeed_config(dist_cfg, optim_cfg.grad_accum, optim_cfg.clip_grad_norm, bf16=bf16,
                              world_size=world_size)
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds)
        _single_process_env()
        if on_cpu:
            skip_shm_comm_op()
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
