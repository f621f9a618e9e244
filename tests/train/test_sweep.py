"""A --multirun sweep ends with the table of its jobs' τ and loss (train/sweep.py), and each
job's log has the launcher's line for it."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eyas.train.plots import read_records

ROOT = Path(__file__).resolve().parents[2]


def _sweep(tmp_path, dataset, *overrides):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    args = ["--multirun", "optim.lr=1e-4,3e-3", "target=tiny_llama", f"data.dataset={dataset}",
            "train.max_steps=2", "train.log_every=1", "drafter.attention=eager",
            "drafter.ttt_steps=2", "drafter.draft_vocab_size=1024", "data.token_budget=256",
            "data.num_workers=1", "data.eval_fraction=0.1", "eval.speculative=false",
            "eval.engines=false", "export.enabled=false", f"hydra.sweep.dir={tmp_path}/s",
            *overrides]
    return subprocess.run([sys.executable, str(ROOT / "train" / "main.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=400, env=env)


@pytest.mark.slow
def test_multirun_writes_the_table_of_tau_and_loss(tmp_path, tiny_llama_dataset):
    r = _sweep(tmp_path, tiny_llama_dataset)
    assert r.returncode == 0, r.stderr[-4000:]
    sweep = tmp_path / "s"
    record = json.loads((sweep / "sweep.json").read_text())
    assert record["swept"] == ["optim.lr"]
    rows = record["jobs"]
    assert [row["job"] for row in rows] == [0, 1]
    for row, lr in zip(rows, ("optim.lr=0.0001", "optim.lr=0.003")):
        job = sweep / row["dir"]
        summary = json.loads((job / "summary.json").read_text())
        train = [x["train/loss"] for x in read_records(job / "metrics.jsonl") if "train/loss" in x]
        assert lr in row["overrides"] and row["steps"] == summary["steps"] == 2
        assert row["tau"] == summary["tau"] and row["tau_walk"] == summary["tau_trajectory"]
        assert row["eval_loss"] == summary["eval"]["loss"] and row["train_loss"] == train[-1]
        assert row["tau_speculative"] is None           # eval.speculative=false
    best = max(rows, key=lambda x: x["tau"])
    assert record["best_job"] == best["job"]
    with open(sweep / "sweep.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [t["overrides"] for t in table] == ["optim.lr=0.0001", "optim.lr=0.003"]
    assert [float(t["tau"]) for t in table] == [row["tau"] for row in rows]
    assert [float(t["train_loss"]) for t in table] == [row["train_loss"] for row in rows]
    md = (sweep / "sweep.md").read_text()
    assert md in r.stdout                                 # printed at the end of the sweep
    assert md.splitlines()[2].startswith(f"| 0 | optim.lr=0.0001 | 2 | "
                                         f"{rows[0]['train_loss']:.4g} | ")
    assert (sweep / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the launcher's line of each job: on the console, and in that job's train.log only
    for n in (0, 1):
        assert f"#{n} : optim.lr=" in r.stderr
    log0, log1 = ((sweep / str(n) / "train.log").read_text() for n in (0, 1))
    assert "#0 : optim.lr=0.0001" in log0 and "#1 :" not in log0
    assert "#1 : optim.lr=0.003" in log1 and "#0 :" not in log1


def test_dry_run_sweep_keeps_a_row_per_job_without_figures(tmp_path):
    """A --multirun runs one job per value, and its table keeps a row for each."""
    r = subprocess.run([sys.executable, str(ROOT / "train" / "main.py"), "--multirun",
                        "train.dry_run=true", "optim.lr=1e-4,3e-4",
                        f"hydra.sweep.dir={tmp_path}/s"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted((tmp_path / "s").glob("*/config.resolved.yaml"))
    assert len(jobs) == 2
    lrs = sorted(OmegaConf.load(j).optim.lr for j in jobs)
    assert lrs == [1e-4, 3e-4]
    record = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [(x["job"], x["overrides"], x["tau"], x["train_loss"]) for x in record["jobs"]] == [
        (0, ["train.dry_run=True", "optim.lr=0.0001"], None, None),
        (1, ["train.dry_run=True", "optim.lr=0.0003"], None, None)]
    assert record["swept"] == ["optim.lr"] and record["best_job"] is None
    assert not (tmp_path / "s" / "sweep.png").exists()     # nothing to draw
    assert "| 1 | optim.lr=0.0003 | – | – | – | – | – | – | 1 |" in r.stdout
    assert "#0 : train.dry_run=True optim.lr=0.0001" in r.stderr
