"""Entry-point logging: dated timestamps, the run's log file, progress records dropped only on a
terminal, and which errors are the user's (one line, exit 2/3) rather than bugs."""

import io
import json
import logging
import re

import pytest

from eyas.data.common import log as eyas_log
from eyas.data.store.format import DatasetError
from eyas.data.common.targets import target_dtype_name
from eyas.data.common.log import (PROGRESS, error_exit_status, error_message, run_command,
                           setup_logging)

STAMP = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} ")


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("stream_cls,progress_on_stream", [(io.StringIO, True), (Terminal, False)])
def test_file_and_stream_records(tmp_path, monkeypatch, restore_logging, stream_cls,
                                 progress_on_stream):
    stream = stream_cls()
    monkeypatch.setattr(eyas_log.sys, "stderr", stream)
    setup_logging(rank=0, file=tmp_path / "run" / "train.log")
    logger = logging.getLogger("eyas.test")
    logger.info("plain record")
    logger.info("step 1/2", extra={PROGRESS: True})
    setup_logging(rank=0)  # a second call replaces (and closes) the file handler
    logger.info("after")
    file_lines = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert [line.split(": ", 1)[1] for line in file_lines] == ["plain record", "step 1/2"]
    assert all(STAMP.match(line) for line in file_lines), file_lines
    shown = [line.split(": ", 1)[1] for line in stream.getvalue().splitlines()]
    assert shown == (["plain record", "step 1/2", "after"] if progress_on_stream
                     else ["plain record", "after"])


def test_other_ranks_write_only_warnings(tmp_path, monkeypatch, restore_logging):
    monkeypatch.setattr(eyas_log.sys, "stderr", io.StringIO())
    setup_logging(rank=1, file=tmp_path / "train.log")
    logging.getLogger("eyas.test").info("rank 1 info")
    logging.getLogger("eyas.test").warning("rank 1 warning")
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rank 1] ") and "rank 1 warning" in lines[0]


def _raise(exc):
    def cli_main(argv):
        raise exc
    return cli_main


def test_user_errors_are_one_line_and_bugs_keep_their_traceback(capsys):
    assert run_command("eyas x", _raise(FileNotFoundError(2, "No such file", "/no/x")), []) == 2
    assert capsys.readouterr().err == "eyas x: /no/x: No such file\n"
    assert run_command("eyas x", _raise(DatasetError("bad\nshard")), []) == 2  # eyas's own type
    assert capsys.readouterr().err == "eyas x: bad shard\n"
    assert run_command("eyas x", lambda argv: target_dtype_name("fp13"), []) == 2  # raised by eyas
    assert capsys.readouterr().err.startswith("eyas x: dtype='fp13': expected one of")
    with pytest.raises(ValueError):  # the same type raised outside eyas: a bug
        run_command("eyas x", _raise(ValueError("bad")), [])
    with pytest.raises(ZeroDivisionError):
        run_command("eyas x", lambda argv: 1 / 0, [])
    with pytest.raises(json.JSONDecodeError):  # a ValueError raised inside a library: a bug
        run_command("eyas x", lambda argv: json.loads("{"), [])

    class Unavailable(RuntimeError):
        exit_status = 3
    assert error_exit_status(Unavailable("no venv")) == 3
    assert error_exit_status(RuntimeError("boom")) is None
    assert error_message(KeyError("no tensor named 'x'")) == "no tensor named 'x'"


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("EYAS_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        run_command("eyas x", _raise(FileNotFoundError("missing")), [])


def test_progress_records_to_a_closed_stream_are_dropped_not_raised():
    import io
    import logging

    from eyas.data.common.log import PROGRESS, TerminalProgressFilter
    stream = io.StringIO()
    f = TerminalProgressFilter(stream)
    rec = logging.LogRecord("eyas.x", logging.INFO, __file__, 1, "done %d", (1,), None)
    setattr(rec, PROGRESS, True)
    assert f.filter(rec) is True             # not a terminal: the log file keeps progress
    stream.close()
    assert f.filter(rec) is False            # closed: dropped, the caller goes on


def test_log_every_is_due_once_per_interval(monkeypatch):
    from eyas.data.common import utils
    now = [100.0]
    monkeypatch.setattr(utils.time, "perf_counter", lambda: now[0])
    every = utils.LogEvery()
    due = []
    for t in (110.0, 129.9, 130.0, 150.0, 160.0, 175.0):
        now[0] = t
        due.append((t, every.due(), every.elapsed))
    # due 30 s after the start, then 30 s after the last line; elapsed counts from the start
    assert [(t, d) for t, d, _ in due if d] == [(130.0, True), (160.0, True)]
    assert due[-1][2] == 60.0
