"""The numerical check: engine math on the exported tensors vs the training forward."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.data.common.checksums import write_checksums

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.export import export_drafter
from eyas.data.common.targets import load_target_config, resolve_target
from eyas.models.serving.contract import TensorDir, read_config
from eyas.models.serving.validate import validate
from eyas.models.serving.validate_numeric import compare

VD = 512


def make_drafter(tcfg: dict, seed: int = 0, **overrides):
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=VD, ttt_steps=3, **overrides)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, attention="eager")
    ids = torch.randperm(cfg.vocab_size)[:VD].sort().values
    drafter.set_vocab_map(ids - torch.arange(VD))
    return cfg, drafter.state_dict()


@pytest.fixture(scope="module")
def tcfg():
    return load_target_config("tiny-llama")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tcfg):
    cfg, sd = make_drafter(tcfg)
    out = export_drafter(sd, cfg, None, None, tmp_path_factory.mktemp("n") / "clean",
                         target_config=tcfg)
    return out, sd


def test_clean_export_matches_the_training_forward(exported, tcfg):
    out, sd = exported
    res = compare(read_config(out), TensorDir(out).load_all(), torch.randn(49152, 64))
    assert len(res["max_abs_diff"]) == 3
    assert max(res["max_abs_diff"]) < 1e-5 * res["max_abs_logit"] * 100  # float noise only
    assert res["argmax_agree"] == [1.0, 1.0, 1.0]
    assert validate(out, tcfg, numeric=True) == []
    assert validate(out, tcfg, numeric=True, trainer_state_dict=sd) == []


def test_with_the_real_target_embedding(exported, tcfg):
    out, sd = exported
    target_dir = resolve_target("tiny-llama")
    assert validate(out, tcfg, numeric=True, target_weights=target_dir,
                    trainer_state_dict=sd) == []


@pytest.mark.parametrize("flags", [{}, {"norm_output": True, "fc_norm": True}])
def test_a_speculators_export_is_checked_numerically_as_vllm_reads_it(tcfg, tmp_path, flags):
    cfg, sd = make_drafter(tcfg, seed=2, **flags)
    out = export_drafter(sd, cfg, None, None, tmp_path / "e", target_config=tcfg,
                         speculators=True, verifier="tiny")
    spec = tmp_path / "e-speculators"
    assert [f.code for f in validate(spec, tcfg, numeric=True, trainer_state_dict=sd)] == \
        ["SPECULATORS_FORMAT"]
    # decoding loads it with the same engine math as the layout-A export
    from eyas.train.evaluate.specdec import load_engine_drafter
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size)
    (a, cfg_a), (b, cfg_b) = (load_engine_drafter(d, emb, dtype=torch.float32)
                              for d in (out, spec))
    from eyas.models.serving.reference import serve_packed
    from eyas.models.serving.validate_numeric import _packed_rows
    rows = _packed_rows(cfg_a, (9, 7), 0)
    torch.testing.assert_close(serve_packed(a, *rows, 3), serve_packed(b, *rows, 3), rtol=0,
                               atol=0, equal_nan=True)    # rows past a document's end are NaN
    assert cfg_b.get("norm_output") == cfg_a.get("norm_output") == flags.get("norm_output")


def test_llama3_rope_scaling_agrees(tmp_path):
    # the Llama-3.1 RoPE (scaled frequencies) on tiny shapes: trainer and engine must agree
    llama = load_target_config("llama-3.1-8b")
    tcfg = dict(load_target_config("tiny-llama"), max_position_embeddings=131072,
                rope_theta=500000.0, rope_scaling=llama["rope_scaling"])
    cfg, sd = make_drafter(tcfg)
    assert cfg.rope_scaling["rope_type"] == "llama3"
    out = export_drafter(sd, cfg, None, None, tmp_path / "rope", target_config=tcfg)
    assert validate(out, tcfg, numeric=True, trainer_state_dict=sd) == []


def test_swapped_gate_up_passes_static_but_not_numeric(exported, tcfg, tmp_path):
    # a name-mapping mix-up the static rules cannot see: gate_proj and up_proj have one shape
    out, sd = exported
    bad = tmp_path / "swapped"
    shutil.copytree(out, bad)
    ts = load_file(bad / "model.safetensors")
    g, u = "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"
    ts[g], ts[u] = ts[u], ts[g]
    save_file(ts, bad / "model.safetensors")
    write_checksums(bad)                                  # as a buggy exporter would write it
    assert validate(bad, tcfg) == []                      # static: clean
    assert validate(bad, tcfg, numeric=True) == []        # self-consistent on its own tensors
    found = validate(bad, tcfg, numeric=True, trainer_state_dict=sd)
    assert [f.code for f in found] == ["NUMERIC_MISMATCH"], found


def test_unusable_target_weights_is_a_finding(exported, tcfg, tmp_path):
    out, _ = exported
    (tmp_path / "t").mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(100, 64)}, tmp_path / "t" / "m.safetensors")
    found = validate(out, tcfg, numeric=True, target_weights=tmp_path / "t")
    assert [f.code for f in found] == ["NUMERIC_LOAD"]
    assert "embed_tokens" in found[0].message


def test_numeric_is_skipped_when_static_errors_exist(exported, tcfg, tmp_path):
    out, _ = exported
    bad = tmp_path / "b"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (bad / "config.json").write_text(json.dumps(cfg))
    write_checksums(bad)
    assert [f.code for f in validate(bad, tcfg, numeric=True)] == ["NUM_LAYERS"]
