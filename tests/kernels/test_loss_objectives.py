"""The acceptance-aligned objectives of the fused loss (soft CE, TV, LK^α, LK^λ and a mix),
Triton under the interpreter and the torch twin, against a float64 autograd reference written
here from the definitions alone: α = Σ_v min(p̂_v, q_v), TV = 1 − α, LK^α = −log α,
LK^λ = λ·CE + (1 − λ)·TV with λ = exp(−η·sg[α]). Odd shapes: K=3, N=7, H=13, V=301 streamed
in 128-wide blocks (the last partial), chunks of 5 rows straddling TTT steps."""

import math

import pytest
import torch

from eyas.kernels.loss import SOFT_CE, Objective, eagle3_loss
from eyas.kernels.teacher import teacher_from_topk

triton = pytest.importorskip("triton")
from eyas.kernels import fused_loss  # noqa: E402

from eyas.kernels.fused_loss import interpreting  # noqa: E402

#: the CPU-tensor cases run Triton in its interpreter (tests/conftest.py turns it on without
#: CUDA); on a GPU machine the compiled kernel is test_compiled_kernel_at_real_vocabulary's
IMPLS = [pytest.param("triton", marks=pytest.mark.skipif(
    not interpreting(), reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")),
    "torch"]
TOL = 2e-5          # fp32 kernels against the float64 reference (norm-wise relative)
OBJECTIVES = {
    "soft_ce": SOFT_CE,
    "tv": Objective(kl=0.0, tv=1.0),
    "lk_alpha": Objective(kl=0.0, lk_alpha=1.0),
    "lk_lambda": Objective(kl=0.0, lk_lambda=1.0, eta=3.0),
    "mix": Objective(kl=0.3, tv=0.4, lk_alpha=0.2, lk_lambda=0.1, eta=1.5),
}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(fused_loss, "MAX_BLOCK_V", 128)


def inputs(K=3, N=7, H=13, V=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(K, N, H, generator=g) * 0.6
    W = torch.randn(V, H, generator=g) * 0.5
    p = torch.softmax(torch.randn(N, V, generator=g) * 2.5, dim=1)
    p = p * (0.5 + 1.5 * torch.rand(N, 1, generator=g))            # unnormalised rows
    p[2, :] = 0.0                                                    # a row with no teacher mass
    mask = (torch.rand(K, N, generator=g) > 0.25).float()
    valid = (torch.arange(N)[None, :] + torch.arange(K)[:, None]) < N
    w = mask * valid * (0.8 ** torch.arange(K, dtype=torch.float32))[:, None] / 9.0
    return h, W, p, w


def reference_rows(h, W, p, w, obj: Objective):
    """float64 per-row w·ℓ [K, N] and α [K, N], differentiable in h and W."""
    K, N, _ = h.shape
    idx = (torch.arange(N, device=h.device)[None, :]
           + torch.arange(K, device=h.device)[:, None]).clamp(max=N - 1)
    z = torch.einsum("knh,vh->knv", h, W)
    logq = torch.log_softmax(z, dim=-1)
    active = w != 0
    pk = torch.where(active[..., None], p.double()[idx], 0.0)
    sp = pk.sum(-1)
    has_p = (sp > 0).double()
    phat = pk / torch.where(sp > 0, sp, 1.0)[..., None]
    alpha = torch.minimum(phat, logq.exp()).sum(-1)
    ce = -(pk * logq).sum(-1)
    lam = torch.exp(-obj.eta * alpha.detach())
    row = ((obj.kl + obj.lk_lambda * lam) * ce
           + (obj.tv + obj.lk_lambda * (1 - lam)) * has_p * (1 - alpha)
           - obj.lk_alpha * has_p * torch.log(alpha.clamp_min(1e-5)))
    return torch.where(active, w.double() * row, 0.0), torch.where(active, alpha, 0.0)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_objective_matches_float64_reference(impl, name):
    obj = OBJECTIVES[name]
    h, W, p, w = inputs()
    hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
    out = eagle3_loss(hh, WW, p, w, impl=impl, chunk_size=5, with_accept=True, objective=obj)
    (out.loss * 0.7).backward()
    hr, Wr = h.double().requires_grad_(), W.double().requires_grad_()
    rows, alpha = reference_rows(hr, Wr, p, w, obj)
    (rows.sum() * 0.7).backward()
    assert math.isclose(out.loss.item(), rows.sum().item(), rel_tol=1e-5)
    torch.testing.assert_close(out.step_loss.double(), rows.sum(1).detach(), rtol=1e-5,
                               atol=1e-7)
    torch.testing.assert_close(out.accept.double(), alpha.detach(), rtol=1e-5, atol=1e-6)
    assert rel_err(hh.grad, hr.grad) < TOL and rel_err(WW.grad, Wr.grad) < TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_listed_rows_and_bf16(impl):
    """Listed rows (the trainer's path) and bf16 GEMM operands, LK^α against the reference."""
    obj = OBJECTIVES["lk_alpha"]
    h, W, p, w = inputs(seed=3)
    rows = (w.reshape(-1) != 0).nonzero().flatten()
    hh = h.bfloat16().requires_grad_()
    WW = W.bfloat16().requires_grad_()
    out = eagle3_loss(hh, WW, p.bfloat16(), w, impl=impl, chunk_size=4, rows=rows,
                      with_accept=True, objective=obj)
    out.loss.backward()
    hr = h.bfloat16().double().requires_grad_()
    Wr = W.bfloat16().double().requires_grad_()
    ref, _ = reference_rows(hr, Wr, p.bfloat16(), w, obj)
    ref.sum().backward()
    assert math.isclose(out.loss.item(), ref.sum().item(), rel_tol=1e-3)
    assert rel_err(hh.grad, hr.grad) < 1e-2 and rel_err(WW.grad, Wr.grad) < 1e-2


def test_soft_ce_mix_equals_default_and_weights_are_linear():
    """Objective(kl=1) is today's loss bit for bit; the loss is linear in the term weights."""
    h, W, p, w = inputs(seed=5)
    base = eagle3_loss(h, W, p, w, impl="torch", chunk_size=5)
    same = eagle3_loss(h, W, p, w, impl="torch", chunk_size=5, objective=Objective(kl=1.0))
    assert torch.equal(base.loss, same.loss)
    parts = [eagle3_loss(h, W, p, w, impl="torch", objective=Objective(kl=0.0, **{k: 1.0})).loss
             for k in ("tv", "lk_alpha")]
    mixed = eagle3_loss(h, W, p, w, impl="torch",
                        objective=Objective(kl=0.5, tv=2.0, lk_alpha=0.25)).loss
    assert math.isclose(mixed.item(), 0.5 * base.loss.item() + 2.0 * parts[0].item()
                        + 0.25 * parts[1].item(), rel_tol=1e-6)


def test_refusals():
    h, W, p, w = inputs()
    with pytest.raises(ValueError, match="reduction='none' recomputes cross-entropy"):
        eagle3_loss(h, W, p, w, impl="torch", reduction="none", objective=Objective(tv=1.0))
    with pytest.raises(ValueError, match="weights >= 0"):
        eagle3_loss(h, W, p, w, impl="torch", objective=Objective(tv=-1.0))


def _alpha(teacher, z):
    """α per row of the kernel (one TTT step, every row weighted) for logits z = h @ W.T."""
    N, V = z.shape
    out = eagle3_loss(z[None].contiguous(), torch.eye(V), teacher, torch.ones(1, N),
                      impl="torch", with_accept=True)
    return out.accept[0]


def test_topk_teacher_alpha_bounds():
    """With a top-k teacher (support S, true mass P = Σ_S p on it), Σ_{v∈S} min(p_v, q_v) with
    the true probabilities is a LOWER bound on the full-vocabulary α (α ≤ it + 1 − P), while
    the α of the renormalised top-k teacher (what the loss and the logs see) is within 1 − P
    of α on either side and is neither bound: a drafter equal to the target reads low, one
    equal to the renormalised teacher reads high."""
    g = torch.Generator().manual_seed(7)
    N, V, k = 6, 64, 8
    logits = torch.randn(N, V, generator=g) * 2
    p = torch.softmax(logits, dim=1)
    vals, ids = logits.topk(k, dim=1)
    teacher_k = teacher_from_topk(ids, vals, torch.arange(V), V, dtype=torch.float32)
    support = torch.zeros(N, V, dtype=torch.bool).scatter_(1, ids, True)
    P = torch.where(support, p, 0.0).sum(1)
    for z in (torch.randn(N, V, generator=g) * 2, logits, teacher_k.clamp_min(1e-30).log()):
        q = torch.softmax(z, dim=1)
        full = torch.minimum(p, q).sum(1)
        torch.testing.assert_close(_alpha(p, z), full, rtol=1e-5, atol=1e-6)
        lower = torch.where(support, torch.minimum(p, q), 0.0).sum(1)
        assert (lower <= full + 1e-6).all() and (full <= lower + (1 - P) + 1e-6).all()
        renorm = _alpha(teacher_k, z)
        assert ((renorm - full).abs() <= (1 - P) + 1e-5).all()
    assert (_alpha(teacher_k, logits) < torch.minimum(p, p).sum(1) - 1e-3).all()   # reads low
    high = _alpha(teacher_k, teacher_k.clamp_min(1e-30).log())
    assert (high > torch.minimum(p, teacher_k).sum(1) + 1e-3).all()                 # reads high


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_compiled_kernel_at_real_vocabulary(name, monkeypatch):
    """The compiled Triton kernels (8192-wide blocks, 32003 columns) against the float64
    reference, bf16 GEMM operands as the trainer runs them."""
    monkeypatch.setattr(fused_loss, "MAX_BLOCK_V", 8192)
    obj = OBJECTIVES[name]
    g = torch.Generator().manual_seed(11)
    K, N, H, V = 3, 600, 256, 32003
    h = (torch.randn(K, N, H, generator=g) * 0.5).bfloat16().cuda()
    W = (torch.randn(V, H, generator=g) * H ** -0.5 * 4).bfloat16().cuda()
    p = torch.softmax(torch.randn(N, V, generator=g) * 3, 1).bfloat16().cuda()
    valid = (torch.arange(N)[None] + torch.arange(K)[:, None]) < N
    w = (valid * (torch.rand(K, N, generator=g) > 0.2)).float().cuda() / N
    hh, WW = h.clone().requires_grad_(), W.clone().requires_grad_()
    out = eagle3_loss(hh, WW, p, w, impl="triton", with_accept=True, objective=obj)
    out.loss.backward()
    hr, Wr = h.double().requires_grad_(), W.double().requires_grad_()
    rows, alpha = reference_rows(hr, Wr, p, w, obj)
    rows.sum().backward()
    assert math.isclose(out.loss.item(), rows.sum().item(), rel_tol=1e-4)
    torch.testing.assert_close(out.accept.double(), alpha.detach(), rtol=1e-4, atol=1e-5)
    assert rel_err(hh.grad, hr.grad) < 1e-2 and rel_err(WW.grad, Wr.grad) < 1e-2
