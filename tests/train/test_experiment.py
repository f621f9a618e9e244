"""The SmolLM2 quality recipe as one Hydra job (`+experiment=smollm2_quality`): the composed
config is the recipe's, and the job, shrunk, runs synthesize → generate → extract → train →
evaluate (real decoding and the held-out offline walk), then continues when run again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from eyas.train.config import load, register

ROOT = Path(__file__).resolve().parents[2]


def _experiment(name: str):
    """The checked config of `+experiment=<name>`."""
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        composed = compose(config_name="config", overrides=[f"+experiment={name}"])
    composed.output_dir = "unused"
    return load(composed)


def test_the_experiment_composes_the_quality_recipe():
    cfg = _experiment("smollm2_quality")
    assert cfg.target.name == "smollm2" and cfg.run_name == "smollm2-quality"
    assert (cfg.data.synthetic_prompts, cfg.data.synthetic_opener_words,
            cfg.data.max_new_tokens, cfg.data.token_budget) == (60000, 2, 128, 16384)
    assert (cfg.drafter.ttt_steps, cfg.drafter.draft_vocab_size,
            cfg.drafter.intermediate_size) == (7, 32000, 6144)
    assert (cfg.drafter.norm_before_fc, cfg.drafter.fc_norm, cfg.drafter.norm_output) == \
        (True, True, False)
    assert (cfg.optim.lr, cfg.loss.step_weight, cfg.train.epochs, cfg.train.resume) == \
        (3e-3, 0.6, 9, "latest")
    assert (cfg.eval.num_prompts, cfg.eval.max_new_tokens, cfg.eval.heldout_offline,
            cfg.eval.heldout_max_new_tokens) == (64, 128, True, 384)


def test_the_gpu_default_composes_its_recipe():
    """What `./launch.sh` with no arguments runs on a GPU machine."""
    cfg = _experiment("gpu_default")
    assert cfg.target.name == "smollm2"
    assert (cfg.data.synthetic_prompts, cfg.data.synthetic_opener_words,
            cfg.data.max_new_tokens, cfg.data.token_budget) == (12000, 2, 192, 16384)
    assert (cfg.drafter.draft_vocab_size, cfg.drafter.intermediate_size) == (32000, 3072)
    assert (cfg.drafter.norm_before_fc, cfg.drafter.fc_norm, cfg.drafter.norm_output) == \
        (True, True, False)
    assert (cfg.optim.lr, cfg.train.epochs) == (3e-3, 8)
    assert (cfg.eval.num_prompts, cfg.eval.processes, cfg.eval.max_new_tokens,
            cfg.eval.heldout_offline, cfg.eval.speculative) == (64, 8, 128, True, True)


def _job(tmp_path, *extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    env.pop("TRITON_INTERPRET", None)
    args = [sys.executable, str(ROOT / "train" / "main.py"), "+experiment=smollm2_quality",
            f"data.cache_dir={tmp_path}/cache", "data.num_prompts=6", "data.synthetic_prompts=2",
            "data.max_new_tokens=16", "data.generation_batch_size=8", "data.token_budget=256",
            "drafter.draft_vocab_size=2048", "drafter.intermediate_size=256",
            "drafter.ttt_steps=3", "train.eval_every=0", "train.save_every=2", "train.log_every=1",
            "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.heldout_max_new_tokens=12",
            "eval.engines=false",
            f"hydra.run.dir={tmp_path}/run", *extra]
    log = tmp_path / "run" / "train.log"
    before = log.stat().st_size if log.exists() else 0      # a resumed run appends to it
    r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    return r.stdout.strip().splitlines(), log.read_bytes()[before:].decode()


@pytest.mark.slow
def test_the_experiment_runs_every_stage_and_continues(tmp_path):
    lines, log = _job(tmp_path, "train.max_steps=2")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2
    off, spec = summary["heldout_offline"], summary["speculative"]
    assert off["num_samples"] == 2 and off["chain_starts"] > 0
    assert (off["max_new_tokens"], off["walk_cap"]) == (12, 8)
    assert f"held-out walk: tau {off['tau_trajectory']:.3f} over answers of up to 12 " \
        f"tokens, {off['tau_trajectory_capped']:.3f} within their first 8 " \
        f"(decoder walk on the held-out prompts' own answers)" in lines
    assert spec["num_prompts"] == 2 and spec["tokens_identical"] is True
    stages = summary["stage_seconds"]   # what each stage cost, also logged on one line
    assert set(stages) == {"dataset", "train", "speculative", "engines", "served",
                           "heldout_offline"}
    assert all(stages[k] > 0 for k in ("dataset", "train", "speculative", "heldout_offline"))
    assert stages["engines"] >= 0 and "stages: dataset " in log
    # 6 shipped + 2 synthetic prompts answered; the held-out answers cached apart
    (conv,) = (tmp_path / "cache" / "datasets").glob("*/conversations.jsonl")
    assert len(conv.read_text().splitlines()) == 8
    (held,) = (tmp_path / "cache" / "heldout").glob("*/hidden/manifest.json")
    assert json.loads(held.read_text())["n_samples"] == 2

    # the same command with a longer schedule: every data stage is read, training continues
    lines2, log2 = _job(tmp_path, "train.max_steps=4")
    summary2 = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary2["steps"] == 4
    assert "embedded dataset: cached at" in log2 and "held-out offline check: answering" not in log2
    resumed = f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step-000002'} (step 2)"
    assert log2.count(resumed) == 1                   # not "no checkpoint ...; starting fresh"
    assert summary2["heldout_offline"]["num_samples"] == 2
