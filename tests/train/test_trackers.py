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


def test_file_writing_trackers_write_into_the_run_directory(tmp_path, monkeypatch):
    import sys
    from eyas.train.config import EyasConfig
    from eyas.train.trackers import init_trackers
    from omegaconf import OmegaConf
    uris = []
    monkeypatch.setitem(sys.modules, "mlflow", SimpleNamespace(set_tracking_uri=uris.append))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = OmegaConf.to_object(OmegaConf.structured(EyasConfig(output_dir=str(tmp_path))))
    cfg.tracker.kind = ["mlflow", "dvclive"]
    calls = []
    acc = SimpleNamespace(init_trackers=lambda project, config, init_kwargs:
                          calls.append((project, init_kwargs)))
    init_trackers(cfg, acc, tmp_path)
    assert uris == [(tmp_path / "mlruns").absolute().as_uri()]
    assert calls == [("eyas", {"dvclive": {"dir": str(tmp_path / "dvclive")}})]
    # a store the user names is theirs
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    init_trackers(cfg, acc, tmp_path)
    assert len(uris) == 1
