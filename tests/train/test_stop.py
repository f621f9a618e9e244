"""SIGTERM during training: a checkpoint of the step it was in, exit 143, nothing that looks
finished; resuming gives the uninterrupted run's weights bit for bit (real processes)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.ports import free_port
from tests.train.test_trainer import SMALL, _cmd, _env, _export_tensors, assert_resumed, run

COMMON = ["target=tiny_llama", "train.max_steps=12", "train.deterministic=true",
          "train.eval_every=0", "train.save_every=0"]


def _start(run_dir, dataset, cmd, *overrides):
    run_dir.mkdir()
    args = [*cmd, *SMALL, f"data.dataset={dataset}", f"hydra.run.dir={run_dir}", *COMMON,
            *overrides]
    return subprocess.Popen(args, cwd=run_dir.parent, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _terminate_at_step(p, run_dir, step: int) -> tuple[str, str]:
    """SIGTERM to the whole process group once metrics.jsonl records `step`."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline:
        if metrics.is_file() and f'"step": {step},' in metrics.read_text():
            break
        if p.poll() is not None:
            pytest.fail("the run ended before it could be stopped: " + p.communicate()[1][-3000:])
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGTERM)
    return p.communicate(timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_saves_exits_143_and_resumes_bitwise(tmp_path, tiny_llama_dataset, nproc):
    run(tmp_path / "a", tiny_llama_dataset, *COMMON, nproc=nproc)
    b = tmp_path / "b"
    p = _start(b, tiny_llama_dataset, _cmd(nproc, free_port()))
    out, err = _terminate_at_step(p, b, 3)
    assert p.returncode == 143, err[-4000:]
    stopped = [line for line in err.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1, err[-4000:]          # rank 0 says it once
    assert "on SIGTERM: checkpoint saved in" in stopped[0]
    assert "the same command with run_name=" in stopped[0] and "train.resume=latest" in stopped[0]
    saved = (b / "checkpoints" / "latest").read_text().strip()
    assert f"stopped at step {int(saved.removeprefix('step-'))} of 12" in stopped[0]
    assert "step-000003" <= saved < "step-000012"
    assert not (b / "export").exists() and not (b / "summary.json").exists()
    r = run(b, tiny_llama_dataset, *COMMON, "train.resume=latest", nproc=nproc)
    assert_resumed(r, b, int(saved.removeprefix("step-")))
    ta, tb = _export_tensors(tmp_path / "a"), _export_tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 5
    for name in ta:
        assert torch.equal(ta[name], tb[name]), f"{name} differs after a stop at {saved}"


def test_outside_training_the_signals_keep_their_default_action():
    from eyas.train.stop import StopRequest, Stopped
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped), StopRequest() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        os.kill(os.getpid(), signal.SIGTERM)       # caught: a flag, not the end of pytest
        assert stop.signal == "SIGTERM"
        raise Stopped("as the loop does")
    assert signal.getsignal(signal.SIGTERM) == before
    assert Stopped.exit_status == 143


def test_a_signal_after_the_last_check_still_ends_the_process():
    code = ("import os, signal\n"
            "from eyas.train.stop import StopRequest\n"
            "with StopRequest():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('survived', flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == -signal.SIGTERM and "survived" not in r.stdout, r.stderr[-2000:]


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_both_at_the_next_log_boundary(tmp_path, tiny_llama_dataset):
    """Only rank 1 is signalled: the ranks agree at the next train.log_every step, rank 0 says
    so, and the resumed run still ends with the uninterrupted run's weights."""
    every = ["train.log_every=4"]
    run(tmp_path / "a", tiny_llama_dataset, *COMMON, *every, nproc=2)
    b = tmp_path / "b"
    p = _start(b, tiny_llama_dataset, _cmd(2, free_port()), *every)
    metrics = b / "metrics.jsonl"
    deadline = time.time() + 400
    while not (metrics.is_file() and '"step": 4,' in metrics.read_text()):
        assert time.time() < deadline and p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
    rank1 = json.loads((b / "ranks" / "rank1.json").read_text())["pid"]
    os.kill(rank1, signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    found = re.search(r"stopped at step (\d+) of 12 on another rank's signal", err)
    assert found, err[-4000:]
    step = int(found.group(1))
    # the first log boundary after the signal (the last step: 12); step 4's metrics line is
    # written before the ranks combine their flags at step 4, so a signal that reaches rank 1
    # before it gets there stops both at 4
    assert step in (4, 8, 12)
    assert (b / "checkpoints" / "latest").read_text().strip() == f"step-{step:06d}"
    assert not (b / "summary.json").exists()
    r = run(b, tiny_llama_dataset, *COMMON, *every, "train.resume=latest", nproc=2)
    assert_resumed(r, b, step)
    ta, tb = _export_tensors(tmp_path / "a"), _export_tensors(b)
    for name in ta:
        assert torch.equal(ta[name], tb[name]), f"{name} differs after a stop at step {step}"


def _in_session(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies are ended)."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:         # ended since the listing
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(d))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("nproc,sig", [(1, signal.SIGTERM), (2, signal.SIGTERM),
                                       (1, signal.SIGINT)])
def test_sigterm_to_launch_sh_alone_stops_the_whole_run(tmp_path, tiny_llama_dataset, nproc,
                                                        sig):
    """`kill PID` of launch.sh (not its group), or Ctrl-C's SIGINT: accelerate and every rank
    get the signal, the run saves its step and stops, and launch.sh exits 128 + the signal's
    number (143, 130) once nothing of the run is left."""
    from tests.train.test_launch import _launch_sh, _sh_env
    b = tmp_path / "b"
    b.mkdir()
    # many steps: however late the signal reaches the ranks, it comes before the last one
    common = [o for o in COMMON if not o.startswith("train.max_steps=")] + ["train.max_steps=400"]
    args = [*_launch_sh("--cpu", str(nproc), "--master-port", str(free_port())), *SMALL,
            f"data.dataset={tiny_llama_dataset}", f"hydra.run.dir={b}", *common]
    p = subprocess.Popen(args, cwd=tmp_path, env=_sh_env(OMP_NUM_THREADS="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    ranks = []
    try:
        metrics = b / "metrics.jsonl"
        deadline = time.time() + 400
        while not (metrics.is_file() and '"step": 3,' in metrics.read_text()):
            assert time.time() < deadline and p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.05)
        ranks = [json.loads((b / "ranks" / f"rank{r}.json").read_text())["pid"]
                 for r in range(nproc)]
        os.kill(p.pid, sig)                        # the script's own PID, as `kill PID` does
        _, err = p.communicate(timeout=300)
        assert p.returncode == 128 + sig, err[-4000:]
        assert "Traceback" not in err, err[-4000:]
        assert _in_session(p.pid) == []            # accelerate ended before launch.sh did
        assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks), err[-4000:]
    finally:
        for pid in [*_in_session(p.pid), *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    stopped = [line for line in err.splitlines() if "stopped at step" in line]
    name = signal.Signals(sig).name
    assert len(stopped) == 1 and f"on {name}: checkpoint saved in" in stopped[0], err[-4000:]
    saved = (b / "checkpoints" / "latest").read_text().strip()
    assert "step-000003" <= saved < "step-000400"
    assert f"stopped at step {int(saved.removeprefix('step-'))} of 400" in stopped[0]
    assert not (b / "export").exists() and not (b / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_sighup_and_sigquit_save_the_step_too(tmp_path, tiny_llama_dataset, sig):
    b = tmp_path / "b"
    p = _start(b, tiny_llama_dataset, _cmd(1, free_port()))
    metrics = b / "metrics.jsonl"
    deadline = time.time() + 400
    while not (metrics.is_file() and '"step": 3,' in metrics.read_text()):
        assert time.time() < deadline and p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(p.pid, sig)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 128 + sig, err[-4000:]
    stopped = [line for line in err.splitlines() if "stopped at step" in line]
    assert len(stopped) == 1 and f"on {signal.Signals(sig).name}: checkpoint saved" in stopped[0]
    assert (b / "checkpoints" / "latest").read_text().strip() >= "step-000003"
    assert "Traceback" not in err


def test_ctrl_c_outside_training_is_one_line_and_130(tmp_path):
    """SIGINT while the job builds its dataset (before the training loop): no traceback."""
    from tests.train.test_trainer import MAIN
    cache = tmp_path / "cache"
    p = subprocess.Popen([sys.executable, MAIN, "target=tiny_llama", f"data.cache_dir={cache}",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.time() + 300
    while not (cache / "datasets").is_dir():          # the embedded default is being built
        assert time.time() < deadline and p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    from eyas.train.main import INTERRUPTED
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].endswith(INTERRUPTED), err[-3000:]
