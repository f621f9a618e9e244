"""The static validator: a clean export passes; each deliberately broken export (real files on
disk, one fault each) yields exactly its own finding code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.export import export_drafter
from eyas.data.common.targets import load_target_config
from eyas.models.serving.contract import ERROR, WARNING, TensorDir
from eyas.models.serving.validate import validate
from eyas.models.serving.validate_static import CODES, check_config
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "validate")

VD = 512  # draft vocabulary of the tiny drafter (target vocabulary: 49152)


def make_drafter(tcfg: dict, vd: int = VD, seed: int = 0):
    """(Eagle3Config, state dict, d2t) of a random tiny drafter with a random sorted draft vocab."""
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=vd, ttt_steps=3)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, attention="eager")
    ids = torch.randperm(cfg.vocab_size)[:vd].sort().values
    d2t = ids - torch.arange(vd)
    drafter.set_vocab_map(d2t)
    return cfg, drafter.state_dict(), d2t


@pytest.fixture(scope="module")
def tcfg():
    return load_target_config("tiny-llama")


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tcfg) -> Path:
    cfg, sd, _ = make_drafter(tcfg)
    return export_drafter(sd, cfg, None, None, tmp_path_factory.mktemp("x") / "clean",
                          target_config=tcfg)


def rewrite(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """Copy an export, editing config.json (config(cfg)) and/or the tensors (tensors(dict))."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    ts = load_file(src / "model.safetensors")
    if config:
        config(cfg)
    if tensors:
        tensors(ts)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in ts.items()}, dst / "model.safetensors")
    return dst


def codes(findings) -> set[str]:
    return {f.code for f in findings}


def _rename(ts, fn):
    for k in list(ts):
        ts[fn(k)] = ts.pop(k)


def _set_d2t_ids(ts, ids):
    ts["d2t"] = ids - torch.arange(ids.numel())


def _swap_two_ids(ts):  # same selected set (t2d still matches), order broken
    ids = torch.arange(VD) + ts["d2t"]
    ids[[10, 11]] = ids[[11, 10]]
    _set_d2t_ids(ts, ids)


def _flip_t2d(ts):
    t2d = ts["t2d"].clone()
    free = int((~t2d).nonzero()[0])
    t2d[free] = True
    ts["t2d"] = t2d


def _absolute(ts, keep_t2d):
    ts["d2t"] = torch.arange(VD) + ts["d2t"]  # absolute ids where offsets belong
    if not keep_t2d:
        del ts["t2d"]


def _cfg(**kv):
    return lambda c: c.update(kv)


def _aux(vllm, sglang):
    def f(c):
        c["eagle_aux_hidden_state_layer_ids"] = vllm
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = sglang
    return f


