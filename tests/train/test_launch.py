"""Real multi-process launches on CPU (gloo): the world size must really be what was asked."""

import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
MAIN = str(ROOT / "train" / "main.py")


def _env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    env.pop("TRITON_INTERPRET", None)
    env.pop("EYAS_RUN_ID", None)  # the tests name their runs themselves, or test the default
    return env


def launch(cwd: Path, port: int, *overrides: str, nproc: int = 2):
    """A dry run (compose, start the processes, claim the run dir) of `nproc` processes."""
    cmd = [sys.executable, MAIN] if nproc == 1 else [
        ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(nproc), "--num_machines",
        "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
        str(port), MAIN]
    return subprocess.run([*cmd, "train.dry_run=true", *overrides], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=300)


def test_two_process_ddp_composes_on_both_ranks(tmp_path):
    run_dir = tmp_path / "run"
    r = launch(tmp_path, free_port(), f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-4000:]
    records = [json.loads((run_dir / "ranks" / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert [rec["rank"] for rec in records] == [0, 1]
    assert all(rec["world_size"] == 2 for rec in records)
    assert all(rec["distributed_type"] == "MULTI_CPU" for rec in records)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank*.json"))]


def test_two_process_launch_agrees_on_rank_0s_run_dir(tmp_path):
    # names to the microsecond: the two ranks compose different ones; rank 0's is the run's
    r = launch(tmp_path, free_port(), "run_name=${now:%Y%m%d-%H%M%S-%f}")
    assert r.returncode == 0, r.stderr[-4000:]
    dirs = list((tmp_path / "runs").iterdir())
    assert len(dirs) == 1, dirs  # the other rank's empty directory is gone
    records = _records(dirs[0])
    assert [x["output_dir"] for x in records] == [str(dirs[0])] * 2
    assert [x["run_name"] for x in records] == [dirs[0].name] * 2


@pytest.mark.slow
def test_two_process_launch_refuses_a_used_run_dir_on_every_rank(tmp_path):
    assert launch(tmp_path, free_port(), "run_name=r").returncode == 0
    run_dir = tmp_path / "runs" / "r"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    r = launch(tmp_path, free_port(), "run_name=r")
    assert r.returncode != 0
    # every rank refuses (rank 0's verdict, broadcast); rank 0 says so, once
    assert r.stderr.count(f"the run directory {run_dir} is not empty") == 1, r.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_runs_without_a_name_get_their_own_directories(tmp_path):
    for _ in range(2):
        r = launch(tmp_path, 0, nproc=1)
        assert r.returncode == 0, r.stderr[-4000:]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert len(dirs) == 2 and all(len(_records(d)) == 1 for d in dirs)


def test_launch_sh_help_explains_itself():
    r = subprocess.run(["bash", str(ROOT / "launch.sh"), "--help"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0
    for word in ("--gpus", "--cpu", "--nodes", "dist=zero2", "Hydra"):
        assert word in r.stdout


def _launch(*args, cwd, timeout=300, **env_vars):
    return subprocess.run(_launch_sh(*args), cwd=cwd, env=_sh_env(**env_vars),
                          capture_output=True, text=True, timeout=timeout)


def _launch_sh(*args) -> list[str]:
    return ["bash", str(ROOT / "launch.sh"), "--no-venv", *args]


def _sh_env(**env_vars) -> dict:
    env = _env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(env_vars)
    return env


def test_launch_sh_gpus_0_runs_on_the_cpu(tmp_path):
    r = _launch("--gpus", "0", "train.dry_run=true", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    rec = json.loads((tmp_path / "run" / "ranks" / "rank0.json").read_text())
    assert rec["world_size"] == 1 and rec["device"] == "cpu"
    assert (tmp_path / "run" / "train.log").is_file()


@pytest.mark.slow
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
    for bad in (["--gpus", "x"], ["--gpus"], ["--cpu", "0"],
                ["--cpu", "1", "--nodes", "2", "--node-rank", "2"]):
        r = _launch(*bad, cwd=tmp_path, timeout=30)
        assert r.returncode == 2 and r.stderr.startswith("launch.sh: "), (bad, r.stderr)


def test_launch_sh_checks_the_config_once_before_several_processes(tmp_path):
    run_dir = tmp_path / "run"
    r = _launch("--cpu", "2", "train.dry_run=true", "optim.lr=-1", f"hydra.run.dir={run_dir}",
                cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-4000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "bad configuration" in line]
    assert len(errors) == 1 and "optim.lr" in errors[0], r.stderr
    assert "accelerate launch" not in r.stderr  # no process was started
    assert not run_dir.exists() and not (tmp_path / ".hydra").exists()
    assert not (tmp_path / "runs").exists()


def test_launch_sh_a_refusal_inside_the_ranks_is_one_line_and_status_2(tmp_path):
    """A refusal the config check cannot see (here accelerate's DeepSpeed flag against
    dist=ddp, found when the ranks build their Accelerator): rank 0's one line is the last
    thing printed, with no report of a crash from torch's agent, and launch.sh exits 2 with
    nothing of the launch left running."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen(_launch_sh("--cpu", "2", "--master-port", str(free_port()),
                                    "train.dry_run=true", f"hydra.run.dir={run_dir}"),
                         cwd=tmp_path, env=_sh_env(ACCELERATE_USE_DEEPSPEED="true"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2, err[-4000:]
    lines = err.strip().splitlines()
    assert lines[-1].endswith(
        "E eyas: bad configuration: accelerate launch --use_deepspeed asks for DeepSpeed but "
        "dist=ddp: the Hydra dist group picks the engine; add dist=zero2 (or launch without "
        "--use_deepspeed)"), err[-4000:]
    assert sum("bad configuration" in line for line in lines) == 1, err[-4000:]
    for noise in ("ChildFailedError", "Traceback", "exitcode", "Killed", "elastic"):
        assert noise not in err, (noise, err[-4000:])
    assert _running_with(str(run_dir)) == []    # neither accelerate nor a rank
    assert not (run_dir / "ranks").exists()


def _running_with(arg: str) -> list[int]:
    """The live processes with `arg` in their command line (a zombie's is empty)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if arg.encode() in f.read():
                    found.append(int(pid))
        except FileNotFoundError:
            pass
    return found


def test_config_check_composes_like_the_job(tmp_path, monkeypatch, capsys):
    from eyas.train.main import precheck
    monkeypatch.chdir(tmp_path)
    assert precheck(["train.dry_run=true", f"hydra.run.dir={tmp_path}/run"]) == 0
    assert precheck(["optim.no_such_field=1"]) == 2
    assert "no_such_field" in capsys.readouterr().err
    assert precheck(["drafter.ttt_steps=0"]) == 2
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.slow
def test_two_nodes_of_one_cpu_process_train_as_one_node_of_two(tmp_path, tiny_llama_dataset):
    """launch.sh --nodes 2 --node-rank 0/1 (one CPU process each, node 0 at 127.0.0.1), as two
    hosts would start it: one world of two ranks, trained to the very weights of --cpu 2 on
    one node."""
    from safetensors.torch import load_file
    from tests.train.test_trainer import SMALL
    common = ["target=tiny_llama", *SMALL, f"data.dataset={tiny_llama_dataset}",
              "train.max_steps=4", "train.deterministic=true", "train.eval_every=0"]
    one = _launch("--cpu", "2", "--master-port", str(free_port()), *common,
                  f"hydra.run.dir={tmp_path}/one", cwd=tmp_path, EYAS_RUN_ID="one")
    assert one.returncode == 0, one.stderr[-4000:]
    port, env = free_port(), _sh_env(EYAS_RUN_ID="two")
    nodes = [subprocess.Popen(_launch_sh("--cpu", "1", "--nodes", "2", "--node-rank", str(r),
                                         "--master-addr", "127.0.0.1", "--master-port",
                                         str(port), *common, f"hydra.run.dir={tmp_path}/two"),
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    errs = [p.communicate(timeout=300)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert "--num_machines 2 --machine_rank 1" in errs[1]
    records = _records(tmp_path / "two")
    assert [(r["rank"], r["world_size"]) for r in records] == [(0, 2), (1, 2)]
    want = load_file(str(tmp_path / "one" / "export" / "model.safetensors"))
    got = load_file(str(tmp_path / "two" / "export" / "model.safetensors"))
    assert want.keys() == got.keys() and len(want) > 5
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_launch_sh_counts_the_gpus_cuda_visible_devices_lists(tmp_path):
    import re
    fn = re.search(r"^visible_gpus\(\) \{.*?^\}", (ROOT / "launch.sh").read_text(),
                   re.S | re.M).group(0)
    fake = tmp_path / "nvidia-smi"                 # four GPUs on the machine
    fake.write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: H200\"; done\n")
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    base["PATH"] = f"{tmp_path}:{base['PATH']}"
    for visible, count in ((None, 4), ("0,1", 2), ("2, 5 ,7", 3), ("", 0)):
        env = base if visible is None else dict(base, CUDA_VISIBLE_DEVICES=visible)
        r = subprocess.run(["bash", "-c", fn + "\nvisible_gpus"], env=env, capture_output=True,
                           text=True, timeout=30)
        assert r.stdout.strip() == str(count), (visible, r.stdout, r.stderr)


def test_accelerate_runs_in_a_group_of_its_own_that_ends_with_launch_sh():
    """launch.sh starts accelerate through `python -m eyas.data.common.parent` in the
    background: in a process group of its own (a signal to launch.sh reaches it once, through
    launch.sh), with SIGINT and SIGQUIT not ignored as a shell's background job would have
    them, and sent SIGTERM when launch.sh is killed (-9, so it cannot pass anything on)."""
    import signal
    import time
    script = f"{sys.executable} -m eyas.data.common.parent sleep 300 & echo $!; wait"
    p = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    child = int(p.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep\0"):
            assert time.monotonic() < deadline, "the wrapper did not exec its command"
            time.sleep(0.05)
        status = Path(f"/proc/{child}/status").read_text()
        ignored = int(status.split("SigIgn:")[1].split()[0], 16)
        assert not ignored & (1 << (signal.SIGINT - 1) | 1 << (signal.SIGQUIT - 1))
        assert os.getpgid(child) == child != os.getpgid(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        deadline = time.monotonic() + 30
        while child in _running_with("sleep\x00300"):
            assert time.monotonic() < deadline, "accelerate outlived launch.sh"
            time.sleep(0.05)
    finally:
        if child in _running_with("sleep\x00300"):
            os.kill(child, signal.SIGKILL)
