"""eagle3_loss (Triton under the interpreter, and the torch twin) against an fp32 autograd
reference written here. Shapes are tiny (V=300 with 128-wide vocabulary blocks: three blocks,
the last one partial; chunks of 5 rows so chunks straddle TTT steps)."""

import math

import pytest
import torch

import eyas.kernels.loss as loss_module
from eyas.kernels.loss import eagle3_loss

triton = pytest.importorskip("triton")
from eyas.kernels import fused_loss  # noqa: E402

IMPLS = ["triton", "torch"]
# Relative (norm-wise) tolerances against the fp32 reference.
TOL_F32 = 2e-5    # fp32 inputs: only summation order differs
TOL_BF16 = 1e-2   # bf16 inputs: dz is rounded to bf16 (the interpreter truncates: up to 2^-8)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Stream the vocabulary in 128-wide blocks so V=300 takes three (the last partial)."""
    monkeypatch.setattr(fused_loss, "MAX_BLOCK_V", 128)


def reference(h, W, p, w):
    """fp32 autograd reference: per-row w·CE [K,N], argmax [K,N], accept [K,N]."""
    K, N, _ = h.shape
    idx = (torch.arange(N)[None, :] + torch.arange(K)[:, None]).clamp(max=N - 1)   # [K, N]
    z = torch.einsum("knh,vh->knv", h.float(), W.float())                           # [K, N, V]
    logq = torch.log_softmax(z, dim=-1)
    pk = p.float()[idx]                                                              # [K, N, V]
    active = w != 0
    pk = torch.where(active[..., None], pk, 0.0)
    rows = torch.where(active, w * -(pk * logq).sum(-1), 0.0)
    phat = pk / pk.sum(-1, keepdim=True).clamp_min(1e-30)
    accept = torch.where(active, torch.minimum(phat, logq.exp()).sum(-1), 0.0)
    return rows, z.argmax(-1), accept


def make_inputs(K=3, N=7, H=16, V=300, dtype=torch.float32, teacher_dtype=torch.float32,
                seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(K, N, H, generator=g) * scale).to(dtype)
    W = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    p = torch.softmax(torch.randn(N, V, generator=g) * 2, dim=1)
    p = p * (0.5 + 1.5 * torch.rand(N, 1, generator=g))               # unnormalised rows
    mask = (torch.rand(K, N, generator=g) > 0.25).float()
    valid = (torch.arange(N)[None, :] + torch.arange(K)[:, None]) < N
    step_w = 0.8 ** torch.arange(K, dtype=torch.float32)[:, None]
    w = mask * valid * step_w / max(1.0, float((mask * valid).sum()))
    return h, W, p.to(teacher_dtype), w


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_both(impl, h, W, p, w, *, grad_out=1.0, **kw):
    """(LossOutput, dh, dW) of eagle3_loss and (rows, argmax, accept, dh, dW) of the reference."""
    hh = h.clone().requires_grad_()
    WW = W.clone().requires_grad_()
    out = eagle3_loss(hh, WW, p, w, impl=impl, **kw)
    (out.loss * grad_out).backward()
    hr = h.detach().float().clone().requires_grad_()
    Wr = W.detach().float().clone().requires_grad_()
    rows, am, acc = reference(hr, Wr, p, w)
    (rows.sum() * grad_out).backward()
    return out, hh.grad, WW.grad, (rows.detach(), am, acc, hr.grad, Wr.grad)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,teacher_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32)])
