"""accelerate's trackers (`tracker.kind`: wandb, tensorboard, mlflow, aim, …): starting them
with the run's config, and what the main job logs at its end (real-decoding τ; the export as a
wandb artifact). The JSONL metrics file (`train.tracking`) is written whatever is chosen.

The trackers that write files write them into the run directory, where train/rundir.py finds
(and train.overwrite=true removes) them: tensorboard <run dir>/<tracker.project>/, aim .aim/,
wandb wandb/, dvclive dvclive/, and mlflow mlruns/ unless MLFLOW_TRACKING_URI names a store."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def flat_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"optim.lr": 1e-4, …}: scalars only (lists as text), what every tracker's hparams take."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        else:
            out[key] = v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
    return out


def _wandb_names(cfg, run_name: str) -> tuple[str | None, str | None]:
    from hydra.core.hydra_config import HydraConfig
    name, group = cfg.tracker.run_name, cfg.tracker.group
    try:
        hc = HydraConfig.get()
        if name is None:
            name = hc.job.override_dirname or run_name
        if group is None and str(hc.mode) == "RunMode.MULTIRUN":
            group = Path(hc.sweep.dir).name
    except ValueError:  # not under Hydra (tests, notebooks)
        name = name or run_name
    return name, group


def init_trackers(cfg, accelerator, out: Path) -> None:
    """Start the trackers of `tracker.kind` (the Accelerator was built with log_with=them)."""
    from eyas.train.config import to_plain
    kinds = list(cfg.tracker.kind)
    if not kinds:
        return
    init: dict[str, dict] = {}
    if "wandb" in kinds:
        name, group = _wandb_names(cfg, cfg.run_name)
        init["wandb"] = {"name": name, "group": group, "mode": cfg.tracker.mode.value,
                         "dir": str(out), "entity": cfg.tracker.entity}
    if "dvclive" in kinds:
        init["dvclive"] = {"dir": str(out / "dvclive")}
    if "mlflow" in kinds and not os.environ.get("MLFLOW_TRACKING_URI"):
        import mlflow  # its default store is the working directory's, not the run's
        mlflow.set_tracking_uri((out / "mlruns").absolute().as_uri())
    plain = to_plain(cfg)
    config = plain if kinds == ["wandb"] else flat_config(plain)
    accelerator.init_trackers(cfg.tracker.project, config=config, init_kwargs=init)
    log.info("trackers: %s", ", ".join(kinds))


def log_final(accelerator, cfg, summary: dict) -> None:
    """Rank 0, after summary.json is written: the real-decoding result to every tracker; with
    wandb, the export as an artifact. A tracker that fails is a warning naming it, not an error:
    the results are in summary.json already."""
    kinds = list(cfg.tracker.kind)
    if not kinds or not accelerator.is_main_process or cfg.train.dry_run:
        return
    spec = summary.get("speculative") or {}
    values = {f"speculative/{k}": spec[k] for k in ("tau", "speedup", "tokens_per_s",
                                                    "target_forwards", "tokens_generated")
              if isinstance(spec.get(k), (int, float)) and not isinstance(spec.get(k), bool)}
    for tracker in accelerator.trackers if values else ():
        try:
            tracker.log(values)
        except Exception as e:
            _failed(tracker.name, "the real-decoding result", e)
    if "wandb" in kinds and summary.get("export"):
        try:
            import wandb
            run = accelerator.get_tracker("wandb", unwrap=True)
            art = wandb.Artifact(f"drafter-{run.id}", type="model",
                                 metadata={"target": str(cfg.target.name), **values})
            art.add_dir(str(summary["export"]))
            run.log_artifact(art)
            log.info("wandb artifact %s logged", art.name)
        except Exception as e:
            _failed("wandb", "the export (as an artifact)", e)


def _failed(tracker: str, what: str, e: Exception) -> None:
    first = " ".join(str(e).split())[:200]
    log.warning("tracker %s could not log %s (%s: %s); summary.json has the results", tracker,
                what, type(e).__name__, first)
