"""The acceptance-aligned objectives train tiny-llama on the CPU (real processes, real dataset)
and every training and eval record carries α per TTT step with the τ its chain implies."""

import json
import math

import pytest

from tests.train.test_trainer import run

STEPS = 6


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def chain(rates):
    """1 + Σ_k Π_{j≤k} α_j, written out."""
    total, prod = 1.0, 1.0
    for a in rates:
        prod *= a
        total += prod
    return total


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda", "tv", "mix"])
def test_objective_trains_and_logs_alpha(tmp_path, tiny_llama_dataset, loss):
    run_dir = tmp_path / loss
    r = run(run_dir, tiny_llama_dataset, "target=tiny_llama", f"loss={loss}",
            f"train.max_steps={STEPS}", "train.eval_every=3")
    recs = records(run_dir)
    train = [x for x in recs if "train/loss" in x]
    evals = [x for x in recs if "eval/tau" in x]
    assert len(train) == STEPS and evals
    for rec, prefix in [(x, "train") for x in train] + [(x, "eval") for x in evals]:
        rates = [rec[f"{prefix}/alpha_{k}"] for k in range(3)]
        assert all(0.0 < a <= 1.0 for a in rates), rates
        assert math.isclose(rec[f"{prefix}/tau_alpha"], chain(rates), rel_tol=1e-9)
        assert f"{prefix}/alpha_3" not in rec
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tau_alpha"] == evals[-1]["eval/tau_alpha"]
    assert "expected-acceptance chain" in r.stdout.strip().splitlines()[-1]
    log = (run_dir / "train.log").read_text()
    assert f"step {STEPS}/{STEPS}" in log and "tau_alpha" in log
    cfg = (run_dir / ".hydra" / "config.yaml").read_text()
    assert f"objective: {loss}" in cfg
