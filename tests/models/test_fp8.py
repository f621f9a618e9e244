"""models.fp8: torchao float8 training linears in the drafter (run on the CPU's FP8 emulation)."""

import sys

import pytest
import torch

from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.fp8 import FP8_LAYERS, convert_drafter_to_float8

DOC = torch.tensor([0] * 20 + [1] * 12, dtype=torch.int32)
POS = torch.cat([torch.arange(20), torch.arange(12)])


def _drafter(seed=0, **shape):
    cfg = Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=256,
                                   aux_layer_ids=[2, 4, 5], ttt_steps=3, **shape)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg, attention="eager", compile_flex=False)
    d.embed_tokens.weight.data.normal_()
    return d


def _loss(d, seed=1):
    g = torch.Generator().manual_seed(seed)
    tH = d.config.target_hidden_size
    ids = torch.randint(0, d.config.vocab_size, (32,), generator=g)
    aux = torch.randn(32, 3 * tH, generator=g)
    out = d(ids, aux, DOC, POS)
    return (d.draft_logits(out.hidden).logsumexp(-1) * out.valid).sum()


def _assert_trains_close(plain, fp8, a, b):
    """Losses a (plain) and b (FP8) within FP8's tolerance, and every gradient within 15 %."""
    torch.testing.assert_close(b, a, rtol=2e-2, atol=0)
    a.backward()
    b.backward()
    for (name, p), q in zip(plain.named_parameters(), fp8.parameters()):
        if p.grad is not None:
            rel = (q.grad - p.grad).norm() / p.grad.norm()
            assert rel < 0.15, f"{name}: FP8 gradient {rel:.3f} from the plain one"


def test_fp8_drafter_keeps_names_and_trains_close_to_the_plain_one():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear
    plain, fp8 = _drafter(), _drafter()
    names = convert_drafter_to_float8(fp8, "tensorwise", FP8_LAYERS)
    assert names == ["fc", "midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj",
                     "midlayer.self_attn.v_proj", "midlayer.self_attn.o_proj",
                     "midlayer.mlp.gate_proj", "midlayer.mlp.up_proj", "midlayer.mlp.down_proj"]
    assert isinstance(fp8.midlayer.mlp.down_proj, Float8Linear)
    assert type(fp8.lm_head) is torch.nn.Linear                 # the fused loss applies it
    assert fp8.state_dict().keys() == plain.state_dict().keys()  # checkpoints and export as before
    a, b = _loss(plain), _loss(fp8)
    assert a.item() != b.item()                                  # the GEMMs really ran in FP8
    _assert_trains_close(plain, fp8, a, b)


def test_off_is_a_no_op_and_bad_input_is_refused(monkeypatch):
    d = _drafter()
    assert convert_drafter_to_float8(d, "off") == []
    with pytest.raises(ValueError, match="drafter.fp8='fast'; choose one of"):
        convert_drafter_to_float8(d, "fast")
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"drafter.fp8=rowwise needs torchao \(pip install"):
        convert_drafter_to_float8(d, "rowwise")


def test_a_layer_not_divisible_by_16_is_named():
    pytest.importorskip("torchao.float8")
    d = _drafter(intermediate_size=40)
    with pytest.raises(ValueError, match=r"layer midlayer.mlp.gate_proj has weight \[40, "):
        convert_drafter_to_float8(d, "tensorwise")


def test_the_default_keeps_fc_in_bf16():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear
    d = _drafter()
    names = convert_drafter_to_float8(d, "tensorwise")
    assert names == ["midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj",
                     "midlayer.self_attn.v_proj", "midlayer.self_attn.o_proj",
                     "midlayer.mlp.gate_proj", "midlayer.mlp.up_proj", "midlayer.mlp.down_proj"]
    assert type(d.fc) is torch.nn.Linear and isinstance(d.midlayer.mlp.up_proj, Float8Linear)


def test_fp8_layers_keeps_the_others_in_bf16_and_refuses_unknown_names():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear
    d = _drafter()
    names = convert_drafter_to_float8(d, "tensorwise", ("q_proj", "down_proj"))
    assert names == ["midlayer.self_attn.q_proj", "midlayer.mlp.down_proj"]
    assert isinstance(d.midlayer.self_attn.q_proj, Float8Linear)
    assert isinstance(d.midlayer.mlp.down_proj, Float8Linear)
    assert type(d.fc) is torch.nn.Linear and type(d.midlayer.mlp.up_proj) is torch.nn.Linear
    for bad in (("fc", "lm_head"), (), ("fc", "fc")):
        with pytest.raises(ValueError, match=r"drafter.fp8_layers=.*non-empty list of distinct"):
            convert_drafter_to_float8(_drafter(), "tensorwise", bad)


def _split(**kw):
    """tiny drafters with q/k/v alone in FP8: the default path, the split one, and bf16 math"""
    from eyas.models.fp8 import convert_drafter_to_float8 as convert
    whole, split, plain = _drafter(**kw), _drafter(**kw), _drafter(**kw)
    split.fp8_split_qkv = True
    for d in (whole, split):
        convert(d, "tensorwise", ("q_proj", "k_proj", "v_proj"))
    return whole, split, plain


def test_fp8_split_qkv_keeps_the_embedding_half_exact():
    pytest.importorskip("torchao.float8")
    whole, split, plain = _split()
    H = plain.config.hidden_size
    for d in (whole, split, plain):                 # the hidden halves contribute nothing
        for p in (d.midlayer.self_attn.q_proj, d.midlayer.self_attn.k_proj,
                  d.midlayer.self_attn.v_proj):
            p.weight.data[:, H:] = 0
    with torch.no_grad():
        assert torch.equal(_loss(split), _loss(plain))   # the embedding half stayed in bf16 math
        assert not torch.equal(_loss(whole), _loss(plain))   # the default quantises it too


def test_fp8_split_qkv_trains_close_to_the_plain_drafter():
    pytest.importorskip("torchao.float8")
    whole, split, plain = _split()
    cpu = torch.device("cpu")
    assert split.plan(cpu).split and not whole.plan(cpu).split
    a, b, c = _loss(plain), _loss(split), _loss(whole)
    assert b.item() != a.item() and b.item() != c.item()    # FP8 GEMMs, not the default's
    _assert_trains_close(plain, split, a, b)