H = 64
# (case id, config edit, tensor edit, exactly the finding codes expected)
CASES = [
    ("layers0", None, lambda t: _rename(t, lambda k: k.replace("midlayer.", "layers.0.")),
     {"NAME_LAYERS0"}),
    ("model_prefix", None, lambda t: _rename(t, lambda k: "model." + k), {"NAME_MODEL_PREFIX"}),
    ("extra_tensor", None, lambda t: t.update(extra=torch.zeros(3, dtype=torch.bfloat16)),
     {"EXTRA_TENSOR"}),
    ("second_layer", None, lambda t: t.update({"layers.1.mlp.up_proj.weight":
                                                t["midlayer.mlp.up_proj.weight"].clone()}),
     {"EXTRA_LAYER"}),
    ("missing_lm_head", None, lambda t: t.pop("lm_head.weight"), {"LM_HEAD_MISSING"}),
    ("missing_tensor", None, lambda t: t.pop("midlayer.hidden_norm.weight"), {"MISSING_TENSOR"}),
    ("missing_d2t", None, lambda t: (t.pop("d2t"), t.pop("t2d")), {"D2T_MISSING"}),
    ("absolute_d2t_with_t2d", None, lambda t: _absolute(t, True), {"D2T_ABSOLUTE"}),
    ("absolute_d2t_alone", None, lambda t: _absolute(t, False), {"D2T_ABSOLUTE"}),
    ("d2t_not_increasing", None, _swap_two_ids, {"D2T_ORDER"}),
    ("d2t_out_of_range", None, lambda t: t["d2t"].__setitem__(-1, 10**6),
     {"D2T_RANGE", "T2D_MISMATCH"}),
    ("d2t_all_zero", None, lambda t: (t.__setitem__("d2t", torch.zeros(VD, dtype=torch.long)),
                                      t.pop("t2d")), {"D2T_IDENTITY"}),
    ("t2d_mismatch", None, _flip_t2d, {"T2D_MISMATCH"}),
    ("d2t_int32", None, lambda t: t.__setitem__("d2t", t["d2t"].int()), {"D2T_DTYPE"}),
    ("t2d_uint8", None, lambda t: t.__setitem__("t2d", t["t2d"].to(torch.uint8)), {"T2D_DTYPE"}),
    ("aux_same_in_both_keys", _aux([2, 4, 5], [2, 4, 5]), None, {"AUX_IDS_MISMATCH"}),
    ("aux_out_of_depth", _aux([2, 4, 8], [1, 3, 7]), None, {"AUX_IDS_RANGE"}),
    ("aux_descending", _aux([5, 4, 2], [4, 3, 1]), None, {"AUX_IDS_ORDER"}),
    ("aux_sglang_spelling_in_vllm_key", _aux([1, 3, 4], [0, 2, 3]), None, {"AUX_IDS_RANGE"}),
    ("aux_missing", lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), None,
     {"AUX_IDS_MISSING"}),
    ("aux_two_ids", _aux([2, 4], [1, 3]), None, {"AUX_IDS_COUNT"}),
    ("use_aux_off", lambda c: c["eagle_config"].update(use_aux_hidden_state=False), None,
     {"USE_AUX_OFF"}),
    ("target_hidden_null", _cfg(target_hidden_size=None), None, {"TARGET_HIDDEN_NULL"}),
    ("num_layers_2", _cfg(num_hidden_layers=2), None, {"NUM_LAYERS"}),
    ("arch_without_eagle", _cfg(architectures=["LlamaForCausalLM"]), None, {"ARCH_NOT_EAGLE"}),
    ("arch_other_eagle", _cfg(architectures=["Eagle3LlamaForCausalLM"]), None,
     {"ARCH_NOT_LAYOUT_A"}),
    ("model_type", _cfg(model_type="deepseek_v3"), None, {"MODEL_TYPE"}),
    ("norm_before_residual", _cfg(norm_before_residual=True), None, {"NORM_BEFORE_RESIDUAL"}),
    ("max_pos_2048", _cfg(max_position_embeddings=2048), None, {"MAX_POS_SHORT"}),
    ("vocab_size", _cfg(vocab_size=32000), None, {"VOCAB_SIZE", "SHAPE"}),
    ("draft_vocab_missing", lambda c: c.pop("draft_vocab_size"), None, {"DRAFT_VOCAB_MISSING"}),
    ("hidden_act", _cfg(hidden_act="gelu"), None, {"HIDDEN_ACT"}),
    ("tie_embeddings", _cfg(tie_word_embeddings=True), None, {"TIE_EMBEDDINGS"}),
    ("bias_config", _cfg(attention_bias=True), None, {"BIAS_CONFIG"}),
    ("forbidden_key", _cfg(logit_scale=1.0), None, {"FORBIDDEN_KEY"}),
    ("torch_dtype", _cfg(torch_dtype="float16"), None, {"TORCH_DTYPE"}),
    ("rope_parameters_only", lambda c: c.update(rope_parameters={"rope_theta": c.pop("rope_theta"),
                                                                "rope_type": "default"}), None,
     {"ROPE_LEGACY"}),
    ("heads_missing", lambda c: c.pop("num_attention_heads"), None, {"DIMS_MISSING"}),
    ("heads_indivisible", _cfg(num_key_value_heads=3), None, {"HEADS_INDIVISIBLE", "SHAPE"}),
    ("hidden_3x_target", _cfg(hidden_size=3 * H), None,
     {"HIDDEN_3X", "HIDDEN_MISMATCH", "SHAPE"}),
    ("target_hidden_mismatch", _cfg(target_hidden_size=32), None,
     {"TARGET_HIDDEN_MISMATCH", "SHAPE"}),
    ("embed_other_width", None,
     lambda t: t.update({"embed_tokens.weight": torch.zeros(49152, 32, dtype=torch.bfloat16)}),
     {"EMBED_WIDTH"}),
    ("embed_same_width", None,
     lambda t: t.update({"embed_tokens.weight": torch.zeros(49152, H, dtype=torch.bfloat16)}),
     {"EMBED_SHIPPED"}),
    ("bias_tensor", None, lambda t: t.update({"midlayer.self_attn.q_proj.bias":
                                              torch.zeros(64, dtype=torch.bfloat16)}),
     {"BIAS_TENSOR"}),
    ("fused_qkv", None, lambda t: t.update({"midlayer.self_attn.qkv_proj.weight": torch.cat(
        [t.pop(f"midlayer.self_attn.{p}_proj.weight") for p in "qkv"])}),
     {"NAME_FUSED", "MISSING_TENSOR"}),
    ("fp32_fp16_mix", None, lambda t: (t.__setitem__("fc.weight", t["fc.weight"].float()),
                                       t.__setitem__("norm.weight", t["norm.weight"].half())),
     {"DTYPE_MIXED"}),
    ("all_fp16", None, lambda t: t.update({k: v.half() for k, v in t.items()
                                           if v.dtype == torch.bfloat16}), {"DTYPE_NOT_BF16"}),
    ("q_proj_input_h", None, lambda t: t.__setitem__(
        "midlayer.self_attn.q_proj.weight", t["midlayer.self_attn.q_proj.weight"][:, :H]),
     {"SHAPE"}),
    ("lm_head_rows", None, lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:100]),
     {"SHAPE"}),
    ("nan_weight", None, lambda t: t["midlayer.mlp.down_proj.weight"].__setitem__((3, 7),
                                                                                   float("nan")),
     {"NONFINITE"}),
]


