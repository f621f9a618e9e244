"""eagle3_loss compiled on a CUDA device at realistic sizes (skipped without one)."""

import pytest
import torch

from eyas.kernels.loss import eagle3_loss
from eyas.kernels.teacher import teacher_probs

pytestmark = pytest.mark.gpu
GRAD_TOL = 1e-2      # project target: gradients within 1e-2 (norm-wise) of the fp32 reference


def _inputs(K, N, H, V, seed=0, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(seed)
    h = torch.randn(K, N, H, device=dev, generator=g).bfloat16()
    W = (torch.randn(V, H, device=dev, generator=g) * H ** -0.5 * 4).bfloat16()
    p = torch.softmax(torch.randn(N, V, device=dev, generator=g) * 3, 1)
    p = (p * (0.5 + torch.rand(N, 1, device=dev, generator=g))).bfloat16()   # unnormalised
    mask = (torch.rand(K, N, device=dev, generator=g) > 0.2).float()
    valid = (torch.arange(N, device=dev)[None] + torch.arange(K, device=dev)[:, None]) < N
    w = mask * valid * (0.8 ** torch.arange(K, device=dev, dtype=torch.float32))[:, None]
    return h, W, p, w / (mask * valid).sum()


def _reference(h, W, p, w):
    K, N, _ = h.shape
    dev = h.device
    idx = torch.arange(N, device=dev)[None] + torch.arange(K, device=dev)[:, None]
    idx = idx.clamp(max=N - 1)                                                  # [K, N]
    rows, am = [], []
    for k in range(K):
        z = h[k].float() @ W.float().T
        rows.append(w[k] * -(p[idx[k]].float() * torch.log_softmax(z, -1)).sum(-1))
        am.append(z.argmax(-1))
    return torch.stack(rows), torch.stack(am)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gpu_matches_fp32_reference(impl):
    h, W, p, w = _inputs(K=3, N=1000, H=512, V=32003)
    hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
    out = eagle3_loss(hh, WW, p, w, impl=impl, chunk_size=384, with_accept=True)
    (out.loss * 0.5).backward()
    hr, Wr = h.float().requires_grad_(), W.float().requires_grad_()
    rows, am = _reference(hr, Wr, p, w)
    (rows.sum() * 0.5).backward()
    assert abs(out.loss.item() - rows.sum().item()) < 1e-4 * abs(rows.sum().item())
    assert (out.draft_argmax == am).float().mean().item() > 0.999
    assert _rel(hh.grad, hr.grad) < GRAD_TOL and _rel(WW.grad, Wr.grad) < GRAD_TOL
    assert out.accept.min().item() >= 0.0 and out.accept.max().item() <= 1.0 + 1e-5


def test_gpu_triton_equals_torch_twin_and_none_reduction():
    h, W, p, w = _inputs(K=2, N=700, H=256, V=32000, seed=1)
    res = {}
    for impl in ("triton", "torch"):
        for red in ("sum", "none"):
            hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
            out = eagle3_loss(hh, WW, p, w, impl=impl, reduction=red, with_accept=True)
            obj = out.loss if red == "sum" else out.row_loss.square().sum() * 1e4
            obj.backward()
            res[impl, red] = (out, hh.grad, WW.grad)
    a, b = res["triton", "sum"], res["torch", "sum"]
    assert abs(a[0].loss.item() - b[0].loss.item()) < 1e-5 * abs(b[0].loss.item())
    assert torch.equal(a[0].draft_argmax, b[0].draft_argmax)
    torch.testing.assert_close(a[0].accept, b[0].accept, rtol=1e-4, atol=1e-5)
    assert _rel(a[1], b[1]) < 5e-3 and _rel(a[2], b[2]) < 5e-3
    a, b = res["triton", "none"], res["torch", "none"]
    torch.testing.assert_close(a[0].row_loss, b[0].row_loss, rtol=1e-4, atol=1e-7)
    assert _rel(a[1], b[1]) < 5e-3 and _rel(a[2], b[2]) < 5e-3
    # Non-linear objective vs fp32 autograd.
    hr, Wr = h.float().requires_grad_(), W.float().requires_grad_()
    rows, _ = _reference(hr, Wr, p, w)
    (rows.square().sum() * 1e4).backward()
    assert _rel(a[1], hr.grad) < GRAD_TOL and _rel(a[2], Wr.grad) < GRAD_TOL


def test_gpu_int64_teacher_offsets():
    """Teacher row offsets past 2^31 elements (N·Vd > 2^31) must index correctly."""
    N, V, H = 67200, 32000, 64                    # N·V = 2.15e9
    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(1, N, H, device="cuda", generator=g).bfloat16()
    W = torch.randn(V, H, device="cuda", generator=g).bfloat16()
    p = torch.zeros(N, V, device="cuda", dtype=torch.bfloat16)
    tail = torch.arange(N - 8, N, device="cuda")
    p[tail, (tail * 7) % V] = 1.0
    w = torch.zeros(1, N, device="cuda")
    w[0, tail] = 1.0
    out = eagle3_loss(h, W, p, w, impl="triton", reduction="none")
    z = h[0, tail].float() @ W.float().T
    ref = -torch.log_softmax(z, -1)[torch.arange(8, device="cuda"), (tail * 7) % V]
    torch.testing.assert_close(out.row_loss[0, tail], ref, rtol=1e-4, atol=1e-4)
    assert out.row_loss[0, : N - 8].abs().sum().item() == 0.0


def test_gpu_teacher_probs():
    g = torch.Generator(device="cuda").manual_seed(3)
    last = torch.randn(3000, 256, device="cuda", generator=g).bfloat16()
    rows = torch.randn(32000, 256, device="cuda", generator=g).bfloat16() * 0.2
    p = teacher_probs(last, rows, chunk_size=1024)
    ref = torch.softmax(last.float() @ rows.float().T, -1)
    assert _rel(p, ref) < 1e-2



def test_gpu_listed_rows_equal_all_rows():
    """Listed rows (the weighted ones) give the full loss and gradients; argmax −1 elsewhere."""
    h, W, p, w = _inputs(K=3, N=900, H=256, V=32000, seed=2)
    rows = (w.reshape(-1) != 0).nonzero().flatten()
    res = []
    for listed in (None, rows):
        hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
        out = eagle3_loss(hh, WW, p, w, impl="triton", chunk_size=256, with_accept=True,
                          rows=listed)
        out.loss.backward()
        res.append((out, hh.grad, WW.grad))
    (a, dha, dWa), (b, dhb, dWb) = res
    assert abs(a.loss.item() - b.loss.item()) < 1e-5 * abs(a.loss.item())
    m = w != 0
    assert torch.equal(a.draft_argmax[m], b.draft_argmax[m]) and (b.draft_argmax[~m] == -1).all()
    torch.testing.assert_close(a.accept, b.accept, rtol=1e-5, atol=1e-6)
    assert _rel(dhb, dha) < 1e-3 and _rel(dWb, dWa) < 1e-3
    assert not dhb[~m].any()
