"""train.profiling.StepProfiler: the window it profiles, and what an error in the loop leaves."""

import json
import logging

import pytest
import torch

from eyas.train.profiling import STEP_RANGE, StepProfiler


def _work():
    a = torch.randn(64, 64)
    return (a @ a).sum()


def _steps(trace):
    events = json.loads(trace.read_text())["traceEvents"]
    return [e for e in events if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation"]


def test_only_the_window_is_profiled(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="eyas.train.profiling")
    with StepProfiler(start=3, steps=2, out=tmp_path, rank=1) as prof:
        for step in range(1, 7):
            with prof.step(step):
                _work()
    assert len(_steps(tmp_path / "trace-rank1.json")) == 2
    assert "profiled steps 3-4 into" in caplog.text
    assert "aten::mm" in (tmp_path / "kernels-rank1.txt").read_text()


def test_an_error_in_the_window_keeps_what_ran_and_is_not_replaced(tmp_path, caplog):
    with pytest.raises(RuntimeError, match="boom"):
        with StepProfiler(start=1, steps=3, out=tmp_path / "a", rank=0) as prof:
            with prof.step(1):
                _work()
            with prof.step(2):
                raise RuntimeError("boom")
    assert len(_steps(tmp_path / "a" / "trace-rank0.json")) == 2
    blocked = tmp_path / "file"
    blocked.write_text("")                     # the profile directory cannot be made
    with pytest.raises(RuntimeError, match="boom"):
        with StepProfiler(start=1, steps=3, out=blocked / "p", rank=0) as prof:
            with prof.step(1):
                raise RuntimeError("boom")
    assert "the profile of steps 1-1 was not written" in caplog.text