def test_clean_export_has_no_findings(clean, tcfg):
    assert validate(clean, tcfg) == []
    # the target may also be given as a preset name or a config.json path
    assert validate(clean, "tiny-llama") == []


@pytest.mark.parametrize("case,edit_cfg,edit_tensors,expected", CASES, ids=[c[0] for c in CASES])
def test_each_fault_has_its_finding(clean, tcfg, tmp_path, case, edit_cfg, edit_tensors,
                                    expected):
    broken = rewrite(clean, tmp_path / case, edit_cfg, edit_tensors)
    found = validate(broken, tcfg)
    assert codes(found) == expected, "\n".join(map(str, found))
    for f in found:
        assert f.severity == CODES[f.code] or f.code in ("DIMS_MISSING", "HIDDEN_ACT",
                                                         "TARGET_HIDDEN_NULL", "ROPE_LEGACY")
        assert f.message and f.why and f.fix


def test_rope_parameters_without_the_legacy_keys_engines_read(tcfg):
    d = Eagle3Config.from_target(load_target_config("deepseek-v3")).to_config_dict()
    rp = dict(d.pop("rope_scaling"), rope_theta=d.pop("rope_theta"))
    both_missing = dict(d, rope_parameters=rp)
    theta_kept = dict(both_missing, rope_theta=rp["rope_theta"])
    plain = dict(d, rope_theta=10000.0, rope_parameters={"rope_type": "default",
                                                           "rope_theta": 10000.0})
    legacy = [(f.severity, f.message) for c in (both_missing, theta_kept, plain)
              for f in check_config(c, None) if f.code == "ROPE_LEGACY"]
    assert legacy == [
        (ERROR, "rope_parameters written without the legacy rope_theta / rope_scaling"),
        (ERROR, "rope_parameters written without the legacy rope_scaling")]


def test_severities(clean, tcfg, tmp_path):
    nb = validate(rewrite(clean, tmp_path / "a", _cfg(target_hidden_size=None)), tcfg)
    assert [f.severity for f in nb] == [ERROR]
    absent = validate(rewrite(clean, tmp_path / "b", lambda c: c.pop("target_hidden_size")), tcfg)
    assert [(f.code, f.severity) for f in absent] == [("TARGET_HIDDEN_NULL", WARNING)]


