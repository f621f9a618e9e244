"""Probe records -> engine findings (models/serving/loaders/check.py), on synthetic records: no
engine venv needed (the engines themselves run in test_engines.py, marker `engines`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from eyas.models.serving.loaders.check import cross_check, format_reports, interpret

_spec = importlib.util.spec_from_file_location(  # a helper next to this file, not a package
    "_eyas_verdicts", Path(__file__).with_name("verdicts.py"))
_vd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_vd)
verdict = _vd.verdict


def record(engine: str, **resolved) -> dict:
    """A probe record of a clean load of a tiny-llama drafter (8-layer target)."""
    return {"id": "0", "engine": engine, "version": "test", "ok": True, "seconds": 1.0,
            "resolved": {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 256,
                         "vocab_size": 49152, "target_vocab_size": 49152,
                         "norm_before_residual_applied": False, "max_model_len": 8192,
                         "target_num_layers": 8, **resolved},
            "reached": {"midlayer.hidden_norm.weight": ["model.midlayer.hidden_norm.weight"]},
            "consumed": {}, "unwritten": {}, "nonfinite": [],
            "from_target": {"model.embed_tokens.weight": "the target's embed_tokens"},
            "smoke": {"logits_finite": True, "width_ok": True, "has_mapping": True,
                      "mapped_in_range": True}}


def test_clean_records_are_clean():
    reports = {e: interpret(record(e, aux_layer_ids=[2, 4, 5]), e, [2, 4, 5])
               for e in ("vllm", "sglang")}
    cross_check(reports, [2, 4, 5])
    assert [r.findings for r in reports.values()] == [[], []]


def test_aux_layers_that_sglang_could_not_resolve_are_a_finding():
    err = "AttributeError: 'SimpleNamespace' object has no attribute 'set_eagle3_layers'"
    reports = {"vllm": interpret(record("vllm", aux_layer_ids=[2, 4, 5]), "vllm", [2, 4, 5]),
               "sglang": interpret(record("sglang", aux_layer_ids_error=err), "sglang",
                                   [2, 4, 5])}
    cross_check(reports, [2, 4, 5])
    sg = reports["sglang"]
    assert reports["vllm"].ok and not sg.ok
    assert [(f.code, f.severity) for f in sg.findings] == [("ENGINE_AUX_LAYERS", "error")]
    assert sg.findings[0].message == (
        f"SGLang raised while resolving the target layers it captures: {err}")
    assert verdict(sg) == ("probe", "*silent* → probe: aux layers")
    heads = [ln for ln in format_reports(reports).splitlines() if not ln.startswith(" ")]
    assert heads == ["vLLM test: clean (loaded in 1.0 s)",
                     "SGLang test: 1 finding(s) (loaded in 1.0 s)"]
