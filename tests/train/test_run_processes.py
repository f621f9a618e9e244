"""Run directories against real training processes: a live run is never joined by a second
training (resumed or not), a reused run id is refused and `train.overwrite=true` clears the
old run, `kill -9` of a launcher's process group leaves no rank running, and `kill -9` of one
rank ends the job, which a resume then finishes as an uninterrupted run would."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eyas.data.common.lock import lock_path

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "train" / "main.py")
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
TINY = ["target=tiny_llama", "drafter.attention=eager", "drafter.ttt_steps=2",
        "drafter.draft_vocab_size=256", "data.token_budget=256", "data.num_workers=1",
        "data.eval_fraction=0.1", "eval.speculative=false", "eval.engines=false"]
BOUND = 120  # seconds any wait below may take at most (a bound, not a timing)


def _env(**extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    env.pop("EYAS_RUN_ID", None)
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _wait_for(what, check):
    deadline = time.monotonic() + BOUND
    while not check():
        assert time.monotonic() < deadline, f"not within {BOUND} s: {what}"
        time.sleep(0.2)


def _train(cwd, *overrides, env=None, timeout=600):
    return subprocess.run([sys.executable, MAIN, *TINY, *overrides], cwd=cwd,
                          env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _start(cmd, cwd, env):
    """A launcher in a process group (and session) of its own, as a shell starts a job."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _ranks(run_dir: Path, n: int) -> list[int]:
    files = [run_dir / "ranks" / f"rank{r}.json" for r in range(n)]
    _wait_for(f"{n} rank record(s) in {run_dir}", lambda: all(f.is_file() for f in files))
    return [json.loads(f.read_text())["pid"] for f in files]


def _kill_group(launcher, pids=()):
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait()


@pytest.mark.slow
def test_a_second_training_in_a_live_run_is_refused_naming_it(tmp_path, tiny_llama_dataset):
    run_dir = tmp_path / "runs" / "r"
    first = _start([sys.executable, MAIN, *TINY, f"data.dataset={tiny_llama_dataset}",
                    "run_name=r", "train.max_steps=100000", "export.enabled=false"],
                   tmp_path, _env())
    try:
        (pid,) = _ranks(run_dir, 1)
        assert json.loads(lock_path(run_dir).read_text())["pid"] == pid
        for extra in ("train.resume=latest", "train.overwrite=true"):
            r = _train(tmp_path, f"data.dataset={tiny_llama_dataset}", "run_name=r", extra)
            assert r.returncode == 2, r.stderr[-3000:]
            errors = [line for line in r.stderr.splitlines() if " E eyas" in line]
            assert len(errors) == 1 and f"pid {pid} on host" in errors[0], r.stderr[-3000:]
            assert "being written by another process" in errors[0]
        assert first.poll() is None  # untouched: still training
    finally:
        _kill_group(first)


@pytest.mark.slow
def test_a_reused_run_id_is_refused_and_overwrite_clears_the_old_run(tmp_path,
                                                                    tiny_llama_dataset):
    env = _env(EYAS_RUN_ID="r1")
    data = f"data.dataset={tiny_llama_dataset}"
    run_dir = tmp_path / "runs" / "r1"
    r = _train(tmp_path, data, "train.max_steps=6", "train.save_every=2", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = run_dir / "checkpoints"
    assert (ck / "latest").read_text() == "step-000006"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    r = _train(tmp_path, data, "train.max_steps=2", env=env)
    assert r.returncode == 2 and f"the run directory {run_dir} is not empty" in r.stderr
    assert "(latest step-000006)" in r.stderr and "train.overwrite=true" in r.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    r = _train(tmp_path, data, "train.max_steps=2", "train.save_every=2",
               "train.overwrite=true", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-000002"]
    assert (ck / "latest").read_text() == "step-000002"
    steps = [json.loads(line).get("step") for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps and max(s for s in steps if s is not None) == 2
    assert not lock_path(run_dir).exists()


@pytest.mark.slow
def test_kill_9_of_the_launchers_group_leaves_no_rank(tmp_path, tiny_llama_dataset):
    run_dir = tmp_path / "run"
    cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           MAIN, *TINY, f"data.dataset={tiny_llama_dataset}", f"hydra.run.dir={run_dir}",
           "train.max_steps=100000", "export.enabled=false"]
    launcher = _start(cmd, tmp_path, _env(CUDA_VISIBLE_DEVICES=""))
    pids = []
    try:
        pids = _ranks(run_dir, 2)
        assert all(os.getsid(p) != os.getsid(launcher.pid) for p in pids)  # sessions of their own
        _kill_group(launcher, pids)
        _wait_for(f"ranks {pids} to exit after their launcher was killed",
                  lambda: not any(_alive(p) for p in pids))
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    # the run can be resumed at once: its lock is free (the dead rank 0's, stale)
    r = _train(tmp_path, f"data.dataset={tiny_llama_dataset}", f"hydra.run.dir={run_dir}",
               "train.resume=latest", "train.dry_run=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "taking over the stale lock of pid" in r.stderr


def _launch(run_dir: Path, port: int, *overrides) -> list[str]:
    return [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(port), MAIN, *TINY, f"hydra.run.dir={run_dir}", *overrides]


@pytest.mark.slow
def test_kill_9_of_one_rank_stops_the_job_and_a_resume_ends_as_an_unbroken_run(
        tmp_path, tiny_llama_dataset):
    """Two ranks over gloo; SIGKILL of rank 1 in the middle of the run: the launcher ends
    rank 0 and exits non-zero within the bound, naming the killed rank's signal; the same
    command with train.resume=latest then ends with the weights of a run never interrupted."""
    common = [f"data.dataset={tiny_llama_dataset}", "train.deterministic=true",
              "train.eval_every=0", "train.max_steps=40", "train.save_every=1",
              "train.keep_last=2"]
    env = _env(CUDA_VISIBLE_DEVICES="")
    whole = subprocess.run(_launch(tmp_path / "a", free_port(), *common), cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run_dir = tmp_path / "b"
    log = tmp_path / "b.log"
    with open(log, "w") as fh:
        launcher = subprocess.Popen(_launch(run_dir, free_port(), *common), cwd=tmp_path,
                                    env=env, start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=fh)
    pids = []
    try:
        pids = _ranks(run_dir, 2)
        latest = run_dir / "checkpoints" / "latest"
        _wait_for("the checkpoint of step 3", lambda: latest.is_file()
                  and latest.read_text().strip() >= "step-000003")
        os.kill(pids[1], signal.SIGKILL)
        launcher.wait(timeout=BOUND)
        _wait_for(f"rank 0 (pid {pids[0]}) to exit", lambda: not _alive(pids[0]))
    finally:
        _kill_group(launcher)
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    assert launcher.returncode != 0
    assert f"Signal 9 (SIGKILL) received by PID {pids[1]}" in log.read_text()
    killed_at = latest.read_text().strip()
    assert "step-000003" <= killed_at < "step-000040" and not (run_dir / "export").exists()
    resumed = subprocess.run(_launch(run_dir, free_port(), *common, "train.resume=latest"),
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    from safetensors.torch import load_file
    want = load_file(str(tmp_path / "a" / "export" / "model.safetensors"))
    got = load_file(str(run_dir / "export" / "model.safetensors"))
    assert want.keys() == got.keys() and len(want) > 5
    for name in want:
        assert torch.equal(want[name], got[name]), f"{name} differs after resume ({killed_at})"
