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


def _launch(*args, cwd, timeout=300):
    env = _env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["bash", str(ROOT / "launch.sh"), "--no-venv", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_launch_sh_gpus_0_runs_on_the_cpu(tmp_path):
    r = _launch("--gpus", "0", "train.dry_run=true", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    rec = json.loads((tmp_path / "run" / "ranks" / "rank0.json").read_text())
    assert rec["world_size"] == 1 and rec["device"] == "cpu"
    assert (tmp_path / "run" / "train.log").is_file()


def test_launch_sh_passes_the_trainers_exit_status_through(tmp_path):
    r = _launch("--gpus", "0", "train.dry_run=true", "optim.lr=-1",
                f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-4000:]
    assert "Traceback" not in r.stderr and "CalledProcessError" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if "optim.lr" in line and " E " in line]
    assert len(errors) == 1 and "bad configuration" in errors[0], r.stderr
    # a Hydra override that names no field: a usage error too, before any job starts
    r = _launch("--gpus", "0", "optim.no_such_field=1", f"hydra.run.dir={tmp_path}/run2",
                cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-4000:]
    # launch.sh's own options
    for bad in (["--gpus", "x"], ["--gpus"], ["--cpu", "0"]):
        r = _launch(*bad, cwd=tmp_path, timeout=30)
        assert r.returncode == 2 and r.stderr.startswith("launch.sh: "), (bad, r.stderr)
