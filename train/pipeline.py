"""The main job's stages, in the order `train/main.py` runs them (`STAGES`):

    dataset          the hidden-state datasets: rank 0 builds them, the other ranks find them
    train            the drafter trained and exported (every rank; `train.trainer`)
    speculative      real speculative decoding of held-out prompts with the export
    engines          vLLM's and SGLang's own loaders load the export, where their venvs exist
    served           a real engine serves the export and counts acceptance (eval.engine_serve)
    heldout_offline  the offline walk on the held-out prompts' own answers

A stage is a function of the `Job` that returns what it found for summary.json. The checks
after training run on rank 0 once there is an export; `engines` and `served` are checks of the
export, not part of training, so their failure is a warning. The datasets the job builds itself
(the embedded default, the held-out answers) are `data.produce.recipe`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eyas.data.produce.recipe import (DatasetPaths, embedded_dataset, heldout_dataset,
                                      heldout_length, heldout_prompts)
from eyas.train.config import ConfigError, DataConfig, EvalConfig, TargetConfig

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One run's config, resolutions and accelerator, and what its stages found so far."""
    cfg: Any
    resolved: Any
    accelerator: Any
    found: dict = field(default_factory=dict)
    datasets: DatasetPaths | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Job], dict | None]
    every_rank: bool = False   # else rank 0 only, once training has exported a drafter
    optional: bool = False     # a check of the export: its failure is logged, not raised


def _dataset(job: Job) -> dict:
    cfg, acc = job.cfg, job.accelerator

    def find() -> DatasetPaths:
        return ensure_dataset(cfg.data, cfg.target, seed=cfg.train.seed,
                              target_dtype=job.resolved.target_dtype, run_dir=Path(cfg.output_dir))
    if acc.is_main_process:
        job.datasets = find()
    acc.wait_for_everyone()
    if not acc.is_main_process:
        job.datasets = find()      # built by rank 0: only resolves its paths
    return {"dataset": str(job.datasets.train)}


def _train(job: Job) -> dict:
    from eyas.train import trainer
    return trainer.train(job.cfg, job.resolved, job.accelerator, job.datasets)


def _speculative(job: Job) -> dict | None:
    """Real greedy speculative decoding of drafter.ttt_steps drafts per round with the target
    on held-out prompts."""
    cfg = job.cfg
    if not cfg.eval.speculative:
        return None
    from eyas.train.evaluate.offline import speculative_eval
    spec = speculative_eval(job.found["export"], cfg.target.name, heldout_prompts(cfg.eval),
                            k=cfg.drafter.ttt_steps, num_prompts=cfg.eval.num_prompts,
                            max_new_tokens=cfg.eval.max_new_tokens,
                            device=eval_device(cfg.eval), processes=cfg.eval.processes)
    if spec:
        log.info("speculative decoding on held-out prompts: tau %.3f, %d target forwards for "
                 "%d tokens, identical to greedy: %s", spec["tau"], spec["target_forwards"],
                 spec["tokens_generated"], spec["tokens_identical"])
    return {"speculative": spec} if spec else None


def _engines(job: Job) -> dict | None:
    """The export loaded by vLLM's and SGLang's own loaders, if their venvs already exist:
    {engine: verdict} ("ok", or the first finding's code); nothing when neither venv is
    installed (`eyas engines setup` creates them; the main job never builds them itself)."""
    if not job.cfg.eval.engines:
        return None
    from eyas.data.engine.venvs import ENGINES, ready_info, venv_dir
    present = [e for e in ENGINES if ready_info(venv_dir(e))]
    if not present:
        log.info("engine check skipped: no engine venvs (create them with `eyas engines setup`)")
        return None
    from eyas.models.serving.loaders import check_engines
    from eyas.data.common.targets import load_target_config
    reports = check_engines(job.found["export"], load_target_config(job.cfg.target.name),
                            engines=present, setup=False)
    return {"engines": {e: ("ok" if r.ok else (r.findings[0].code if r.findings else "failed"))
                        for e, r in reports.items()}}


def _served(job: Job) -> dict | None:
    from eyas.train.evaluate.engine import run_engine_serve
    cfg = job.cfg
    served = run_engine_serve(cfg.eval, cfg.target.name, job.found["export"],
                              job.found.get("speculative"), k=cfg.drafter.ttt_steps,
                              prompts_file=heldout_prompts(cfg.eval))
    return {"served": served} if served else None


