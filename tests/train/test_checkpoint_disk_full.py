"""The trainer on a disk too small for its checkpoints (a real tmpfs, real runs of
train/main.py): one line naming the checkpoints directory, exit status 2, no partial save; the
next save refused before it writes when the newest checkpoint says it cannot fit; with two
ranks, rank 0 says it and rank 1 stops with it instead of a gloo traceback."""

from __future__ import annotations

import re

import pytest

from tests.test_disk_full import _free, _h
from tests.train.test_trainer import run

COMMON = ["target=tiny_llama", "train.max_steps=4", "train.eval_every=0", "train.save_every=2"]
FIX = ("free space there (train.keep_last=1 keeps fewer checkpoints), or write the run to "
       "another disk (hydra.run.dir=DIR); resume with train.resume=latest")


def _error_lines(stderr: str) -> list[str]:
    return [line.split(" E eyas: ", 1)[1] for line in stderr.splitlines() if " E eyas: " in line]


def test_a_checkpoint_that_does_not_fit_stops_the_run_with_one_line(small_fs, tiny_llama_dataset):
    fs = small_fs(2048)
    r = run(fs / "run", tiny_llama_dataset, *COMMON, check=False)
    ck = fs / "run" / "checkpoints"
    assert r.returncode == 2, r.stderr[-4000:]
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    [line] = _error_lines(r.stderr)
    assert line.startswith(f"writing checkpoint step-000002 in {ck} failed: no space left on "
                           f"the device (it needs more than the "), line
    assert line.endswith(f" free there); {FIX}"), line
    assert list(ck.iterdir()) == []                  # no .step-000002.tmp, no latest


def test_the_next_checkpoint_is_refused_before_it_writes(small_fs, tiny_llama_dataset):
    fs = small_fs(24 * 1024)                         # one checkpoint (~14 MB) fits, two do not
    r = run(fs / "run", tiny_llama_dataset, *COMMON, check=False)
    ck = fs / "run" / "checkpoints"
    assert r.returncode == 2, r.stderr[-4000:]
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    need = sum(p.stat().st_size for p in (ck / "step-000002").iterdir())
    [line] = _error_lines(r.stderr)
    m = re.fullmatch(rf"not enough space for checkpoint step-000004 in {re.escape(str(ck))}: "
                     rf"needs {re.escape(_h(need))}, .* \(([\d,]+) bytes\) free there; "
                     rf"{re.escape(FIX)}", line)
    assert m, line
    free = int(m.group(1).replace(",", ""))          # train.log took a page more since
    assert free < need and abs(free - _free(ck)) <= 64 * 1024
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-000002"]


@pytest.mark.slow
def test_two_ranks_stop_together_with_rank_0s_line(small_fs, tiny_llama_dataset):
    fs = small_fs(2048)
    r = run(fs / "run", tiny_llama_dataset, *COMMON, nproc=2, check=False)
    ck = fs / "run" / "checkpoints"
    assert r.returncode != 0
    [line] = _error_lines(r.stderr)
    assert line.startswith(f"writing checkpoint step-000002 in {ck} failed: no space left"), line
    assert "[rank1]" not in r.stderr and "Connection closed by peer" not in r.stderr, \
        r.stderr[-4000:]
    assert list(ck.iterdir()) == []