def test_sharded_export_validates_and_bad_index_is_caught(tcfg, tmp_path):
    cfg, sd, _ = make_drafter(tcfg)
    out = export_drafter(sd, cfg, None, None, tmp_path / "sharded", target_config=tcfg,
                         max_shard_bytes=40_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    assert validate(out, tcfg) == []
    assert len(TensorDir(out).names) == 15
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["fc.weight"] = "model-99999-of-99999.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert codes(validate(out, tcfg)) == {"SHARD_INDEX", "CHECKSUM_MISMATCH"}
    shutil.copy(shards[0], out / "stray-copy.safetensors")
    assert {"SHARD_DUPLICATE", "CHECKSUM_UNLISTED"} <= codes(validate(out, tcfg))


def test_kimi_text_config_is_read(clean):
    kimi = load_target_config("kimi-k2.5")
    assert "vocab_size" not in kimi and kimi["text_config"]["vocab_size"] == 163840
    # a drafter derived for Kimi passes the config rules against Kimi's text_config ...
    cfg = Eagle3Config.from_target(kimi).to_config_dict()
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert check_config(cfg, kimi["text_config"]) == []
    # ... and the tiny drafter is told apart from it by the text_config's sizes and context
    found = codes(validate(clean, kimi, check_values=False))
    assert {"VOCAB_SIZE", "TARGET_HIDDEN_MISMATCH", "HIDDEN_MISMATCH", "MAX_POS_SHORT"} <= found


def test_not_a_drafter_directory(tmp_path, tcfg):
    assert codes(validate(tmp_path / "nope", tcfg)) == {"CONFIG_MISSING"}
    (tmp_path / "empty").mkdir()
    assert codes(validate(tmp_path / "empty", tcfg)) == {"CONFIG_MISSING"}
    d = tmp_path / "cfg_only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(Eagle3Config.from_target(tcfg).to_config_dict()))
    assert codes(validate(d, tcfg)) == {"WEIGHTS_MISSING"}


def test_cli_exit_codes(clean, tmp_path, capsys):
    assert cli_main([str(clean), "--target-config", "tiny-llama"]) == 0
    assert "clean" in capsys.readouterr().out
    broken = rewrite(clean, tmp_path / "b", None, lambda t: t.pop("lm_head.weight"))
    assert cli_main([str(broken), "--target-config", "tiny-llama"]) == 1
    assert "LM_HEAD_MISSING" in capsys.readouterr().out
    assert cli_main([str(broken), "--target-config", "tiny-llama", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["code"] == "LM_HEAD_MISSING"
    with pytest.raises(SystemExit) as e:  # --target-config is required
        cli_main([str(clean)])
    assert e.value.code == 2
    assert "error: the following arguments are required: --target-config" in \
        capsys.readouterr().err


def test_speculators_format_export(clean, tcfg, tmp_path):
    """A vLLM-only speculators export: one warning (SGLang cannot read it), then the same rules
    on what it stands for; a missing norm_before_residual there means true in vLLM."""
    from eyas.models.serving.export_speculators import write_speculators_export
    spec = write_speculators_export(clean, tmp_path / "spec", verifier="tiny-llama",
                                    target_config=tcfg, num_speculative_tokens=3)
    assert codes(validate(spec, tcfg)) == {"SPECULATORS_FORMAT"}
    layers0 = rewrite(spec, tmp_path / "l0", None,
                      lambda t: _rename(t, lambda k: k.replace("midlayer.", "layers.0.")))
    assert codes(validate(layers0, tcfg)) == {"SPECULATORS_FORMAT"}  # vLLM reads layers.0.
    no_flag = rewrite(spec, tmp_path / "nf", lambda c: c.pop("norm_before_residual"))
    assert codes(validate(no_flag, tcfg)) == {"SPECULATORS_FORMAT", "NORM_BEFORE_RESIDUAL"}
    short = rewrite(spec, tmp_path / "mp",
                    lambda c: c["transformer_layer_config"].update(max_position_embeddings=2048))
    assert codes(validate(short, tcfg)) == {"SPECULATORS_FORMAT", "MAX_POS_SHORT"}