def test_matches_fp32_reference(impl, dtype, teacher_dtype):
    h, W, p, w = make_inputs(dtype=dtype, teacher_dtype=teacher_dtype)
    out, dh, dW, (rows, am, acc, dh_ref, dW_ref) = run_both(
        impl, h, W, p, w, grad_out=0.7, chunk_size=5, with_accept=True)
    tol = TOL_F32 if dtype == torch.float32 else TOL_BF16
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert math.isclose(out.loss.item(), rows.sum().item(), rel_tol=1e-5)
    assert out.draft_argmax.dtype == torch.int64 and torch.equal(out.draft_argmax, am)
    torch.testing.assert_close(out.accept, acc, rtol=1e-5, atol=1e-6)
    assert out.row_loss is None
    assert dh.dtype == dtype and dW.dtype == dtype
    assert rel_err(dh, dh_ref) < tol
    assert rel_err(dW, dW_ref) < tol


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunk,group", [(4, 8), (3, 3), (8, 16), (5, 40)])
def test_chunks_and_gemm_groups_partition_rows(impl, chunk, group, monkeypatch):
    """K·N = 21 rows in z chunks of C rows and dh/dW groups of G rows (partial last ones)."""
    monkeypatch.setattr(loss_module, "DZ_BYTES", group * 300 * 2)
    assert loss_module._group_rows(chunk, 300, 21) == min(group, 21)
    h, W, p, w = make_inputs(K=3, N=7, V=300, seed=6)
    out, dh, dW, (rows, am, acc, dh_ref, dW_ref) = run_both(
        impl, h, W, p, w, chunk_size=chunk, with_accept=True)
    assert math.isclose(out.loss.item(), rows.sum().item(), rel_tol=1e-5)
    assert torch.equal(out.draft_argmax, am)
    torch.testing.assert_close(out.accept, acc, rtol=1e-5, atol=1e-6)
    assert rel_err(dh, dh_ref) < TOL_F32 and rel_err(dW, dW_ref) < TOL_F32


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_rows_and_all_masked_batch(impl):
    h, W, p, w = make_inputs(K=2, N=6, V=200)
    w[0, :3] = 0.0
    out, dh, dW, (rows, am, _, dh_ref, dW_ref) = run_both(impl, h, W, p, w, chunk_size=4)
    assert rel_err(dh, dh_ref) < TOL_F32 and rel_err(dW, dW_ref) < TOL_F32
    assert torch.equal(dh[0, :3], torch.zeros_like(dh[0, :3]))   # masked rows: exactly 0
    # An all-masked batch costs nothing, even with a garbage (NaN) teacher.
    p_nan = torch.full_like(p, float("nan"))
    hh = h.clone().requires_grad_()
    WW = W.clone().requires_grad_()
    out = eagle3_loss(hh, WW, p_nan, torch.zeros_like(w), impl=impl, with_accept=True,
                      chunk_size=4)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.equal(out.accept, torch.zeros_like(out.accept))
    assert torch.equal(out.draft_argmax, am)                     # argmax is for every row
    assert not hh.grad.any() and not WW.grad.any()


@pytest.mark.parametrize("impl", IMPLS)
def test_argmax_ties_take_first_index(impl):
    K, N, H, V = 1, 4, 8, 300
    h = torch.zeros(K, N, H)
    h[..., 0] = 1.0
    W = torch.randn(V, H) * 0.1
    W[:, 0] = torch.linspace(-1, 0, V)                      # column 0 sets the logit order
    ties = {0: [130, 131, 290], 1: [5, 260], 2: [129, 128], 3: [299, 7]}
    for t, cols in ties.items():
        h[0, t, 1 + t] = 1.0                                 # a row-specific feature...
        W[cols, 1 + t] = 10.0                                # ...ties these columns at the top
        W[cols, 0] = 0.0
    p = torch.softmax(torch.randn(N, V), dim=1)
    out = eagle3_loss(h, W, p, torch.ones(K, N), impl=impl, chunk_size=3)
    assert out.draft_argmax[0].tolist() == [min(c) for c in ties.values()]


