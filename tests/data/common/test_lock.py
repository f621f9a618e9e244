"""One writer per directory (data/common/lock.py) against real processes: a live holder is named and
refused, a SIGKILLed one is reported as stale and taken over."""

import json
import os
import signal
import socket
import threading
import time

import pytest

from eyas.data.common.lock import DirectoryLocked, DirLock, dir_lock, lock_path
from eyas.train.cli import main


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path, lock_holder):
    out = tmp_path / "ds"
    holder = lock_holder(out)
    with pytest.raises(DirectoryLocked) as e:
        DirLock(out).acquire()
    msg = str(e.value)
    assert "\n" not in msg and str(out) in msg
    for word in (f"pid {holder.pid}", f"host {socket.gethostname()}", "since 20",
                 "command: -c", str(lock_path(out))):
        assert word in msg, (word, msg)
    holder.stdin.close()  # the holder finishes: its lock file goes with it
    holder.wait()
    assert not lock_path(out).exists()
    with dir_lock(out):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    assert not lock_path(out).exists()


def test_a_waiting_writer_takes_the_lock_when_the_holder_finishes(tmp_path, lock_holder,
                                                                  caplog):
    out = tmp_path / "cache"
    holder = lock_holder(out)
    t0 = time.monotonic()
    with pytest.raises(DirectoryLocked, match=r"another process \(after waiting 2 s\)"):
        DirLock(out).acquire(wait=2)   # a short wait still ends in the refusal
    assert time.monotonic() - t0 >= 2
    threading.Timer(1.0, holder.stdin.close).start()   # the holder finishes a second later
    t0 = time.monotonic()
    with caplog.at_level("INFO"), dir_lock(out, what="held-out dataset cache", wait=30):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
        assert 1.0 <= time.monotonic() - t0 < 30
    assert f"being written by pid {holder.pid}" in caplog.text and "waiting up to 30 s" in caplog.text


def test_a_killed_holders_lock_is_stale_and_taken_over(tmp_path, lock_holder, caplog):
    out = tmp_path / "ds"
    holder = lock_holder(out)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert json.loads(lock_path(out).read_text())["pid"] == holder.pid  # left behind
    with caplog.at_level("WARNING"), dir_lock(out, what="token dataset"):
        record = json.loads(lock_path(out).read_text())
        assert record["pid"] == os.getpid() and record["what"] == "token dataset"
    assert f"stale lock of pid {holder.pid}" in caplog.text and "no longer running" in caplog.text


@pytest.mark.parametrize("argv", [
    ["prepare", "--input", "{tmp}/in.jsonl", "--target", "smollm2", "--out", "{out}"],
    ["extract", "--tokens", "{tmp}/tokens", "--target", "tiny-llama", "--out", "{out}",
     "--device", "cpu"],
    ["import", "specforge", "{tmp}", "--out", "{out}", "--target", "tiny-llama"],
])
def test_every_dataset_writer_refuses_a_held_directory(argv, tmp_path, lock_holder, capsys):
    out = tmp_path / "out"
    holder = lock_holder(out)
    (tmp_path / "in.jsonl").write_text('{"messages": []}\n')
    assert main([a.format(tmp=tmp_path, out=out) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pid {holder.pid}" in err[0], err
    assert err[0].startswith(f"eyas {argv[0]}: ") and "being written by another process" in err[0]
    assert sorted(p.name for p in out.iterdir()) == [".eyas.lock"]  # nothing else written


def test_the_same_process_may_nest_writers_of_one_directory(tmp_path):
    with dir_lock(tmp_path / "d"), dir_lock(tmp_path / "d"):
        pass
    assert not lock_path(tmp_path / "d").exists()
