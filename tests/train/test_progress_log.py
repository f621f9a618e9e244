"""Training that talks off a terminal: a log line every train.log_every optimizer steps, on
stderr and in <run dir>/train.log, with dated timestamps."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMP = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}"
LINE = re.compile(STAMP + r" I eyas\.train\.tracking: step (\d+)/(\d+) \(\d+%\) \| loss [\d.]+ "
                  r"\| tau [\d.]+ \| alpha [\d.]+ [\d.]+ \(tau_alpha [\d.]+\) \| tok/s \d+ "
                  r"\| lr [\d.]+e[-+]\d+ \| elapsed \d+:\d\d:\d\d \| eta \d+:\d\d:\d\d$")


def test_log_lines_every_log_every_steps_in_train_log(tmp_path, tiny_llama_dataset):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    run_dir = tmp_path / "r"
    r = subprocess.run(
        [sys.executable, str(ROOT / "train" / "main.py"), "target=tiny_llama",
         f"data.dataset={tiny_llama_dataset}", f"hydra.run.dir={run_dir}",
         "drafter.attention=eager", "drafter.ttt_steps=2", "drafter.draft_vocab_size=256",
         "data.token_budget=256", "data.num_workers=1", "data.eval_fraction=0.1",
         "train.max_steps=5", "train.log_every=2", "eval.speculative=false",
         "eval.engines=false", "export.enabled=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    log = (run_dir / "train.log").read_text().splitlines()
    steps = [LINE.match(line) for line in log]
    # every log_every steps, and the last step
    assert [(int(m[1]), int(m[2])) for m in steps if m] == [(2, 5), (4, 5), (5, 5)], log
    assert all(re.match(STAMP + " ", line) for line in log), log
    assert any("run dir" in line for line in log)
    # stderr is not a terminal here: the same lines reach it (the bar does not draw)
    assert sum(bool(LINE.match(line)) for line in r.stderr.splitlines()) == 3, r.stderr[-3000:]


def test_eta_counts_from_the_first_window_which_holds_the_compile(monkeypatch, caplog):
    """A slow first window (compile, warm-up) must not inflate every later eta."""
    import logging

    from eyas.train import tracking
    clock = iter([0.0, 50.0, 60.0, 70.0])       # start, then the time of each report
    monkeypatch.setattr(tracking.time, "perf_counter", lambda: next(clock))
    progress = tracking.Progress(total=100, initial=0, enabled=True)
    rec = {"loss": 1.0, "tau": 1.5, "tokens_per_s": 1000.0, "lr": 1e-3}
    with caplog.at_level(logging.INFO, logger="eyas.train.tracking"):
        for step in (10, 20, 30):
            progress.report(step, rec)
    progress.close()
    etas = [line.rsplit("| eta ", 1)[1] for line in caplog.messages]
    # step 10: 50 s for 10 steps so far → 450 s for 90 more; from then on 10 s per 10 steps
    assert etas == ["0:07:30", "0:01:20", "0:01:10"]
    assert [line.split("| elapsed ")[1][:7] for line in caplog.messages] == \
        ["0:00:50", "0:01:00", "0:01:10"]
