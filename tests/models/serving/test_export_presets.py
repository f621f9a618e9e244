"""Real-shape drafters (Llama-3.1-8B, Kimi-K2.5 targets): the exporter's output passes the
validator. Random bf16 weights of the exact shapes, ~1 GB and ~2 GB on disk, ~1 min: run with
EYAS_SLOW=1. The config rules on the same shapes run always (milliseconds)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from eyas.models.config import Eagle3Config
from eyas.models.serving.export import export_drafter
from eyas.data.common.targets import load_target_config, text_config
from eyas.models.serving.contract import CORE_TENSORS, TensorDir, expected_shapes
from eyas.models.serving.validate import validate
from eyas.models.serving.validate_static import check_config

EXPECTED = {  # preset -> (vLLM aux ids, SGLang aux ids, fc shape, lm_head shape)
    "llama-3.1-8b": ([2, 16, 29], [1, 15, 28], (4096, 3 * 4096), (32000, 4096)),
    "kimi-k2.5": ([2, 30, 58], [1, 29, 57], (7168, 3 * 7168), (32000, 7168)),
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_real_shape_configs_pass_the_config_rules(preset):
    tcfg = load_target_config(preset)
    c = Eagle3Config.from_target(tcfg, draft_vocab_size=32000).to_config_dict()
    assert check_config(c, text_config(tcfg)) == []
    vl, sg, fc, lm = EXPECTED[preset]
    assert c["eagle_aux_hidden_state_layer_ids"] == vl
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == sg
    assert expected_shapes(c)["fc.weight"] == fc and expected_shapes(c)["lm_head.weight"] == lm


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("EYAS_SLOW") != "1",
                    reason="writes ~3 GB of real-shape exports (~1 min): set EYAS_SLOW=1")
@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_real_shape_export_passes_the_validator(preset, tmp_path, monkeypatch):
    tcfg = load_target_config(preset)
    tc = text_config(tcfg)
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=32000)
    shapes = expected_shapes(cfg.to_config_dict())
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name in CORE_TENSORS:
        t = torch.empty(shapes[name], dtype=torch.bfloat16)
        sd[name] = t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0, 0.02,
                                                                               generator=g)
    ids = torch.randperm(tc["vocab_size"], generator=g)[:32000].sort().values
    out = export_drafter(sd, cfg, ids - torch.arange(32000), None, tmp_path / preset,
                         target_config=tcfg)
    del sd

    # check_values=False reads no weight values: every float tensor is judged by its header
    # (name, shape, dtype); only the vocabulary map (d2t, t2d) is loaded, for its own rules
    loaded, real_load = [], TensorDir.load

    def no_values(self, name, *args, **kwargs):
        raise AssertionError(f"read the values of {name}")

    def vocab_map_only(self, name):
        loaded.append(name)
        if name not in ("d2t", "t2d"):
            raise AssertionError(f"read the values of {name}")
        return real_load(self, name)

    with monkeypatch.context() as m:
        m.setattr(TensorDir, "chunks", no_values)
        m.setattr(TensorDir, "load", vocab_map_only)
        assert validate(out, tcfg, check_values=False) == []
        assert sorted(loaded) == ["d2t", "t2d"]
        with pytest.raises(AssertionError, match="read the values of "):
            validate(out, tcfg)                        # the value scan reads through these two
    assert validate(out, tcfg) == []                       # with the chunked NaN/inf scan

    vl, sg, fc, lm = EXPECTED[preset]
    c = json.loads((out / "config.json").read_text())
    assert c["eagle_aux_hidden_state_layer_ids"] == vl
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == sg
    assert c["vocab_size"] == tc["vocab_size"] and c["draft_vocab_size"] == 32000
    assert c["max_position_embeddings"] >= tc["max_position_embeddings"]
    tdir = TensorDir(out)
    assert tdir.shape("fc.weight") == fc and tdir.shape("lm_head.weight") == lm
    assert tdir.shape("t2d") == (tc["vocab_size"],) and tdir.dtype("d2t") == "I64"
