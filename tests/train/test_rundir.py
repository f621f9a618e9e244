"""The run directory rules (train/rundir.py) and the strict summary, without processes."""

import json
import math
from pathlib import Path

import pytest

from eyas.train import rundir
from eyas.train.config import ConfigError
from eyas.train.main import _write_summary


class OneProcess:
    num_processes, process_index, is_main_process = 1, 0, True


def _old_run(out: Path) -> Path:
    """What a finished run leaves: two checkpoints, pointers, metrics, exports, summary."""
    ck = out / "checkpoints"
    for step in (2, 4):
        (ck / f"step-{step:06d}").mkdir(parents=True)
        (ck / f"step-{step:06d}" / "eyas_state.json").write_text("{}")
    (ck / "latest").write_text("step-000004")
    (ck / "best").write_text("step-000002")
    (ck / "best.json").write_text('{"checkpoint": "step-000002", "tau": 4.087}')
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    for d in ("export", "export-step000002"):
        (out / d).mkdir()
        (out / d / "model.safetensors").write_bytes(b"weights")
    (out / "summary.json").write_text('{"tau": 4.087}')
    (out / "profile").mkdir()
    (out / "profile" / "trace-rank0.json").write_text("{}")
    return out


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_an_empty_or_missing_directory_is_taken(tmp_path):
    assert rundir.verdict(tmp_path / "new", resume=None, overwrite=False) is None
    assert rundir.verdict(tmp_path, resume=None, overwrite=False) is None


def test_a_used_directory_is_refused_with_what_it_holds_and_both_fixes(tmp_path):
    out = _old_run(tmp_path / "r")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as e:
        rundir.claim(OneProcess(), out, resume=None, overwrite=False)
    msg = str(e.value)
    assert "\n" not in msg and str(out) in msg
    for word in ("step-000002, step-000004 (latest step-000004)", "metrics.jsonl (2 records)",
                 "export/", "export-step000002/", "summary.json", "train.resume=latest",
                 "train.overwrite=true"):
        assert word in msg, word
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_reuses_the_directory_as_it_is(tmp_path):
    out = _old_run(tmp_path / "r")
    files = sorted(out.rglob("*"))
    lock = rundir.claim(OneProcess(), out, resume="latest", overwrite=False)
    assert (out / ".eyas.lock").is_file()  # held for the run's life
    lock.release()
    assert sorted(out.rglob("*")) == files


def test_overwrite_removes_the_old_run_and_keeps_foreign_files(tmp_path, caplog):
    out = _old_run(tmp_path / "r")
    (out / "notes.txt").write_text("mine")
    (out / ".tmp-export.1234").mkdir()
    with caplog.at_level("WARNING"):
        rundir.claim(OneProcess(), out, resume=None, overwrite=True).release()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert "removed the previous run" in caplog.text and "kept notes.txt" in caplog.text


def test_overwrite_refuses_to_remove_the_checkpoint_it_resumes_from(tmp_path):
    out = _old_run(tmp_path / "r")
    step = out / "checkpoints" / "step-000002"
    assert "would remove" in rundir.verdict(out, resume=str(step), overwrite=True)
    assert step.is_dir()
    other = _old_run(tmp_path / "other") / "checkpoints" / "step-000004"
    assert rundir.verdict(out, resume=str(other), overwrite=True) is None
    assert not (out / "checkpoints").exists() and other.is_dir()


def test_overwrite_with_resume_latest_is_a_config_error():
    from omegaconf import OmegaConf
    from eyas.train.config import EyasConfig, check
    cfg = OmegaConf.structured(EyasConfig(output_dir="x"))
    cfg.train.overwrite, cfg.train.resume = True, "latest"
    with pytest.raises(ConfigError, match="train.overwrite"):
        check(cfg)


def test_summary_is_strict_json_with_null_for_non_finite(tmp_path):
    _write_summary(tmp_path, {"tau": float("nan"), "eval": {"acc_0": math.inf, "tau": 1.5},
                              "speculative": {"tau": 2.0, "tokens_identical": True},
                              "export": tmp_path / "export"})
    text = (tmp_path / "summary.json").read_text()
    got = _strict(text)
    assert got["tau"] is None and got["eval"] == {"acc_0": None, "tau": 1.5}
    assert got["speculative"]["tau"] == 2.0 and got["export"] == str(tmp_path / "export")
    assert not list(tmp_path.glob(".tmp-*"))