@pytest.mark.parametrize("impl", IMPLS)
def test_saturated_rows_point_mass_teacher(impl):
    K, N, H, V = 2, 4, 8, 300
    g = torch.Generator().manual_seed(3)
    h = torch.zeros(K, N, H)
    h[..., 0] = 1.0
    W = torch.where(torch.rand(V, H, generator=g) > 0.5, 30.0, -30.0)   # logits exactly ±30
    W[:, 1:] = 0.0
    p = torch.zeros(N, V)
    lo = int((W[:, 0] < 0).nonzero()[0])                     # point mass on a −30 logit...
    hi = int((W[:, 0] > 0).nonzero()[-1])                    # ...or on a +30 logit
    p[0::2, lo] = 1.0
    p[1::2, hi] = 1.0
    w = torch.ones(K, N)
    w[1, -1] = 0.0
    out, dh, dW, (rows, _, acc, dh_ref, dW_ref) = run_both(impl, h, W, p, w, with_accept=True)
    assert torch.isfinite(out.loss)
    assert math.isclose(out.loss.item(), rows.sum().item(), rel_tol=1e-5)
    torch.testing.assert_close(out.accept, acc, rtol=1e-5, atol=1e-6)
    assert rel_err(dh, dh_ref) < TOL_F32 and rel_err(dW, dW_ref) < TOL_F32


@pytest.mark.parametrize("impl", IMPLS)
def test_teacher_shift_by_step(impl):
    """Step k of row t is scored against teacher row t+k: with a one-hot teacher p[t] = e_t,
    the per-row loss is exactly −log softmax(z[k, t])[t + k]."""
    K, N, H, V = 3, 6, 8, 150
    h, W, _, _ = make_inputs(K=K, N=N, H=H, V=V)
    p = torch.zeros(N, V)
    p[torch.arange(N), torch.arange(N)] = 1.0
    w = ((torch.arange(N)[None, :] + torch.arange(K)[:, None]) < N).float()
    out = eagle3_loss(h, W, p, w, impl=impl, reduction="none", chunk_size=4)
    logq = torch.log_softmax(torch.einsum("knh,vh->knv", h, W), -1)
    for k in range(K):
        for t in range(N - k):
            assert math.isclose(out.row_loss[k, t].item(), -logq[k, t, t + k].item(),
                                rel_tol=1e-5)
        assert torch.equal(out.row_loss[k, N - k:], torch.zeros(k))


@pytest.mark.parametrize("impl", IMPLS)
def test_reduction_none_nonlinear_objective(impl):
    h, W, p, w = make_inputs(K=2, N=6, V=200, seed=1)
    c = torch.rand(w.shape, generator=torch.Generator().manual_seed(2))

    def objective(rows):                      # non-linear in the row loss, like an LK loss
        return (c * rows.square()).sum() + torch.log1p(rows.sum())

    hh = h.clone().requires_grad_()
    WW = W.clone().requires_grad_()
    out = eagle3_loss(hh, WW, p, w, impl=impl, reduction="none", chunk_size=5,
                      with_accept=True)
    objective(out.row_loss).backward()
    hr = h.clone().requires_grad_()
    Wr = W.clone().requires_grad_()
    rows, am, acc = reference(hr, Wr, p, w)
    objective(rows).backward()
    torch.testing.assert_close(out.row_loss, rows.detach(), rtol=1e-5, atol=1e-7)
    assert math.isclose(out.loss.item(), rows.sum().item(), rel_tol=1e-5)
    assert torch.equal(out.draft_argmax, am)
    torch.testing.assert_close(out.accept, acc, rtol=1e-5, atol=1e-6)
    assert rel_err(hh.grad, hr.grad) < TOL_F32 and rel_err(WW.grad, Wr.grad) < TOL_F32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_torch_twin(dtype):
    h, W, p, w = make_inputs(K=2, N=9, V=300, dtype=dtype, seed=4)
    res = {}
    for impl in IMPLS:
        hh = h.clone().requires_grad_()
        WW = W.clone().requires_grad_()
        out = eagle3_loss(hh, WW, p, w, impl=impl, with_accept=True, chunk_size=7)
        (out.loss * 1.3).backward()
        res[impl] = (out, hh.grad.float(), WW.grad.float())
    (a, dha, dWa), (b, dhb, dWb) = res["triton"], res["torch"]
    assert math.isclose(a.loss.item(), b.loss.item(), rel_tol=1e-5)
    assert torch.equal(a.draft_argmax, b.draft_argmax)
    torch.testing.assert_close(a.accept, b.accept, rtol=1e-5, atol=1e-6)
    # In bf16 both round dz (the interpreter truncates, torch rounds to nearest).
    tol = TOL_F32 if dtype == torch.float32 else TOL_BF16
    assert rel_err(dha, dhb) < tol and rel_err(dWa, dWb) < tol


