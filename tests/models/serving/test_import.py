"""Warm-start import: existing drafters in the SGLang/EAGLE and speculators layouts → eyas names,
their vocabulary mapping kept exactly; layout A round-trips byte for byte."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.export import export_drafter
from eyas.models.serving.importer import import_drafter, read_drafter_dir
from eyas.data.common.targets import load_target_config
from eyas.models.serving.contract import CORE_TENSORS
from eyas.models.serving.validate import validate

VD = 512


@pytest.fixture(scope="module")
def tcfg():
    return load_target_config("tiny-llama")


@pytest.fixture(scope="module")
def source(tmp_path_factory, tcfg):
    """A layout-A export of a random tiny drafter, and its trained config/state dict."""
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=VD, ttt_steps=3)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, attention="eager").to(torch.bfloat16)
    ids = torch.randperm(cfg.vocab_size)[:VD].sort().values
    drafter.set_vocab_map(ids - torch.arange(VD))
    out = export_drafter(drafter.state_dict(), cfg, None, None,
                         tmp_path_factory.mktemp("src") / "layout_a", target_config=tcfg)
    return out, cfg


def write_dir(d: Path, config: dict, tensors: dict, bin_file: bool = False) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if bin_file:
        torch.save(tensors, d / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
    return d


def test_layout_a_round_trip_is_bit_identical(source, tcfg, tmp_path):
    src, cfg = source
    cfg2, sd, d2t, t2d = import_drafter(src)
    assert cfg2.to_config_dict() == cfg.to_config_dict()
    assert set(sd) == set(CORE_TENSORS) and all(v.dtype == torch.bfloat16 for v in sd.values())
    out = export_drafter(sd, cfg2, d2t, t2d, tmp_path / "again", target_config=tcfg)
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # byte for byte, tensor by tensor
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        assert a[k].contiguous().view(torch.uint8).equal(b[k].contiguous().view(torch.uint8)), k
    assert (src / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert json.loads((src / "config.json").read_text()) == json.loads(
        (out / "config.json").read_text())


def test_sglang_eagle_layout_like_a_kimi_drafter(source, tmp_path, caplog):
    # AQ-MedAI-style: SGLang ids only (eagle_config), fp16 weights, int32 d2t, no t2d,
    # an embedding copy and keys from another trainer
    src, cfg = source
    c = json.loads((src / "config.json").read_text())
    sg_ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    del c["eagle_aux_hidden_state_layer_ids"], c["norm_before_residual"]
    c.update(torch_dtype="float16", transformers_version="4.53.1", bos_token_id=1,
             eagle_config={"eagle_aux_hidden_state_layer_ids": sg_ids,
                           "use_aux_hidden_state": True})
    ts = load_file(src / "model.safetensors")
    d2t = ts["d2t"]
    ts = {k: (v.half() if v.is_floating_point() else v) for k, v in ts.items() if k != "t2d"}
    ts["d2t"] = d2t.int()
    ts["embed_tokens.weight"] = torch.zeros(49152, 64, dtype=torch.float16)
    d = write_dir(tmp_path / "aq", c, ts)
    with caplog.at_level(logging.INFO, logger="eyas.models.serving.importer"):
        imp = import_drafter(d)
    assert "embed_tokens.weight" in caplog.text  # dropped, and said so
    assert imp.config.aux_layer_ids == [i + 1 for i in sg_ids] == cfg.aux_layer_ids
    assert imp.d2t.dtype == torch.int64 and torch.equal(imp.d2t, d2t)
    expected_t2d = torch.zeros(49152, dtype=torch.bool)
    expected_t2d[torch.arange(VD) + d2t] = True
    assert torch.equal(imp.t2d, expected_t2d)
    assert imp.state_dict["fc.weight"].dtype == torch.float16
    assert imp.source_format == "layout-a"


def test_eagle_layout_without_aux_ids_uses_the_target_default(source, tcfg, tmp_path):
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B style: no aux ids, no target_hidden_size, a .bin file
    src, cfg = source
    c = json.loads((src / "config.json").read_text())
    for k in ("eagle_config", "eagle_aux_hidden_state_layer_ids", "target_hidden_size",
              "norm_before_residual"):
        c.pop(k)
    d = write_dir(tmp_path / "eagle", c, load_file(src / "model.safetensors"), bin_file=True)
    with pytest.raises(ValueError, match="aux layer ids"):
        read_drafter_dir(d)
    cfg2, sd, d2t, _ = import_drafter(d, target_config=tcfg)
    assert cfg2.aux_layer_ids == [2, 4, 5] and cfg2.target_hidden_size == 64
    assert torch.equal(d2t, load_file(src / "model.safetensors")["d2t"])


def test_speculators_layout(source, tmp_path):
    src, cfg = source
    ts = load_file(src / "model.safetensors")
    spec_ts = {k.replace("midlayer.", "layers.0."): v for k, v in ts.items()}
    spec_ts["embed_tokens.weight"] = torch.zeros(49152, 64, dtype=torch.bfloat16)
    spec_ts["verifier_lm_head.weight"] = torch.zeros(VD, 64, dtype=torch.bfloat16)
    c = cfg.to_config_dict()
    layer = {k: c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                               "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps",
                               "rope_theta", "max_position_embeddings", "vocab_size")}
    spec_cfg = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": dict(layer, model_type="llama", num_hidden_layers=1,
                                         use_cache=True, torch_dtype="bfloat16"),
        "draft_vocab_size": VD, "norm_before_residual": False, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": cfg.aux_layer_ids,
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "x", "architectures": ["LlamaForCausalLM"]}}}
    d = write_dir(tmp_path / "spec", spec_cfg, spec_ts)
    cfg2, sd, d2t, t2d = import_drafter(d)
    assert cfg2.to_config_dict() == cfg.to_config_dict()
    assert set(sd) == set(CORE_TENSORS)
    for k, v in sd.items():
        assert torch.equal(v, ts[k]), k
    assert torch.equal(d2t, ts["d2t"]) and torch.equal(t2d, ts["t2d"])
    # a norm_before_residual speculators drafter computes another function: refused
    bad = dict(spec_cfg, norm_before_residual=True)
    with pytest.raises(ValueError, match="norm_before_residual"):
        import_drafter(write_dir(tmp_path / "nbr", bad, spec_ts))


def test_eyas_speculators_export_reimports(source, tcfg, tmp_path):
    src, cfg = source
    _, sd, d2t, t2d = import_drafter(src)
    export_drafter(sd, cfg, d2t, t2d, tmp_path / "e", speculators=True, verifier="tiny",
                   target_config=tcfg)
    cfg2, sd2, d2t2, _ = import_drafter(tmp_path / "e-speculators")
    assert cfg2.to_config_dict() == cfg.to_config_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd) and torch.equal(d2t, d2t2)


@pytest.mark.parametrize("flags", [{"norm_output": True}, {"fc_norm": True},
                                   {"norm_before_fc": True, "fc_norm": True, "norm_output": True}])
def test_eyas_speculators_export_of_an_eagle31_drafter_reimports(tcfg, tmp_path, flags):
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=VD, ttt_steps=3, **flags)
    torch.manual_seed(1)
    drafter = Eagle3Drafter(cfg, attention="eager").to(torch.bfloat16)
    drafter.set_vocab_map(torch.randperm(cfg.vocab_size)[:VD].sort().values - torch.arange(VD))
    sd = {k: v for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    export_drafter(sd, cfg, None, None, tmp_path / "e", speculators=True, verifier="tiny",
                   target_config=tcfg)
    cfg2, sd2, _, _ = import_drafter(tmp_path / "e-speculators")
    assert cfg2.to_config_dict() == cfg.to_config_dict()
    assert {k: getattr(cfg2, k) for k in flags} == flags
    assert sd2.keys() == {k for k in sd if k not in ("d2t", "t2d")}
    assert all(torch.equal(sd[k], sd2[k]) for k in sd2)


def test_refusals(source, tmp_path):
    src, _ = source
    c = json.loads((src / "config.json").read_text())
    ts = load_file(src / "model.safetensors")
    no_d2t = {k: v for k, v in ts.items() if k != "d2t"}  # t2d alone does not say the order used
    with pytest.raises(ValueError, match="no d2t"):
        import_drafter(write_dir(tmp_path / "a", c, no_d2t))
    off = dict(c, eagle_aux_hidden_state_layer_ids=c["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"])
    with pytest.raises(ValueError, match="off by one"):
        import_drafter(write_dir(tmp_path / "b", off, ts))
    with pytest.raises(ValueError, match="no place"):
        import_drafter(write_dir(tmp_path / "c", c, dict(ts, **{"layers.1.mlp.up_proj.weight":
                                                                 torch.zeros(1)})))
    with pytest.raises(ValueError, match="not an EAGLE"):
        import_drafter(write_dir(tmp_path / "d", dict(c, architectures=["LlamaForCausalLM"]), ts))


def test_warm_start_loads_into_the_drafter(source, tcfg):
    src, _ = source
    cfg, sd, d2t, t2d = import_drafter(src)
    drafter = Eagle3Drafter(cfg, attention="eager")
    missing, unexpected = drafter.load_state_dict(sd, strict=False)
    assert set(missing) == {"embed_tokens.weight", "d2t", "t2d"} and not unexpected
    drafter.set_vocab_map(d2t, t2d)
    assert torch.equal(drafter.d2t, d2t)
    assert validate(src, tcfg) == []


def test_a_zero_checkpoint_without_deepspeed_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from eyas.data.common.deps import MissingDependency
    from eyas.data.common.log import run_command
    from functools import partial

    from eyas.train.cli import call
    cli_main = partial(call, "export")
    from eyas.models.serving.importer import load_deepspeed_state_dict
    ck = tmp_path / "step-000004"
    (ck / "pytorch_model").mkdir(parents=True)
    (ck / "pytorch_model" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (ck / "eyas.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as for an absent package
    with pytest.raises(MissingDependency, match="needs deepspeed"):
        load_deepspeed_state_dict(ck / "pytorch_model")
    assert run_command("eyas export", cli_main, [str(ck), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eyas export: reading the DeepSpeed ZeRO "
                                               f"checkpoint {ck / 'pytorch_model'} needs deepspeed")
    assert "Fix: pip install deepspeed" in err[0] and not (tmp_path / "out").exists()
