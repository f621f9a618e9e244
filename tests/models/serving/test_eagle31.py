"""EAGLE-3.1 norms (drafter.norm_before_fc, fc_norm, norm_output): the training unroll and the
engine-math reference compute the same function with each variant, the export carries the flags
under both engines' spellings with the extra tensors, and the validator refuses the variants an
engine would read differently. (The engines' own loaders: tests/models/serving/test_loaders.py.)
"""

import json

import pytest
import torch

from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.export import export_drafter
from eyas.models.serving.importer import import_drafter
from eyas.models.serving.reference import EngineDrafter, serve_packed
from eyas.models.serving.validate import validate

K = 3
VARIANTS = {"norm_before_fc": dict(norm_before_fc=True), "fc_norm": dict(fc_norm=True),
            "norm_output": dict(norm_output=True),
            "all": dict(norm_before_fc=True, fc_norm=True, norm_output=True)}
TCFG = {"hidden_size": 32, "num_hidden_layers": 8, "vocab_size": 300, "num_attention_heads": 2,
        "intermediate_size": 64}


def _drafter(**flags):
    cfg = Eagle3Config.from_target(TCFG, draft_vocab_size=100, ttt_steps=K, **flags)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="eager")
    d.reset_parameters(std=0.1)
    with torch.no_grad():                       # norms that are not the identity
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or name.startswith("fc_norm"):
                p.copy_(1 + 0.5 * torch.randn(p.shape))
    d.load_target_embedding(torch.randn(300, 32))
    d.set_vocab_map(torch.arange(100) * 2 - torch.arange(100))
    return d


def _batch(T=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (T,), generator=g)
    aux = (torch.randn(T, 96, generator=g) * torch.tensor([1.0, 8.0, 30.0]).repeat_interleave(32))
    doc = torch.tensor([0] * 14 + [1] * 10).int()
    pos = torch.cat([torch.arange(14), torch.arange(10)])
    return ids, aux, doc, pos


def _engine(d):
    tensors = {k: v for k, v in d.state_dict().items() if k != "embed_tokens.weight"}
    return EngineDrafter.from_tensors(d.config.to_config_dict(), tensors, d.embed_tokens.weight,
                                      dtype=torch.float32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_unroll_equals_the_engine_reference(variant):
    d = _drafter(**VARIANTS[variant])
    ids, aux, doc, pos = _batch()
    with torch.no_grad():
        out = d(ids, aux, doc, pos, K)
        train = d.draft_logits(out.hidden)
        plain = _drafter()
        plain.load_state_dict(d.state_dict(), strict=False)   # same shared weights, no variant
        base = plain.draft_logits(plain(ids, aux, doc, pos, K).hidden)
    serve = serve_packed(_engine(d), ids, aux, doc, pos, K)
    valid = out.valid
    assert torch.equal(~torch.isnan(serve[..., 0]), valid)
    scale = float(train[valid].abs().max())
    torch.testing.assert_close(train[valid], serve[valid], atol=1e-5 * scale, rtol=0)
    # the variant changes the function (step 0 for the aux norms, steps >= 1 for norm_output)
    step = 1 if variant == "norm_output" else 0
    assert not torch.allclose(train[step][valid[step]], base[step][valid[step]], atol=1e-3)


def test_export_carries_both_spellings_and_round_trips(tmp_path):
    tcfg = dict(load_target_config("tiny-llama"))
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=512, ttt_steps=K, **VARIANTS["all"])
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="eager")
    out = export_drafter(d.state_dict(), cfg, None, None, tmp_path / "x", target_config=tcfg)
    written = json.loads((out / "config.json").read_text())
    assert written["norm_before_fc"] is written["eagle_config"]["norm_before_fc"] is True
    assert written["fc_norm"] is True and written["norm_output"] is True
    assert [f for f in validate(out, tcfg, numeric=True) if f.severity == "error"] == []
    back = import_drafter(out, tcfg)
    assert (back.config.norm_before_fc, back.config.fc_norm, back.config.norm_output) == \
        (True, True, True)
    for name in ("input_norm.weight", "fc_norm.0.weight", "fc_norm.2.weight"):
        torch.testing.assert_close(back.state_dict[name].float(),
                                   d.state_dict()[name].bfloat16().float())
    # the plain drafter writes none of the keys (older engine builds do not know them)
    plain = Eagle3Config.from_target(tcfg, draft_vocab_size=512).to_config_dict()
    assert not {"norm_before_fc", "fc_norm", "norm_output"} & (set(plain) | set(
        plain["eagle_config"]))


def _codes(path, tcfg):
    return {f.code for f in validate(path, tcfg) if f.severity == "error"}


def test_validator_refuses_what_an_engine_reads_differently(tmp_path):
    tcfg = dict(load_target_config("tiny-llama"))
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=512, ttt_steps=K, norm_before_fc=True)
    torch.manual_seed(0)
    out = export_drafter(Eagle3Drafter(cfg, attention="eager").state_dict(), cfg, None, None,
                         tmp_path / "x", target_config=tcfg)
    good = json.loads((out / "config.json").read_text())

    def edited(**changes):
        c = dict(good, **changes)
        (out / "config.json").write_text(json.dumps({k: v for k, v in c.items()
                                                     if v is not None}))
        (out / "SHA256SUMS").unlink(missing_ok=True)
        return _codes(out, tcfg)

    assert edited() == set()
    # the flag off while input_norm.weight is shipped: the engines drop the trained norm
    assert "EXTRA_TENSOR" in edited(norm_before_fc=None, eagle_config={
        k: v for k, v in good["eagle_config"].items() if k != "norm_before_fc"})
    # fc_norm on without its tensors: they stay at their initial values in both engines
    assert "MISSING_TENSOR" in edited(fc_norm=True)
    assert "EAGLE31_FLAG" in edited(norm_before_fc=False)          # spellings disagree
    assert "EAGLE31_FLAG" in edited(norm_output="false")           # a truthy string
    assert "FORBIDDEN_KEY" in edited(use_aux_norm=True)            # SGLang-only spelling


def test_the_speculators_export_keeps_the_norms(tmp_path):
    """vLLM's speculators reader takes the EAGLE-3.1 flags from the config's top level."""
    from eyas.models.serving.export_speculators import write_speculators_export
    tcfg = dict(load_target_config("tiny-llama"))
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=512, ttt_steps=K, **VARIANTS["all"])
    torch.manual_seed(0)
    out = export_drafter(Eagle3Drafter(cfg, attention="eager").state_dict(), cfg, None, None,
                         tmp_path / "a", target_config=tcfg)
    spec = write_speculators_export(out, tmp_path / "s", verifier="tiny-llama",
                                    target_config=tcfg, num_speculative_tokens=3)
    written = json.loads((spec / "config.json").read_text())
    assert (written["norm_before_fc"], written["fc_norm"], written["norm_output"]) == \
        (True, True, True)
    assert not {"norm_before_fc", "fc_norm", "norm_output"} & set(
        written["transformer_layer_config"])
    assert [f.code for f in validate(spec, tcfg) if f.severity == "error"] == []
