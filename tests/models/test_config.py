"""Eagle3Config: derivation from every target preset, the exact layout-A dict, round trips."""

import json

import pytest
import torch

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.engine_rope import engine_rope_params
from eyas.data.common.targets import PRESETS, default_aux_layer_ids, load_target_config, text_config

# (heads, kv heads, head_dim, intermediate) the presets must produce
EXPECTED_SHAPE = {
    "smollm2": (9, 3, 64, 1536),
    "tiny-llama": (4, 2, 16, 128),
    "tiny-deepseek-v3": (4, 2, 16, 128),
    "llama-3.1-8b": (32, 8, 128, 14336),
    "qwen3-8b": (32, 8, 128, 12288),
    "deepseek-v3": (56, 8, 128, 18432),
    "kimi-k2.5": (56, 8, 128, 18432),
}


@pytest.mark.parametrize("name", PRESETS)
def test_from_target_every_preset_round_trips(name):
    target = load_target_config(name)
    tc = text_config(target)
    cfg = Eagle3Config.from_target(target)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size) == EXPECTED_SHAPE[name]
    assert cfg.hidden_size == cfg.target_hidden_size == tc["hidden_size"]
    assert cfg.vocab_size == tc["vocab_size"]
    assert cfg.draft_vocab_size == min(32000, tc["vocab_size"])
    assert cfg.aux_layer_ids == default_aux_layer_ids(tc["num_hidden_layers"])
    assert cfg.max_position_embeddings == tc["max_position_embeddings"]
    assert cfg.rms_norm_eps == tc["rms_norm_eps"]
    d = cfg.to_config_dict()
    assert json.loads(json.dumps(d)) == d                     # plain JSON types only
    assert "ttt_steps" not in d
    assert Eagle3Config.from_config_dict(d) == cfg


def test_kimi_reads_text_config():
    cfg = Eagle3Config.from_target(load_target_config("kimi-k2.5"))
    assert (cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings) == (7168, 163840, 262144)
    assert cfg.rope_theta == 50000.0
    assert cfg.aux_layer_ids == [2, 30, 58]
    d = cfg.to_config_dict()
    assert d["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]


def test_llama31_exact_layout_a_dict():
    cfg = Eagle3Config.from_target(load_target_config("llama-3.1-8b"))
    assert cfg.to_config_dict() == {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "num_hidden_layers": 1, "hidden_size": 4096, "target_hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 14336, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "vocab_size": 128256, "draft_vocab_size": 32000,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "norm_before_residual": False,
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": [1, 15, 28]},
        "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
        "torch_dtype": "bfloat16",
    }


def test_overrides_and_training_fields():
    cfg = Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=500,
                                   aux_layer_ids=[2, 3, 5], num_key_value_heads=4, ttt_steps=3)
    assert (cfg.draft_vocab_size, cfg.aux_layer_ids, cfg.num_key_value_heads, cfg.ttt_steps) == \
        (500, [2, 3, 5], 4, 3)
    back = Eagle3Config.from_config_dict(cfg.to_config_dict(), ttt_steps=3)
    assert back == cfg
    with pytest.raises(TypeError, match="unknown Eagle3Config override"):
        Eagle3Config.from_target(load_target_config("tiny-llama"), num_layers=2)


def test_from_config_dict_accepts_either_spelling_and_rope_parameters():
    d = Eagle3Config.from_target(load_target_config("llama-3.1-8b")).to_config_dict()
    only_sglang = {k: v for k, v in d.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert Eagle3Config.from_config_dict(only_sglang).aux_layer_ids == [2, 16, 29]
    only_vllm = {k: v for k, v in d.items() if k != "eagle_config"}
    assert Eagle3Config.from_config_dict(only_vllm).aux_layer_ids == [2, 16, 29]
    t5 = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    t5["rope_parameters"] = dict(d["rope_scaling"], rope_theta=500000.0)
    back = Eagle3Config.from_config_dict(t5)
    assert back.rope_theta == 500000.0 and back.rope_scaling == d["rope_scaling"]
    # rope_theta at the top level and the scaling only in rope_parameters: the engines take
    # the scaling from rope_parameters, and so does the drafter
    mixed = dict(t5, rope_theta=500000.0)
    theta, scaling = engine_rope_params(mixed)
    back = Eagle3Config.from_config_dict(mixed)
    assert back.rope_scaling == d["rope_scaling"] == {k: v for k, v in scaling.items()}
    assert back.rope_theta == theta == 500000.0


@pytest.mark.parametrize("patch, match", [
    ({"eagle_config": {"use_aux_hidden_state": True,
                       "eagle_aux_hidden_state_layer_ids": [2, 16, 29]}}, "disagree"),
    ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"norm_before_residual": True}, "norm_before_residual"),
    ({"target_hidden_size": None}, "target_hidden_size"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 16, 29],
      "eagle_config": {"use_aux_hidden_state": True,
                       "eagle_aux_hidden_state_layer_ids": [0, 15, 28]}}, "lowest"),
    ({"draft_vocab_size": 200000}, "exceeds"),
])
def test_bad_config_dicts_fail_clearly(patch, match):
    d = Eagle3Config.from_target(load_target_config("llama-3.1-8b")).to_config_dict()
    d.update(patch)
    with pytest.raises(ValueError, match=match):
        Eagle3Config.from_config_dict(d)


def test_unsupported_rope_type_is_refused_or_not_copied():
    with pytest.raises(ValueError, match="deepseek_yarn"):
        Eagle3Config.from_target(load_target_config("tiny-llama"),
                                 rope_scaling={"rope_type": "deepseek_yarn", "factor": 4.0})
    target = load_target_config("deepseek-v3")
    target["rope_scaling"] = {"type": "deepseek_yarn", "factor": 40}
    assert Eagle3Config.from_target(target).rope_scaling is None    # logged, not copied


def test_aux_ids_beyond_target_depth_rejected():
    with pytest.raises(ValueError, match="layers"):
        Eagle3Config.from_target(load_target_config("tiny-llama"), aux_layer_ids=[2, 4, 8])


@pytest.mark.parametrize("name, trainable, embedding", [
    # H·3tH + nh·hd·2H + 2·nkv·hd·2H + H·nh·hd + 3·I·H + 4·H + Vd·H ; V·H
    ("llama-3.1-8b", 424_689_664, 525_336_576),
    ("kimi-k2.5", 963_407_872, 1_174_405_120),
])
def test_meta_construction_parameter_counts(name, trainable, embedding):
    cfg = Eagle3Config.from_target(load_target_config(name))
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg)
    assert drafter.num_trainable_parameters() == trainable
    assert drafter.embed_tokens.weight.numel() == embedding
    assert not drafter.embed_tokens.weight.requires_grad
    assert drafter.fc.weight.shape == (cfg.hidden_size, 3 * cfg.target_hidden_size)
    assert drafter.d2t.shape == (32000,) and drafter.t2d.shape == (cfg.vocab_size,)
