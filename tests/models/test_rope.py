"""The drafter's RoPE is the target's and is served the way it is trained.

For every rope type the engines apply to a Llama drafter, the training forward (transformers'
rope init functions, models/rope.py) and the engine-math reference (the engines' own formulas,
models/serving/engine_rope.py) give the same logits on positions far beyond the original context
(0..8k with an original length of 512), and the scaling visibly changes them. from_target copies
a yarn target's scaling into the export; the validator refuses what an engine would misread.
"""

from __future__ import annotations

import json

import pytest
import torch

from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.rope import rope_parameters
from eyas.models.serving.engine_rope import EngineRope
from eyas.models.serving.export import export_drafter
from eyas.models.serving.reference import EngineDrafter, serve_packed
from eyas.models.serving.validate import validate
from eyas.models.serving.validate_static import check_config

ORIG, MAX_POS, K, VD = 512, 8192, 3, 256
HALF = 8  # tiny-llama head_dim 16
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": ORIG},
    "yarn-mscale": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": ORIG,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIG,
                 "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                 "long_factor": [1.0 + 1.5 * i for i in range(HALF)]},
}


def _drafter(scaling, seed=0):
    cfg = Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=VD,
                                   ttt_steps=K, rope_scaling=scaling,
                                   max_position_embeddings=MAX_POS)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg, attention="eager")
    ids = torch.randperm(cfg.vocab_size)[:VD].sort().values
    d.set_vocab_map(ids - torch.arange(VD))
    return d


def _batch(d, T=20):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, d.config.vocab_size, (T,), generator=g)
    aux = torch.randn(T, 3 * d.config.target_hidden_size, generator=g)
    doc = torch.zeros(T, dtype=torch.int)
    pos = torch.arange(T) * 400 + 7               # 7 .. 7607: mostly beyond ORIG
    return ids, aux, doc, pos


def _both(d, engine="vllm"):
    ids, aux, doc, pos = _batch(d)
    with torch.no_grad():
        out = d(ids, aux, doc, pos, K)
        train = d.draft_logits(out.hidden)
    tensors = {k: v for k, v in d.state_dict().items() if k != "embed_tokens.weight"}
    eng = EngineDrafter.from_tensors(d.config.to_config_dict(), tensors, d.embed_tokens.weight,
                                     dtype=torch.float32, engine=engine)
    return train, serve_packed(eng, ids, aux, doc, pos, K), out.valid


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_training_forward_matches_engine_reference_beyond_original_context(name):
    d = _drafter(SCALINGS[name])
    train, serve, valid = _both(d)
    scale = float(train[valid].abs().max())
    torch.testing.assert_close(train[valid], serve[valid], atol=1e-5 * scale, rtol=0)
    plain, _, _ = _both(_drafter(None))                      # same weights, plain RoPE
    assert float((plain[valid] - train[valid]).abs().max()) > 1e-3 * scale


def test_yarn_attention_factor_scales_cos_and_sin():
    inv, factor = rope_parameters(16, 1e4, SCALINGS["yarn"], MAX_POS)
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(16.0)).item() + 1.0)
    assert rope_parameters(16, 1e4, SCALINGS["yarn-mscale"], MAX_POS)[1] == pytest.approx(
        (0.1 * 0.707 * 2.772588722239781 + 1) / (0.1 * 2.772588722239781 + 1))
    eng = EngineRope({"rope_theta": 1e4, "rope_scaling": SCALINGS["yarn"],
                      "max_position_embeddings": MAX_POS}, 16)
    cos, sin = eng.cos_sin(torch.tensor([0, 5000]))
    assert torch.allclose(cos[0], torch.full((HALF,), factor)) and eng.factor == factor
    assert (inv < 1.0 / (1e4 ** (torch.arange(0, 16, 2) / 16))).any()   # low frequencies stretched


def test_dynamic_is_vllms_static_table_and_sglang_differs():
    dyn = {"rope_type": "dynamic", "factor": 2.0}
    d = _drafter(dyn)
    train, serve, valid = _both(d, "vllm")
    scale = float(train[valid].abs().max())
    torch.testing.assert_close(train[valid], serve[valid], atol=1e-5 * scale, rtol=0)
    _, sglang, _ = _both(d, "sglang")
    assert float((sglang[valid] - train[valid]).abs().max()) > 1e-3 * scale
    # a dynamic target's drafter gets plain RoPE (what vLLM and transformers compute) ...
    target = dict(load_target_config("tiny-llama"), rope_scaling=dyn)
    assert Eagle3Config.from_target(target).rope_scaling is None
    # ... and an exported "dynamic" is refused: the engines disagree
    codes = {f.code for f in check_config(d.config.to_config_dict(), None)}
    assert "ROPE_UNSERVED" in codes


def test_longrope_factor_lists_must_fit_head_dim():
    bad = dict(SCALINGS["longrope"], long_factor=[1.0] * 4)
    with pytest.raises(ValueError, match="long_factor has 4 entries.*head_dim/2 = 8"):
        _drafter(bad)


def test_yarn_target_scaling_is_copied_and_exported(tmp_path):
    tcfg = load_target_config("deepseek-v3")            # type: yarn, factor 40, original 4096
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=VD, ttt_steps=K)
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 40,
                                "original_max_position_embeddings": 4096, "beta_fast": 32,
                                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    # a target that leaves the original length implicit gets it written explicitly
    implicit = dict(load_target_config("tiny-llama"), rope_scaling={"type": "yarn", "factor": 4.0})
    assert Eagle3Config.from_target(implicit).rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    tiny = dict(load_target_config("tiny-llama"), rope_scaling=SCALINGS["yarn"],
                max_position_embeddings=MAX_POS)
    d = _drafter(SCALINGS["yarn"])
    sd = {k: v for k, v in d.state_dict().items()}
    out = export_drafter(sd, d.config, None, None, tmp_path / "yarn", target_config=tiny)
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"] == SCALINGS["yarn"] and written["rope_theta"] == 10000.0
    findings = validate(out, tiny)
    assert not [f for f in findings if f.code.startswith("ROPE")], findings


@pytest.mark.parametrize("edit, code", [
    (lambda s: s.update(attention_factor=1.5), "ROPE_MISREAD"),
    (lambda s: s.update(attn_factor=0.9), "ROPE_MISREAD"),
    (lambda s: s.update(mscale=0, mscale_all_dim=1.0), "ROPE_MISREAD"),
    (lambda s: s.pop("factor"), "ROPE_KEYS"),
    (lambda s: s.update(rope_type="deepseek_yarn"), "ROPE_UNSERVED"),
    (lambda s: s.update(type="linear"), "ROPE_MISREAD"),
])
def test_validator_refuses_rope_an_engine_would_misread(edit, code):
    cfg = _drafter(SCALINGS["yarn"]).config.to_config_dict()
    edit(cfg["rope_scaling"])
    found = [f for f in check_config(cfg, None) if f.code == code]
    assert found and found[0].severity == "error", check_config(cfg, None)
    assert "\n" not in found[0].message and "rope" in found[0].message.lower()


def test_validator_warns_when_drafter_rope_is_not_the_targets():
    cfg = _drafter(None).config.to_config_dict()
    target = dict(load_target_config("tiny-llama"), rope_scaling=SCALINGS["yarn"])
    found = [f for f in check_config(cfg, target) if f.code == "ROPE_TARGET"]
    assert found and found[0].severity == "warning"
    assert not [f for f in check_config(cfg, load_target_config("tiny-llama"))
                if f.code.startswith("ROPE")]