def test_large_vocab_torch_twin():
    """Vd = 163840 (Kimi-K2-sized draft vocabularies; SpecForge's kernel stops at 131072)."""
    h, W, p, w = make_inputs(K=2, N=3, H=8, V=163840, seed=5)
    w[:] = 1.0
    out, dh, dW, (rows, am, acc, dh_ref, dW_ref) = run_both(
        "torch", h, W, p, w, grad_out=2.0, chunk_size=2, with_accept=True)
    assert math.isclose(out.loss.item(), rows.sum().item(), rel_tol=1e-5)
    assert torch.equal(out.draft_argmax, am)
    torch.testing.assert_close(out.accept, acc, rtol=1e-5, atol=1e-6)
    assert rel_err(dh, dh_ref) < TOL_F32 and rel_err(dW, dW_ref) < TOL_F32


@pytest.mark.parametrize("impl", IMPLS)
def test_no_grad_and_frozen_head(impl):
    h, W, p, w = make_inputs(K=2, N=5, V=130)
    rows, am, _ = reference(h, W, p, w)
    with torch.no_grad():
        out = eagle3_loss(h.requires_grad_(), W, p, w, impl=impl)
    assert not out.loss.requires_grad
    assert math.isclose(out.loss.item(), rows.sum().item(), rel_tol=1e-5)
    hh = h.detach().clone().requires_grad_()
    out = eagle3_loss(hh, W, p, w, impl=impl)                  # weight frozen: only dh
    out.loss.backward()
    hr = h.detach().clone().requires_grad_()
    reference(hr, W, p, w)[0].sum().backward()
    assert rel_err(hh.grad, hr.grad) < TOL_F32


def test_second_backward_is_refused():
    h, W, p, w = make_inputs(K=1, N=4, V=50)
    out = eagle3_loss(h.requires_grad_(), W, p, w, impl="torch")
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        out.loss.backward()


def test_bad_inputs_raise_clear_errors(monkeypatch):
    h, W, p, w = make_inputs(K=2, N=5, V=40)
    with pytest.raises(ValueError, match="teacher must be"):
        eagle3_loss(h, W, p[:4], w, impl="torch")
    with pytest.raises(ValueError, match="row_weight must be"):
        eagle3_loss(h, W, p, w[0], impl="torch")
    with pytest.raises(ValueError, match="weight must be"):
        eagle3_loss(h, W[:, :3], p, w, impl="torch")
    with pytest.raises(ValueError, match="share a float dtype"):
        eagle3_loss(h.bfloat16(), W, p, w, impl="torch")
    with pytest.raises(ValueError, match="loss.impl"):
        eagle3_loss(h, W, p, w, impl="cuda")
    with pytest.raises(ValueError, match="reduction"):
        eagle3_loss(h, W, p, w, impl="torch", reduction="mean")
    monkeypatch.setattr(fused_loss, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="loss.impl=torch"):
        eagle3_loss(h, W, p, w, impl="triton")


