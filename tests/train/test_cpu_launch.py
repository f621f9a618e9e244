"""Launching on a CPU (real launches): a dist=zero* run starts without compiling any DeepSpeed
op (an empty torch extensions cache stays empty), and `accelerate launch --cpu` asked for
several processes, of which it starts one, is refused with the commands that start them."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "train" / "main.py")


def test_zero_on_a_cpu_builds_no_deepspeed_op(tmp_path):
    cache = tmp_path / "torch_extensions"
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", CUDA_VISIBLE_DEVICES="",
               TORCH_EXTENSIONS_DIR=str(cache))
    env.pop("EYAS_RUN_ID", None)
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, MAIN, "target=tiny_llama", "dist=zero1",
                        "train.dry_run=true", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads((run_dir / "ranks" / "rank0.json").read_text())["distributed_type"] \
        == "DEEPSPEED"
    assert not cache.exists() or list(cache.rglob("*.so")) == [], list(cache.rglob("*"))
    assert "built successfully" not in r.stdout + r.stderr
    assert "DeepSpeed's deepspeed_shm_comm op not built" in r.stderr


def test_accelerate_launch_cpu_with_several_processes_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts one process: the trainer says so and
    stops (status 2) before it claims a run directory."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", CUDA_VISIBLE_DEVICES="")
    env.pop("EYAS_RUN_ID", None)
    run_dir = tmp_path / "run"
    exit_file = tmp_path / "status"
    r = subprocess.run([str(Path(sys.executable).parent / "accelerate"), "launch", "--cpu",
                        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                        "--dynamo_backend", "no", "--quiet", MAIN, "target=tiny_llama",
                        "train.dry_run=true", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                       env=dict(env, EYAS_EXIT_FILE=str(exit_file)), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and exit_file.read_text() == "2\n", r.stderr[-4000:]
    lines = [line for line in r.stderr.splitlines() if "bad configuration" in line]
    assert len(lines) == 1, r.stderr[-4000:]
    assert lines[0].endswith(
        "bad configuration: accelerate launch --cpu --num_processes 2 started one process, "
        "not 2: its --cpu launcher runs the script once. Fix: ./launch.sh --cpu 2, or "
        "CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu --num_processes 2 (CPU processes "
        "over gloo); for one process drop --num_processes"), lines[0]
    assert not (run_dir / "ranks").exists()


def test_only_a_cpu_launch_asked_for_several_processes_is_refused():
    from eyas.train.dist import dropped_processes
    env = {"ACCELERATE_USE_CPU": "True"}
    script = ["train/main.py", "x=1"]
    assert "--num_processes 4 started one process, not 4" in dropped_processes(
        ["--cpu", "--num_processes=4", *script], env)
    assert "--num_machines 2 started one process, not 2" in dropped_processes(
        ["--cpu", "--num_machines", "2", *script], env)
    for argv in (["--cpu", *script], ["--cpu", "--num_processes", "1", *script],
                 ["--multi_gpu", "--num_processes", "2", *script], []):
        assert dropped_processes(argv, env) is None, argv
    assert dropped_processes(["--cpu", "--num_processes", "2", *script], {}) is None
    assert dropped_processes(["--cpu", "--num_processes", "2", *script],
                             dict(env, WORLD_SIZE="2")) is None
