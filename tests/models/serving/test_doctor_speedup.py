"""The doctor's predicted speedup and the model card's table, on real exports whose provenance
records an evaluation: figures equal to models/speedup.py's roofline model computed here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from eyas.data.common.targets import load_target_config, text_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.card import CARD, PROVENANCE
from eyas.models.serving.doctor import diagnose
from eyas.models.serving.doctor_speedup import drafter_params, fewest_gpus
from eyas.models.serving.export import export_drafter
from eyas.models.speedup import HARDWARE, RooflineCosts, TargetShape
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "doctor")

VD = 256


def chain(rate: float, k: int) -> list[float]:
    """Unconditional per-position acceptance when each draft is accepted with probability
    `rate` given the ones before it: a_j = rate^j."""
    return [rate ** j for j in range(1, k + 1)]


def _eval(rate: float, k: int = 3) -> dict[str, float]:
    """An eval record whose every draft is accepted with probability `rate` given the ones
    before it: cond_acc_j = rate, so drafts 1 … j are all accepted with probability rate^j."""
    return {"tau": 1 + sum(chain(rate, k)), **{f"cond_acc_{j}": rate for j in range(k)},
            **{f"acc_{j}": rate ** (j + 1) for j in range(k)}}


def export(target: str, out: Path, ev: dict | None) -> tuple[Path, float]:
    """A real export for preset `target` (K = 3) with `ev` as its recorded evaluation, and the
    parameters one drafter step reads (its linear layers, counted on the model)."""
    tcfg = load_target_config(target)
    cfg = Eagle3Config.from_target(text_config(tcfg), draft_vocab_size=VD, ttt_steps=3)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="eager")
    ids = torch.randperm(text_config(tcfg)["vocab_size"])[:VD].sort().values
    d.set_vocab_map(ids - torch.arange(VD))
    linear = sum(m.weight.numel() for m in d.modules() if isinstance(m, nn.Linear))
    prov = {"target": {"name": target}, "eval": ev}
    return export_drafter(d.state_dict(), cfg, None, None, out, target_config=tcfg,
                          training={"target": target}, provenance=prov), linear


def _expected(target: str, linear: float, rate: float, k: int, c: int, *, gpus: int = 1,
              hardware: str = "h100", weight_bytes: float = 2.0) -> float:
    costs = RooflineCosts(TargetShape.from_config(text_config(load_target_config(target))),
                          linear, HARDWARE[hardware], gpus=gpus, weight_bytes=weight_bytes)
    return costs.speedup(1 + sum(chain(rate, k)), k, c)


def test_drafter_params_are_its_linear_layers(tmp_path):
    d, linear = export("tiny-llama", tmp_path / "d", None)
    assert drafter_params(json.loads((d / "config.json").read_text())) == linear


def test_doctor_warns_at_low_acceptance_on_a_moe_target(tmp_path, capsys):
    d, linear = export("tiny-deepseek-v3", tmp_path / "d", _eval(0.15))
    assert cli_main([str(d), "--target-config", "tiny-deepseek-v3", "--concurrency", "4",
                     "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    (f,) = [f for f in rep["findings"] if f["code"] == "SPEEDUP_BELOW_ONE"]
    sp = rep["stats"]["speedup"]
    want = _expected("tiny-deepseek-v3", linear, 0.15, 3, 4)
    assert sp["k"] == 3 and sp["concurrency"] == 4 and want < 1
    assert sp["predicted"] == pytest.approx(want, rel=1e-12)
    assert sp["tau"] == pytest.approx(1 + 0.15 + 0.15 ** 2 + 0.15 ** 3)
    best = max(range(1, 4), key=lambda k: _expected("tiny-deepseek-v3", linear, 0.15, k, 4))
    assert sp["best_k"] == best == 1
    assert sp["assumptions"].startswith("1 × H100 SXM, 2 bytes per weight")
    assert f["severity"] == "warning"
    assert f["message"].startswith(f"predicted speedup {want:.2f}× at K=3, concurrency 4 "
                                   f"(τ(3) = 1.18; 1 × H100 SXM")
    assert "K=1" in f["fix"] and "--speedup 1,3,5,7" in f["fix"]


def test_doctor_reports_the_figure_at_high_acceptance_on_a_dense_target(tmp_path):
    d, linear = export("tiny-llama", tmp_path / "d", _eval(0.9))
    rep = diagnose(d, "tiny-llama", num_speculative_tokens=2, hardware="b200", gpus=2,
                   weight_bytes=1.0)
    want = _expected("tiny-llama", linear, 0.9, 2, 1, gpus=2, hardware="b200",
                     weight_bytes=1.0)
    assert want > 1 and not [f for f in rep.findings if f.code == "SPEEDUP_BELOW_ONE"]
    assert rep.stats["speedup"]["predicted"] == pytest.approx(want, rel=1e-12)
    assert rep.stats["speedup"]["best_k"] == 3 == max(range(1, 4), key=lambda k: _expected(
        "tiny-llama", linear, 0.9, k, 1, gpus=2, hardware="b200", weight_bytes=1.0))
    assert [c for c in rep.checked if c.startswith("predicted speedup")] == [
        f"predicted speedup {want:.2f}× at K=2, concurrency 1 (τ(2) = 2.71; 2 × B200, 1 bytes "
        f"per weight, 2048 tokens of context per sequence, roofline estimate "
        f"(models/speedup.py))"]


def test_doctor_without_a_recorded_evaluation_says_so(tmp_path):
    d, _ = export("tiny-llama", tmp_path / "d", None)
    rep = diagnose(d, "tiny-llama")
    assert "speedup" not in rep.stats
    assert [n for n in rep.not_checked if n.startswith("predicted speedup")] == [
        "predicted speedup: the export records no evaluation with per-position acceptance "
        "(eyas_provenance.json eval cond_acc_0, …): export from a run with an eval"]


@pytest.mark.parametrize("args, msg", [(["--concurrency", "0"], "--concurrency 0: expected"),
                                       (["--gpus", "0"], "--gpus 0: expected"),
                                       (["--weight-bytes", "-1"], "--weight-bytes -1.0: expected")])
def test_doctor_refuses_a_wrong_deployment(tmp_path, capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        cli_main([str(tmp_path), "--target-config", "tiny-llama", *args])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_seed_case_kimi_int4_on_eight_h100():
    """~15 % acceptance per position, K = 5, a 1T MoE target at int4 on 8 H100s (measured
    0.66× on the run behind eyas)."""
    kimi = text_config(load_target_config("kimi-k2.5"))
    shape = TargetShape.from_config(kimi)
    assert fewest_gpus(shape, "h100", 0.5) == 8 and fewest_gpus(shape, "h100", 2.0) == 31
    dcfg = Eagle3Config.from_target(kimi, draft_vocab_size=32000, ttt_steps=5).to_config_dict()
    costs = RooflineCosts(shape, drafter_params(dcfg), HARDWARE["h100"], gpus=8,
                          weight_bytes=0.5)
    assert costs.speedup(1 + sum(chain(0.15, 5)), 5, 1) == pytest.approx(0.67, abs=0.01)


def test_card_table_holds_the_predicted_speedups(tmp_path):
    d, linear = export("tiny-deepseek-v3", tmp_path / "d", _eval(0.6))
    text = (d / CARD).read_text()
    rows = [f"| {k} | " + " | ".join(
        f"{_expected('tiny-deepseek-v3', linear, 0.6, k, c):.2f}" for c in (1, 4, 16, 64))
        + " |" for k in (1, 2, 3)]
    head = "| K | concurrency 1 | concurrency 4 | concurrency 16 | concurrency 64 |"
    assert "\n".join([head, "|---|---|---|---|---|", *rows]) in text
    assert ("1 × H100 SXM, 2 bytes per weight, 2048 tokens of context per sequence, roofline "
            "estimate (models/speedup.py). Measure it on the deployment with `eyas evaluate "
            "--engine vllm --prompts PROMPTS --speedup 1,3,5,7 --concurrency 1,4,16`.") in text
    prov = json.loads((d / PROVENANCE).read_text())["predicted_speedup"]
    assert prov["rows"][2][3] == pytest.approx(
        _expected("tiny-deepseek-v3", linear, 0.6, 3, 16), rel=1e-12)


def test_card_without_a_recorded_evaluation_skips_the_table(tmp_path):
    d, _ = export("tiny-llama", tmp_path / "d", None)
    assert ("## Predicted speedup\n\nNot predicted: no recorded evaluation with per-position "
            "acceptance.\n") in (d / CARD).read_text()