def _heldout_offline(job: Job) -> dict | None:
    cfg = job.cfg
    off = run_heldout_offline(cfg.eval, cfg.data, cfg.target, job.found["export"],
                              k=cfg.drafter.ttt_steps)
    if off:
        log.info("offline decoder walk on the held-out answers: %s (%d chain starts)",
                 heldout_walk_text(off), off["chain_starts"])
    return {"heldout_offline": off} if off else None


STAGES = (Stage("dataset", _dataset, every_rank=True), Stage("train", _train, every_rank=True),
          Stage("speculative", _speculative), Stage("engines", _engines, optional=True),
          Stage("served", _served, optional=True), Stage("heldout_offline", _heldout_offline))


def heldout_walk_text(off: dict) -> str:
    """"tau X" for the held-out walk; with answers longer than the real check's, also the walk
    within their first eval.max_new_tokens tokens."""
    text = f"tau {off['tau_trajectory']:.3f}"
    if off.get("tau_trajectory_capped") is not None:
        text += (f" over answers of up to {off['max_new_tokens']} tokens, "
                 f"{off['tau_trajectory_capped']:.3f} within their first {off['walk_cap']}")
    return text


def ensure_dataset(data: DataConfig, target: TargetConfig, *, seed: int, target_dtype,
                   run_dir: Path | None = None) -> DatasetPaths:
    """The hidden-state dataset(s) this run trains and evaluates on; refused when rendered with
    another chat template than the target serves (`templates.template_mismatch`). With
    data.stream, `tokens` names what the trainer captures `train` from (train/streaming.py)."""
    from eyas.train.streaming import settle, stream_source
    streamed = stream_source(data, run_dir)     # data.stream from data.tokens, else None
    paths = None if streamed is None else DatasetPaths(**streamed)
    if paths is None and data.dataset:
        train_dir = Path(data.dataset).expanduser()
        if not (train_dir / "manifest.json").is_file():
            raise FileNotFoundError(f"data.dataset={train_dir}: no manifest.json there; write one "
                                    f"with `eyas extract --tokens DIR --target MODEL --out DIR`")
        eval_dir = Path(data.eval_dataset).expanduser() if data.eval_dataset else None
        paths = DatasetPaths(train=train_dir, eval=eval_dir)
    elif paths is None:
        paths = embedded_dataset(data, target, seed=seed, target_dtype=target_dtype)
    from eyas.data.common.templates import template_mismatch
    paths = settle(paths, data, run_dir)
    for key, d in (("data.dataset", paths.train), ("data.eval_dataset", paths.eval),
                   ("data.tokens", paths.tokens)):
        why = d and (d / "manifest.json").is_file() and template_mismatch(
            d, target.name, f"{key}={d}", after=" and extract again")
        if why:
            raise ConfigError(why)
    return paths


def eval_device(eval_cfg: EvalConfig) -> str:
    """eval.target_device with "auto" decided: the GPU when there is one."""
    if eval_cfg.target_device != "auto":
        return eval_cfg.target_device
    from eyas.data.common.targets import default_device
    return default_device().type


def run_heldout_offline(eval_cfg: EvalConfig, data: DataConfig, target: TargetConfig,
                        export_dir: str | Path, *, k: int) -> dict | None:
    """The export's offline acceptance on the held-out prompts' own greedy answers (rank 0,
    `data.produce.recipe.heldout_dataset`), then `offline_eval`; with answers longer than
    eval.max_new_tokens (eval.heldout_max_new_tokens) the walk within each answer's first
    eval.max_new_tokens tokens too."""
    if not eval_cfg.heldout_offline:
        return None
    from eyas.train.evaluate.offline import offline_eval
    device = eval_device(eval_cfg)
    hidden = heldout_dataset(eval_cfg, data, target, device)
    length = heldout_length(eval_cfg)
    cap = eval_cfg.max_new_tokens if length > eval_cfg.max_new_tokens else None
    res = offline_eval(export_dir, hidden, k=k, token_budget=data.token_budget, device=device,
                       target=target.name, cache_dir=data.cache_dir, walk_cap=cap)
    keep = ("tau", "tau_trajectory", "tau_trajectory_capped", "chain_starts", "num_samples",
            "dataset")
    out = {key: res[key] for key in keep if key in res}
    out["max_new_tokens"] = length
    if cap is not None:
        out["walk_cap"] = cap
    return out
