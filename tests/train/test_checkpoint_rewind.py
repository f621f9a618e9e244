"""Checkpoint rotation and resuming from an older checkpoint (train/checkpoint.py), with the
real save path on one process (accelerate's own save_state replaced by one file per rank)."""

import json
from pathlib import Path

from eyas.train import checkpoint as ckpt


class OneProcess:
    is_main_process = True

    def wait_for_everyone(self):
        pass

    def save_state(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "model.safetensors").write_bytes(b"weights")


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_rotation_never_removes_the_checkpoint_just_written(tmp_path):
    root, acc = tmp_path / "checkpoints", OneProcess()
    for step in (2, 4, 6):
        ckpt.save(acc, root, step, {"step": step}, keep_last=3)
    # a continuation resumed at step 2 saves step 3: step 4 and 6 must not outrank it
    saved = ckpt.save(acc, root, 3, {"step": 3}, keep_last=2)
    assert (saved / ckpt.STATE_FILE).is_file()
    assert ckpt.latest(root) == saved
    assert ckpt.resolve_resume("latest", root) == saved
    assert "step-000002" in _names(root) and "step-000003" in _names(root)


def test_rewind_removes_the_abandoned_continuation_and_repoints_latest_and_best(tmp_path,
                                                                                caplog):
    root, acc = tmp_path / "checkpoints", OneProcess()
    for step, walk in ((2, 1.5), (4, 1.7), (6, 1.9)):
        ckpt.save(acc, root, step, {"step": step}, keep_last=5, best_metric=walk)
    assert json.loads((root / "best.json").read_text())["checkpoint"] == "step-000006"
    with caplog.at_level("WARNING"):
        removed = ckpt.rewind(root, root / "step-000004",
                              {"tau_trajectory": 1.7, "step": 4})
    assert removed == ["step-000006"]
    assert "removing the later checkpoints of the continuation it replaces: step-000006" \
        in caplog.text
    assert _names(root) == ["best", "best.json", "latest", "step-000002", "step-000004"]
    assert ckpt.latest(root) == root / "step-000004"
    best = json.loads((root / "best.json").read_text())
    assert (best["checkpoint"], best["tau_trajectory"]) == ("step-000004", 1.7)
    assert (root / "best").read_text() == "step-000004"
    # resuming from the newest one, or from another run's checkpoint, changes nothing
    assert ckpt.rewind(root, root / "step-000004", {}) == []
    other = tmp_path / "other" / "checkpoints"
    ckpt.save(acc, other, 1, {"step": 1}, keep_last=1)
    assert ckpt.rewind(root, other / "step-000001", {}) == []
    assert _names(root) == ["best", "best.json", "latest", "step-000002", "step-000004"]


def test_rewind_past_the_best_drops_a_best_that_no_longer_exists(tmp_path):
    root, acc = tmp_path / "checkpoints", OneProcess()
    ckpt.save(acc, root, 2, {"step": 2}, keep_last=5)
    ckpt.save(acc, root, 4, {"step": 4}, keep_last=5, best_metric=2.0)
    ckpt.rewind(root, root / "step-000002", {"tau_trajectory": None, "step": None})
    assert _names(root) == ["latest", "step-000002"]
    assert ckpt.read_best(root) is None


def test_resume_latest_in_a_new_directory_names_the_run_to_continue(tmp_path, caplog):
    acc = OneProcess()
    ckpt.save(acc, tmp_path / "20261204-101010" / "checkpoints", 5, {"step": 5}, keep_last=1)
    new = tmp_path / "20261204-111111" / "checkpoints"
    with caplog.at_level("INFO"):
        assert ckpt.resolve_resume("latest", new) is None
    assert (f"no checkpoint in {new} (a new run directory); starting fresh. To continue "
            f"{tmp_path / '20261204-101010'} instead, run again with run_name=20261204-101010 "
            f"train.resume=latest") in caplog.text
