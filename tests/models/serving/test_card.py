"""The model card and provenance record every export carries (models/serving/card.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from eyas.data.common.checksums import file_sha256, read_checksums
from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.card import CARD, PROVENANCE, record_checks, serve_commands
from eyas.models.serving.export import export_checkpoint, export_drafter
from eyas.models.serving.validate import validate
from eyas.train.cli import main

EVAL = {"tau": 2.25, "tau_trajectory": 2.125, "tau_independent": 2.5, "acc_0": 0.75,
        "acc_1": 0.5, "cond_acc_0": 0.75, "cond_acc_1": 0.625, "acc_overall": 0.6,
        "by_context": [{"bucket": "0-2k", "lo": 0, "hi": 2048, "tau": 2.3,
                        "cond_acc": [0.8, 0.5], "tokens": 1000, "rounds": 40},
                       {"bucket": "32k+", "lo": 32768, "hi": None, "tau": 1.09,
                        "cond_acc": [0.1, float("nan")], "tokens": 7, "rounds": 3}],
        "by_temperature": [{"temperature": 0.0, "tau": 2.2, "tau_se": 0.01,
                            "offline_tau": 2.21},
                           {"temperature": 0.7, "tau": 2.0, "tau_se": 0.02,
                            "offline_tau": 1.98}]}


@pytest.fixture(scope="module")
def tcfg():
    return load_target_config("tiny-llama")


@pytest.fixture(scope="module")
def drafter(tcfg):
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=512, ttt_steps=2)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="eager")
    ids = torch.randperm(cfg.vocab_size)[:512].sort().values
    d.set_vocab_map(ids - torch.arange(512))
    return cfg, d.state_dict()


def front_matter(readme: Path) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_an_export_without_a_run_record_carries_a_card_and_validates(drafter, tcfg, tmp_path):
    cfg, sd = drafter
    out = export_drafter(sd, cfg, None, None, tmp_path / "out", target_config=tcfg)
    assert {CARD, PROVENANCE} <= set(read_checksums(out))       # covered by SHA256SUMS
    assert validate(out, tcfg) == []
    facts = front_matter(out / CARD)["eyas"]
    exported = json.loads((out / "config.json").read_text())
    assert facts["architecture"] == "LlamaForCausalLMEagle3"
    assert facts["aux_layer_ids"] == exported["eagle_aux_hidden_state_layer_ids"]
    assert facts["draft_vocab_size"] == 512 and facts["ttt_steps"] == 2
    prov = json.loads((out / PROVENANCE).read_text())
    assert prov["software"]["libraries"]["torch"] == torch.__version__
    assert prov["checks"]["validator"] == {"errors": 0, "warnings": 0, "findings": []}
    text = (out / CARD).read_text()
    assert "## Data\n\nNot recorded." in text and "No evaluation record" in text
    for cmd in serve_commands("DRAFTER_DIR", "TARGET", 2):
        assert cmd in text
    # a re-export of the export keeps its card
    again = export_checkpoint(out, tmp_path / "again", target_config=tcfg)
    assert (again / CARD).read_bytes() == (out / CARD).read_bytes()


def test_the_card_renders_the_eval_tables_the_record_has(drafter, tcfg, tmp_path):
    cfg, sd = drafter
    run = {"target": {"name": "tiny-llama"}, "eval": EVAL,
           "selected": {"step": 40, "by": "best", "tau": 2.25}}
    out = export_drafter(sd, cfg, None, None, tmp_path / "out", target_config=tcfg,
                         provenance=run)
    text = (out / CARD).read_text()
    assert "| 0 | 0.750 | 0.750 |" in text and "| 1 | 0.500 | 0.625 |" in text
    assert "| 0-2k | 2.300 | 0.800, 0.500 | 1000 | 40 |" in text
    assert "| 32k+ | 1.090 | 0.100, — | 7 | 3 |" in text            # NaN: nothing counted
    assert "| 0.7 | 2.000 | 0.020 | 1.980 |" in text
    assert "Exported checkpoint: step 40 (selected: best, τ 2.250)" in text
    assert front_matter(out / CARD)["base_model"] == "tiny-llama"
    prov = json.loads((out / PROVENANCE).read_text())
    assert prov["eval"]["by_context"][1]["cond_acc"] == [0.1, None]   # strict JSON
    # an eval record without buckets or temperatures: no such tables
    plain = {k: v for k, v in EVAL.items() if not k.startswith("by_")}
    out2 = export_drafter(sd, cfg, None, None, tmp_path / "out2", target_config=tcfg,
                          provenance={"eval": plain})
    text2 = (out2 / CARD).read_text()
    assert "By draft position" in text2 and "By context" not in text2
    assert "By temperature" not in text2


def test_later_checks_are_recorded_and_overwrite_keeps_working(drafter, tcfg, tmp_path):
    cfg, sd = drafter
    out = export_drafter(sd, cfg, None, None, tmp_path / "out", target_config=tcfg)
    record_checks(out, engines={"vllm": "ok", "sglang": "ok"},
                  speculative={"tau": 2.5, "tokens_identical": True})
    text = (out / CARD).read_text()
    assert "- engine loaders: vllm ok, sglang ok" in text
    assert "τ 2.500, identical to the target alone: True" in text
    assert validate(out, tcfg) == []                # the new card's SHA-256 is recorded
    # the card and the record are the export's own files: --overwrite replaces them
    again = export_drafter(sd, cfg, None, None, out, target_config=tcfg, overwrite=True)
    assert "engine loaders: not run" in (again / CARD).read_text()


def test_a_damaged_provenance_record_is_one_line_naming_it(drafter, tmp_path, capsys):
    cfg, sd = drafter
    ck = tmp_path / "ck"
    ck.mkdir()
    save_file(sd, ck / "model.safetensors")
    (ck / "eyas.json").write_text(json.dumps({"drafter": cfg.to_dict()}))
    (ck / PROVENANCE).write_text('{"format": "eyas-provenance", "datasets": [')   # truncated
    assert main(["export", str(ck), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert str(ck / PROVENANCE) in err[-1] and "not valid JSON" in err[-1]
    assert not (tmp_path / "out").exists()


def test_the_speculators_directory_has_its_own_vllm_only_card(drafter, tcfg, tmp_path):
    cfg, sd = drafter                                               # trained with 2 TTT steps
    out = export_drafter(sd, cfg, None, None, tmp_path / "out", target_config=tcfg,
                         speculators=True, verifier="org/tiny", num_speculative_tokens=3)
    spec = tmp_path / "out-speculators"
    facts = front_matter(spec / CARD)["eyas"]
    assert (facts["architecture"], facts["speculative_tokens"], facts["ttt_steps"]) == (
        "Eagle3Speculator", 3, 2)
    text = (spec / CARD).read_text()
    vllm, sglang = serve_commands("DRAFTER_DIR", "org/tiny", 3)
    assert vllm in text and "sglang.launch_server" not in text
    assert "LlamaForCausalLMEagle3" not in text and "aux layer ids (SGLang)" not in text
    assert "vLLM loads this directory as is, SGLang does not" in text
    assert (spec / PROVENANCE).read_bytes() == (out / PROVENANCE).read_bytes()
    assert read_checksums(spec) == {p.name: file_sha256(p) for p in spec.iterdir()
                                    if p.name != "SHA256SUMS"}
    record_checks(spec, engines={"vllm": "ok"})             # re-rendered as its own card
    assert "Eagle3Speculator" in (spec / CARD).read_text()
    assert "- engine loaders: vllm ok" in (spec / CARD).read_text()
    assert [f.code for f in validate(spec, tcfg)] == ["SPECULATORS_FORMAT"]


def test_a_re_export_without_eyas_export_json_keeps_the_trained_k(drafter, tcfg, tmp_path):
    cfg, sd = drafter                                               # trained with 2 TTT steps
    export_drafter(sd, cfg, None, None, tmp_path / "out", target_config=tcfg,
                   speculators=True, verifier="org/tiny", num_speculative_tokens=3)
    spec = tmp_path / "out-speculators"                             # has no eyas_export.json
    # a re-export of it keeps the trained K: from its provenance ...
    again = export_checkpoint(spec, tmp_path / "again", target_config=tcfg)
    assert json.loads((again / "eyas_export.json").read_text())["ttt_steps"] == 2
    assert front_matter(again / CARD)["eyas"]["ttt_steps"] == 2
    assert serve_commands("DRAFTER_DIR", "TARGET", 2)[0] in (again / CARD).read_text()
    # ... else from its speculators config's speculative_tokens
    (spec / PROVENANCE).unlink()
    bare = export_checkpoint(spec, tmp_path / "bare", target_config=tcfg)
    assert json.loads((bare / "eyas_export.json").read_text())["ttt_steps"] == 3
    assert front_matter(bare / CARD)["eyas"]["ttt_steps"] == 3
