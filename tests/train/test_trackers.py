"""What the main job gives the trackers at its end (train/trackers.py), without processes."""

import logging
from types import SimpleNamespace

from eyas.train.trackers import log_final


class Tracker:
    def __init__(self, name, fail=False):
        self.name, self.fail, self.logged = name, fail, []

    def log(self, values, step=None, **kw):
        if self.fail:
            raise ConnectionError("server unreachable")
        self.logged.append(values)


def _cfg(kinds):
    return SimpleNamespace(tracker=SimpleNamespace(kind=kinds), train=SimpleNamespace(dry_run=False),
                           target=SimpleNamespace(name="tiny-llama"))


def test_a_failing_tracker_is_a_warning_naming_it(caplog):
    broken, fine = Tracker("mlflow", fail=True), Tracker("tensorboard")
    acc = SimpleNamespace(is_main_process=True, trackers=[broken, fine])
    summary = {"speculative": {"tau": 2.5, "tokens_identical": True}}
    with caplog.at_level(logging.WARNING):
        log_final(acc, _cfg(["mlflow", "tensorboard"]), summary)
    assert fine.logged == [{"speculative/tau": 2.5}]
    assert "tracker mlflow could not log the real-decoding result" in caplog.text
    assert "ConnectionError: server unreachable" in caplog.text


def test_a_failing_wandb_artifact_is_a_warning(caplog, tmp_path):
    class NoRun:
        def get_tracker(self, name, unwrap=False):
            raise RuntimeError("no wandb run")
    acc = NoRun()
    acc.is_main_process, acc.trackers = True, []
    with caplog.at_level(logging.WARNING):
        log_final(acc, _cfg(["wandb"]), {"export": str(tmp_path)})
    assert "tracker wandb could not log the export (as an artifact)" in caplog.text
