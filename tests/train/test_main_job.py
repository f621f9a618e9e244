"""The main job end to end on the embedded default, shrunk: generate → prepare → extract →
train → export → speculative decoding, with the last lines the README promises."""

import pytest
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_embedded_default_pipeline_end_to_end(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    env.pop("TRITON_INTERPRET", None)
    run_dir = tmp_path / "run"
    args = [sys.executable, str(ROOT / "train" / "main.py"), f"data.cache_dir={tmp_path}/cache",
            "data.num_prompts=12", "data.max_new_tokens=24", "data.token_budget=256",
            "drafter.draft_vocab_size=2048", "drafter.ttt_steps=3", "train.max_steps=3",
            "eval.num_prompts=2", "eval.max_new_tokens=12", "eval.engines=false",
            f"hydra.run.dir={run_dir}"]
    r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    lines = r.stdout.strip().splitlines()
    assert f"export: {run_dir / 'export'}" in lines
    assert lines[-1].startswith("eval split: decoder walk tau ")
    spec = [line for line in lines if line.startswith("real decoding:")]
    # the real τ leads the results; the eval split's figures come last, each named
    assert lines.index(spec[0]) < len(lines) - 1
    assert spec and spec[0].endswith("identical to greedy: True")
    def strict(name):
        raise ValueError(f"summary.json is not strict JSON: {name}")
    summary = json.loads((run_dir / "summary.json").read_text(), parse_constant=strict)
    assert summary["steps"] == 3
    # every result the job printed is in the summary, the real decoding included
    assert spec[0].startswith(f"real decoding: tau {summary['speculative']['tau']:.3f} ± "
                              f"{summary['speculative']['tau_se_prompts']:.3f} over 2 held-out "
                              f"prompts, ")
    assert summary["speculative"]["tokens_identical"] is True
    assert lines[-1] == (f"eval split: decoder walk tau {summary['tau_trajectory']:.3f}, mean "
                         f"over every start {summary['tau']:.3f}, expected-acceptance chain "
                         f"{summary['tau_alpha']:.3f}")
    # the dataset was built from SmolLM2's own answers and cached under data.cache_dir
    cached = list((tmp_path / "cache" / "datasets").glob("*/hidden/manifest.json"))
    assert len(cached) == 1
    manifest = json.loads(cached[0].read_text())
    assert manifest["aux_layer_ids"] == [2, 15, 27]
    conv = (cached[0].parent.parent / "conversations.jsonl").read_text().splitlines()
    assert len(conv) == 12