def test_chunk_and_group_sizes():
    from eyas.kernels.loss import _group_rows
    assert loss_module.auto_chunk_size(32000, 10**6) == 1024      # 128 MiB fp32 z buffer
    assert loss_module.auto_chunk_size(163840, 10**6) == 128
    assert loss_module.auto_chunk_size(32000, 100) == 100
    assert _group_rows(1024, 32000, 10**6) == 6144            # 384 MiB bf16 dz buffer
    assert _group_rows(1000, 32000, 10**6) == 6000
    assert _group_rows(1024, 32000, 1500) == 1500
    assert _group_rows(4096, 163840, 10**6) == 4096


# --------------------------------------------------------------------------- listed rows
def listed_rows(w, extra=3, seed=0):
    """Global ids of the weighted rows plus a few zero-weight ones (metric-only rows)."""
    flat = w.reshape(-1)
    zero = (flat == 0).nonzero().flatten()
    pick = zero[torch.randperm(len(zero), generator=torch.Generator().manual_seed(seed))[:extra]]
    return torch.cat([(flat != 0).nonzero().flatten(), pick]).sort().values


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunk,group", [(3, 6), (1, 40)])
def test_listed_rows_skip_unlisted_rows(impl, chunk, group, monkeypatch):
    """Only listed rows enter the GEMMs; results equal the full computation on those rows and
    unlisted rows read loss 0, argmax −1, accept 0, dh 0. Small groups keep dh in z's buffer,
    large ones need a separate one."""
    monkeypatch.setattr(loss_module, "DZ_BYTES", group * 300 * 2)
    h, W, p, w = make_inputs(K=3, N=7, H=64, V=300, seed=8)
    rows = listed_rows(w)
    assert 0 < len(rows) < w.numel()
    out, dh, dW, (ref_rows, am, acc, dh_ref, dW_ref) = run_both(
        impl, h, W, p, w, chunk_size=chunk, with_accept=True, rows=rows)
    listed = torch.zeros(w.numel(), dtype=torch.bool)
    listed[rows] = True
    listed = listed.view_as(w)
    assert math.isclose(out.loss.item(), ref_rows.sum().item(), rel_tol=1e-5)
    assert torch.equal(out.draft_argmax[listed], am[listed])
    assert (out.draft_argmax[~listed] == -1).all()
    torch.testing.assert_close(out.accept, acc, rtol=1e-5, atol=1e-6)
    assert rel_err(dh, dh_ref) < TOL_F32 and rel_err(dW, dW_ref) < TOL_F32
    assert not dh[~listed].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_listed_rows_reduction_none(impl):
    h, W, p, w = make_inputs(K=2, N=6, V=200, seed=9)
    rows = listed_rows(w, extra=1)
    hh = h.clone().requires_grad_()
    WW = W.clone().requires_grad_()
    out = eagle3_loss(hh, WW, p, w, impl=impl, reduction="none", chunk_size=4, rows=rows)
    out.row_loss.square().sum().backward()
    hr = h.clone().requires_grad_()
    Wr = W.clone().requires_grad_()
    ref_rows = reference(hr, Wr, p, w)[0]
    ref_rows.square().sum().backward()
    torch.testing.assert_close(out.row_loss, ref_rows.detach(), rtol=1e-5, atol=1e-7)
    assert rel_err(hh.grad, hr.grad) < TOL_F32 and rel_err(WW.grad, Wr.grad) < TOL_F32


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_row_list(impl):
    h, W, p, w = make_inputs(K=2, N=5, V=60)
    hh = h.clone().requires_grad_()
    WW = W.clone().requires_grad_()
    out = eagle3_loss(hh, WW, p, torch.zeros_like(w), impl=impl,
                      rows=torch.zeros(0, dtype=torch.int64))
    out.loss.backward()
    assert out.loss.item() == 0.0 and (out.draft_argmax == -1).all()
    assert not hh.grad.any() and not WW.grad.any()


def test_bad_row_list_raises():
    h, W, p, w = make_inputs(K=2, N=5, V=40)
    with pytest.raises(ValueError, match="rows must be a 1-D int64"):
        eagle3_loss(h, W, p, w, impl="torch", rows=torch.tensor([0, 1], dtype=torch.int32))
