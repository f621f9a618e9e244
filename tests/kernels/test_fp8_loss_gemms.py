"""benchmarks/fp8_loss_gemms.py: its fp32 reference is the loss's gradient, its e4m3
quantiser rounds as e4m3 does, and its bf16 row stays inside the loss's tolerance (CPU)."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fp8_loss_gemms",
                                               ROOT / "benchmarks" / "fp8_loss_gemms.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _inputs(N=64, H=96, V=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).bfloat16()
    W = (torch.randn(V, H, generator=g) * 2 * H ** -0.5).bfloat16()
    p = torch.softmax(torch.randn(N, V, generator=g) * 2, 1)
    w = torch.rand(N, generator=g) / N
    return h, W, p, w


def test_the_fp32_chain_is_the_gradient_of_the_soft_cross_entropy():
    h, W, p, w = _inputs()
    loss, dh, dW = bench.chain(h, W, p, w, "fp32")
    hd, Wd = h.double().requires_grad_(), W.double().requires_grad_()
    ref = (w.double() * -(p.double() * torch.log_softmax(hd @ Wd.T, 1)).sum(1)).sum()
    ref.backward()
    assert torch.allclose(loss.double(), ref, rtol=1e-5)
    assert torch.allclose(dh.double(), hd.grad, rtol=1e-4, atol=1e-7)
    assert torch.allclose(dW.double(), Wd.grad, rtol=1e-4, atol=1e-7)


def test_quantise_maps_each_row_max_to_the_e4m3_max_and_rounds_within_its_precision():
    x = torch.randn(8, 200, generator=torch.Generator().manual_seed(1))
    x = x * torch.logspace(-3, 3, 8)[:, None]                       # rows of very unequal size
    for rowwise in (True, False):
        q, scale = bench.quantise(x, rowwise)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == ((8, 1) if rowwise else (1, 1))
        back = q.float() * scale
        big = x.abs() > x.abs().amax(1 if rowwise else None, keepdim=True) / 64   # normals
        assert ((back - x).abs()[big] <= x.abs()[big] * 2.0 ** -4 + 1e-12).all()
        top = q.float().abs().amax(1) if rowwise else q.float().abs().amax()
        assert torch.all(top == bench.E4M3_MAX)
        peak = x.abs().amax(1) if rowwise else x.abs().amax()       # comes back exactly
        assert torch.allclose(back.abs().amax(1) if rowwise else back.abs().amax(), peak,
                              rtol=1e-6)


def test_bf16_gemms_stay_inside_the_loss_tolerance_and_fp8_ones_do_not():
    h, W, p, w = _inputs(N=128, H=256, V=1024)
    ref = bench.chain(h, W, p, w, "fp32")
    errors = {m: [bench.rel(a, b) for a, b in zip(bench.chain(h, W, p, w, m)[1:], ref[1:])]
              for m in ("bf16", "fp8-row", "fp8-tensor")}
    assert max(errors["bf16"]) < 1e-2
    assert min(errors["fp8-row"] + errors["fp8-tensor"]) > max(errors["bf16"]) * 5


@pytest.mark.gpu                                    # torch._scaled_mm: skipped without CUDA
@pytest.mark.parametrize("rowwise", [True, False])
def test_scaled_mm_on_the_gpu_is_the_emulation(rowwise):
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(256, 512, device="cuda", generator=g).bfloat16()
    b_t = torch.randn(384, 512, device="cuda", generator=g).bfloat16()
    qa, sa = bench.quantise(a, rowwise)
    qb, sb = bench.quantise(b_t, rowwise)
    emulated = (qa.float() * sa) @ (qb.float() * sb).t()
    assert torch.allclose(bench.fp8_mm(a, b_t, rowwise), emulated, rtol=1e-4, atol=1e-3)
