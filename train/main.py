"""eyas training entry point: `accelerate launch train/main.py [hydra overrides]`.

With no overrides this runs the embedded default end to end on a CPU: SmolLM2-135M-Instruct
answers the shipped prompts, its hidden states are extracted, a drafter is trained, exported
in the layout vLLM and SGLang load, and evaluated. The last lines printed are
`export: <dir>` and `tau: <offline acceptance length>`.

Examples:
    accelerate launch train/main.py train.max_steps=200
    accelerate launch train/main.py target=tiny_llama dist=zero2 tracker=wandb
    python train/main.py --multirun optim.lr=1e-4,3e-4      # one job per value
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from eyas.train.config import ConfigError, check, register
from eyas.train.log import setup_logging

log = logging.getLogger("eyas")

register()


def run(cfg: DictConfig) -> dict:
    """The whole job for one composed config; returns the final summary."""
    from eyas.train import pipeline
    from eyas.train.dist import build_accelerator

    check(cfg)
    out = Path(cfg.output_dir)
    tracker = str(getattr(cfg.tracker.kind, "value", cfg.tracker.kind))
    accelerator = build_accelerator(cfg, out, log_with="wandb" if tracker == "wandb" else None)
    setup_logging(rank=accelerator.process_index)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    log.info("run dir %s; world size %d", out, accelerator.num_processes)

    summary: dict = {"world_size": accelerator.num_processes,
                     "distributed_type": accelerator.distributed_type.value,
                     "output_dir": str(out)}
    _write_rank_record(out, accelerator, cfg)
    if cfg.train.dry_run:
        accelerator.wait_for_everyone()
        return summary
    if accelerator.is_main_process:
        datasets = pipeline.ensure_dataset(cfg)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        datasets = pipeline.ensure_dataset(cfg)  # cached by now: only resolves paths
    summary["dataset"] = str(datasets.train)
    result = pipeline.run_training(cfg, accelerator, datasets)
    summary.update(result)
    if accelerator.is_main_process and summary.get("export"):
        spec = pipeline.run_speculative_check(cfg, summary["export"])
        try:
            summary["engines"] = pipeline.run_engine_check(cfg, summary["export"])
        except Exception as e:  # the engines are a check, not part of training
            log.warning("engine check could not run: %s", e)
        if spec:
            summary["speculative"] = spec
            log.info("speculative decoding on held-out prompts: tau %.3f, %d target forwards "
                     "for %d tokens, identical to greedy: %s", spec["tau"],
                     spec["target_forwards"], spec["tokens_generated"], spec["tokens_identical"])
    accelerator.end_training()
    return summary


def _write_rank_record(out: Path, accelerator, cfg: DictConfig) -> None:
    """ranks/rank<r>.json: what each process saw (tests assert the world size from these)."""
    import json
    rank_dir = out / "ranks"
    accelerator.wait_for_everyone()  # rank 0 created `out`
    rank_dir.mkdir(parents=True, exist_ok=True)
    record = {"rank": accelerator.process_index, "world_size": accelerator.num_processes,
              "distributed_type": accelerator.distributed_type.value,
              "device": str(accelerator.device), "run_name": cfg.run_name}
    (rank_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    setup_logging()
    try:
        summary = run(cfg)
    except ConfigError as e:
        log.error("bad configuration: %s", e)
        raise SystemExit(2) from None
    from eyas.train.log import current_rank
    if current_rank() == 0:
        if summary.get("export"):
            print(f"export: {summary['export']}")
        if summary.get("speculative"):
            spec = summary["speculative"]
            print(f"speculative: tau {spec['tau']:.3f} on held-out prompts, identical to greedy: "
                  f"{spec['tokens_identical']}")
        if summary.get("tau") is not None:
            walk = summary.get("tau_trajectory")
            print(f"tau: {summary['tau']:.3f}" + (f" (decoder walk {walk:.3f})"
                                                   if walk is not None else ""))
        if summary.get("engines"):
            print("engines: " + " ".join(f"{e}={v}" for e, v in summary["engines"].items()))


if __name__ == "__main__":
    main()
