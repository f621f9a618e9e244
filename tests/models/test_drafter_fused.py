"""The drafter's fast paths give the eager unroll's results: MLP recompute (CPU) and the
torch.compile'd step pieces on CUDA (skipped without a GPU)."""

import pytest
import torch

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.data.common.targets import load_target_config


def _drafter(device="cpu", dtype=torch.float32, **kw):
    cfg = Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=256,
                                   aux_layer_ids=[2, 4, 5], ttt_steps=4)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, **kw)
    d.embed_tokens.weight.data.normal_()
    return d.to(device, dtype)


def _batch(device="cpu", T=40):
    g = torch.Generator().manual_seed(0)
    lens = [9, 14, 4, 10]
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)]
                    + [torch.full((T - sum(lens),), -1, dtype=torch.int32)])
    pad = torch.zeros(T - sum(lens), dtype=torch.long)
    pos = torch.cat([torch.arange(n) for n in lens] + [pad])
    ids = torch.randint(1, 49152, (T,), generator=g)
    aux = torch.randn(T, 3 * 64, generator=g)
    return [x.to(device) for x in (ids, aux, doc, pos)]


def _run(d, batch):
    d.zero_grad(set_to_none=True)
    out = d(*batch)
    w = torch.randn(out.hidden.shape, generator=torch.Generator().manual_seed(1)).to(out.hidden)
    (out.hidden.float() * w.float()).sum().backward()
    return out.hidden.detach().float(), {n: p.grad.float() for n, p in d.named_parameters()
                                         if p.grad is not None}


def test_checkpoint_mlp_gives_identical_values_and_gradients():
    batch = _batch()
    h0, g0 = _run(_drafter(attention="eager", compile_flex=False), batch)
    h1, g1 = _run(_drafter(attention="eager", compile_flex=False, checkpoint_mlp=True), batch)
    assert torch.equal(h0, h1)
    assert g0.keys() == g1.keys() and len(g0) == 12
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", [False, True])
def test_compiled_layer_matches_eager_on_cuda(ckpt):
    batch = _batch("cuda", T=256)
    ref = _drafter("cuda", torch.float32, attention="flex", compile_layer=False)
    h0, g0 = _run(ref, batch)
    fast = _drafter("cuda", torch.float32, attention="flex", compile_layer=True,
                    checkpoint_mlp=ckpt)
    h1, g1 = _run(fast, batch)
    torch.testing.assert_close(h1, h0, rtol=1e-4, atol=1e-4)
    for n in g0:
        rel = ((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-12)).item()
        assert rel < 1e-3, (n, rel)


@pytest.mark.parametrize("norm_output", [False, True])
def test_embedding_qkv_once_gives_the_per_step_values_and_gradients(norm_output):
    """One projection of the embedding half for all K steps (step k reads rows shifted by k)
    against the concatenated [norm(embed) | norm(g)] input of every step, fp32."""
    batch = _batch()
    runs = []
    for once in (False, True):
        d = _drafter(attention="eager", compile_flex=False, embedding_qkv_once=once)
        d.config.norm_output = norm_output
        runs.append(_run(d, batch))
    (h0, g0), (h1, g1) = runs
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) == 12
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.gpu
def test_embedding_qkv_once_compiled_in_bf16_stays_within_rounding_on_cuda():
    """bf16, compiled: the split sum differs from the single GEMM only by bf16 rounding."""
    batch = _batch("cuda", T=256)
    ref = _drafter("cuda", torch.float32, attention="flex", compile_layer=False,
                   embedding_qkv_once=False)
    h_ref, g_ref = _run(ref, batch)
    out = {}
    for once in (False, True):
        d = _drafter("cuda", torch.bfloat16, attention="flex", compile_layer=True,
                     embedding_qkv_once=once)
        out[once] = _run(d, batch)
    for once, (h, g) in out.items():     # each as far from the fp32 unroll as the other
        err = ((h - h_ref).norm() / h_ref.norm()).item()
        base = ((out[False][0] - h_ref).norm() / h_ref.norm()).item()
        assert err < 2 * base + 1e-3, (once, err, base)
        for n in g_ref:
            rel = ((g[n] - g_ref[n]).norm() / g_ref[n].norm().clamp_min(1e-12)).item()
            assert rel < 0.05, (once, n, rel)


@pytest.mark.gpu
def test_fp8_split_qkv_compiled_stays_as_close_to_fp32_as_the_default_fp8_on_cuda():
    """drafter.fp8_split_qkv through the compiled step graphs on the GPU's FP8 GEMMs: as far
    from the fp32 unroll as the default FP8 path (which quantises the embedding half too)."""
    pytest.importorskip("torchao.float8")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA device with FP8 GEMMs (sm_89+)")
    from eyas.models.fp8 import convert_drafter_to_float8
    batch = _batch("cuda", T=256)
    h_ref, g_ref = _run(_drafter("cuda", torch.float32, attention="flex", compile_layer=False),
                        batch)
    err = {}
    for split in (False, True):
        d = _drafter("cuda", torch.bfloat16, attention="flex", compile_layer=True,
                     fp8_split_qkv=split)
        convert_drafter_to_float8(d, "tensorwise")
        assert d.plan(torch.device("cuda")).split == split
        h, g = _run(d, batch)
        err[split] = ((h - h_ref).norm() / h_ref.norm()).item()
        assert g.keys() == g_ref.keys()
    assert err[True] < 1.5 * err[False] + 1e-3, err
