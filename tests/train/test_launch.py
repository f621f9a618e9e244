"""Real multi-process launches on CPU (gloo): the world size must really be what was asked."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def _env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    env.pop("TRITON_INTERPRET", None)
    return env


def test_two_process_ddp_composes_on_both_ranks(tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
         str(ROOT / "train" / "main.py"), "train.dry_run=true", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    records = [json.loads((run_dir / "ranks" / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert [rec["rank"] for rec in records] == [0, 1]
    assert all(rec["world_size"] == 2 for rec in records)
    assert all(rec["distributed_type"] == "MULTI_CPU" for rec in records)


def test_launch_sh_help_explains_itself():
    r = subprocess.run(["bash", str(ROOT / "launch.sh"), "--help"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0
    for word in ("--gpus", "--cpu", "--nodes", "dist=zero2", "Hydra"):
        assert word in r.stdout