def test_overwrite_removes_what_the_trackers_wrote(tmp_path, caplog):
    out = _old_run(tmp_path / "r")
    for d in ("runs-tb/eyas-run", "wandb/offline-run-1", ".aim/meta", "mlruns/0", "dvclive/plots"):
        (out / d).mkdir(parents=True)
        (out / d / "f").write_text("old")
    (out / "notes.txt").write_text("mine")
    assert "runs-tb/" in rundir.describe(out, project="runs-tb")
    with caplog.at_level("WARNING"):
        rundir.claim(OneProcess(), out, resume=None, overwrite=True, project="runs-tb").release()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert "kept notes.txt (not written by eyas)" in caplog.text


def test_the_tensorboard_directory_is_the_projects_first_component():
    assert rundir.tracker_dir("eyas") == "eyas"
    assert rundir.tracker_dir("team/eyas") == "team"
    for outside in (None, "", "/abs/tb", "../up", "."):
        assert rundir.tracker_dir(outside) is None, outside


def test_resume_from_another_runs_checkpoint_into_a_used_directory_is_refused(tmp_path):
    other = _old_run(tmp_path / "other") / "checkpoints" / "step-000004"
    out = _old_run(tmp_path / "r")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    msg = rundir.verdict(out, resume=str(other), overwrite=False)
    assert msg and "\n" not in msg
    assert str(other) in msg and str(tmp_path / "other") in msg and str(out) in msg
    assert "run_name=NAME" in msg and "train.overwrite=true" in msg
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # its own checkpoint, a new or empty directory, or overwrite: accepted
    own = out / "checkpoints" / "step-000002"
    assert rundir.verdict(out, resume=str(own), overwrite=False) is None
    assert rundir.verdict(tmp_path / "new", resume=str(other), overwrite=False) is None
    assert rundir.verdict(out, resume=str(other), overwrite=True) is None
    assert not (out / "checkpoints").exists() and other.is_dir()


@pytest.mark.parametrize("resume", [None, "latest"])
def test_a_run_held_by_a_live_process_is_refused(tmp_path, lock_holder, resume):
    out = _old_run(tmp_path / "r")
    holder = lock_holder(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as e:
        rundir.claim(OneProcess(), out, resume=resume, overwrite=resume is None)
    msg = str(e.value)
    assert "\n" not in msg and f"pid {holder.pid}" in msg and "being written by another" in msg
    assert msg.startswith("train.resume=latest: ") == (resume == "latest")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_killed_runs_lock_is_taken_over_and_is_not_its_content(tmp_path, lock_holder, caplog):
    import os
    import signal
    out = tmp_path / "r"
    holder = lock_holder(out)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert [p.name for p in out.iterdir()] == [".eyas.lock"]
    assert rundir.verdict(out, resume=None, overwrite=False) is None  # still an empty run dir
    with caplog.at_level("WARNING"):
        lock = rundir.claim(OneProcess(), out, resume=None, overwrite=False)
    assert f"stale lock of pid {holder.pid}" in caplog.text
    lock.release()
    assert not any(out.iterdir())


def test_leftovers_of_killed_saves_and_rotations_are_removed(tmp_path, caplog):
    out = _old_run(tmp_path / "r")
    ck = out / "checkpoints"
    # as kill -9 leaves them: a save cut short, a checkpoint deleted half way by an earlier
    # rotation (its eyas_state.json already gone), a rotation cut short after its rename
    (ck / ".step-000006.tmp").mkdir()
    (ck / ".step-000006.tmp" / "model.safetensors").write_bytes(b"half")
    (ck / "step-000001").mkdir()
    (ck / "step-000001" / "optimizer.bin").write_bytes(b"rest")
    (ck / ".step-000000.del").mkdir()
    with caplog.at_level("WARNING"):
        rundir.claim(OneProcess(), out, resume="latest", overwrite=False).release()
    assert sorted(p.name for p in ck.iterdir()) == ["best", "best.json", "latest",
                                                   "step-000002", "step-000004"]
    for name, why in ((".step-000006.tmp", "an unfinished checkpoint save"),
                      ("step-000001", "a checkpoint deleted half way"),
                      (".step-000000.del", "an interrupted checkpoint rotation")):
        assert f"removing {ck / name}, left by {why}" in caplog.text

