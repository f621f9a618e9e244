"""bf16 AdamW moments (optim.moments=bf16): the kernel against its torch twin, the stochastic
rounding, the trajectory against fp32 moments, and checkpoints across the two modes."""

import copy

import pytest
import torch

from eyas.kernels.adamw import (hash32, join_master, master_adamw_, master_adamw_reference_,
                                stochastic_bf16)
from eyas.train.optim import MasterAdamW

# CPU runs go through Triton's interpreter (tests/conftest.py); with a GPU the kernel compiles
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(37, 11), (1000,), (3, 5, 7)]                 # sizes not multiples of the block
KW = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEV, torch.bfloat16))
            for s in SHAPES]


def _grads(step, seed=1):
    g = torch.Generator().manual_seed(seed + step)
    return [(torch.randn(s, generator=g) * 0.1).to(DEV, torch.bfloat16) for s in SHAPES]


def _assert_masters_close(got, want, steps):
    """Masters of the kernel against the twin. Where an fp32 rounding difference (fused
    multiply-adds on a GPU) flipped one stochastic rounding, the moment differs by a bf16 ulp and
    that element's later updates by up to lr · 2^-7 a step; everywhere else they agree to fp32
    rounding."""
    for x, y in zip(got, want):
        err = (x - y).abs()
        assert (err <= 1e-7 + 1e-6 * y.abs()).float().mean() > 0.99
        assert err.max() <= steps * KW["lr"] * 2 ** -7


def _state(params, moment_dtype):
    zeros = [torch.zeros(p.shape, dtype=moment_dtype, device=DEV) for p in params]
    return ([p.detach().float().clone() for p in params], zeros,
            [z.clone() for z in zeros], [torch.zeros((), device=DEV) for _ in params])


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_kernel_and_torch_twin_store_the_same_bf16_moments(wd):
    pa, pb = _params(), [p.detach().clone() for p in _params()]
    wa, ma, va, sa = _state(pa, torch.bfloat16)
    wb, mb, vb, sb = _state(pb, torch.bfloat16)
    for step in range(4):
        g = _grads(step)
        master_adamw_([p.data for p in pa], g, wa, ma, va, sa, weight_decay=wd, **KW)
        master_adamw_reference_(pb, g, wb, mb, vb, sb, weight_decay=wd, **KW)
    for x, y in zip(ma + va, mb + vb):
        assert x.dtype == torch.bfloat16
        # the same fp32 moments and the same random bits: the same stored bits, but for the
        # rare element where an fp32 rounding difference crosses a rounding boundary
        assert (x.view(torch.int16) != y.view(torch.int16)).float().mean() < 1e-3
    _assert_masters_close(wa, wb, steps=4)
    assert [float(s) for s in sa] == [float(s) for s in sb] == [4.0] * 3


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    n = 1 << 16
    random16 = hash32(torch.arange(n)) & 0xFFFF
    for value in (1.0 + 3 * 2 ** -10, -(2.0 + 2 ** -12), 3.0e-7):
        x = torch.full((n,), value)
        y = stochastic_bf16(x, random16).float()
        truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)[0].item()
        away = torch.nextafter(torch.tensor(truncated).bfloat16(),
                               torch.tensor(truncated * 2).bfloat16()).float().item()
        assert set(y.unique().tolist()) == {truncated, away}
        # the mean of many roundings is the fp32 value (within 4 standard errors)
        p = (value - truncated) / (away - truncated)
        stderr = abs(away - truncated) * (p * (1 - p) / n) ** 0.5
        assert abs(y.mean().item() - value) < 4 * stderr + 1e-12 * abs(value)
    exact = torch.tensor([0.0, 1.0, -2.5, 3.0e38]).bfloat16().float()
    assert torch.equal(stochastic_bf16(exact, torch.full((4,), 0xFFFF)).float(), exact)
    # NaNs with their payload in the dropped bits stay NaN (no carry into an infinity, no wrap)
    nans = torch.tensor([0x7F800001, -0x7FFF, -1], dtype=torch.int32).view(torch.float32)
    assert stochastic_bf16(nans, torch.full((3,), 0xFFFF)).isnan().all()


def test_a_nan_gradient_leaves_nan_moments_in_both_implementations():
    for update in (master_adamw_, master_adamw_reference_):
        p = _params()
        w, m, v, s = _state(p, torch.bfloat16)
        g = _grads(0)
        g[1][5] = float("nan")
        update([x.data for x in p], g, w, m, v, s, weight_decay=0.0, **KW)
        assert m[1][5].isnan() and v[1][5].isnan() and not m[1][4].isnan()


def test_bf16_moments_track_the_fp32_moment_trajectory():
    a, b = _params(), _params()
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01,
              impl="triton" if DEV == "cuda" else "torch")
    full, low = MasterAdamW(a, **kw), MasterAdamW(b, moments="bf16", **kw)
    for step in range(30):
        for ps in (a, b):
            for p, g in zip(ps, _grads(step)):
                p.grad = g
        full.step()
        low.step()
    states = [low.inner.state[m] for m in low.masters[0]]
    assert {s[k].dtype for s in states for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    for wa, wb, p0 in zip(full.master_weights()[0], low.master_weights()[0], _params()):
        moved = (wa - p0.float()).abs().mean()
        assert (wa - wb).abs().mean() < 0.02 * moved        # 30 steps of 1e-3 moved ~0.03


def test_bf16_moment_checkpoints_resume_exactly_and_load_into_fp32_mode():
    kw = dict(lr=1e-2, impl="triton" if DEV == "cuda" else "torch", moments="bf16")
    a = _params()
    opt = MasterAdamW(a, **kw)
    for step in range(2):
        for p, g in zip(a, _grads(step)):
            p.grad = g
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    b, c = _params(seed=5), _params(seed=6)
    same = MasterAdamW(b, **kw)
    other = MasterAdamW(c, **{**kw, "moments": "fp32"})
    same.load_state_dict(copy.deepcopy(saved))
    other.load_state_dict(copy.deepcopy(saved))
    for o, dtype in ((same, torch.bfloat16), (other, torch.float32)):   # as loaded, before a step
        assert {o.inner.state[m][k].dtype for m in o.masters[0]
                for k in ("exp_avg", "exp_avg_sq")} == {dtype}
    for o, ps in ((opt, a), (same, b), (other, c)):
        for p, g in zip(ps, _grads(7)):
            p.grad = g
        o.step()
    for x, y in zip(opt.master_weights()[0], same.master_weights()[0]):
        assert torch.equal(x, y)                                     # exact resume
    fp32 = [other.inner.state[m]["exp_avg"] for m in other.masters[0]]
    assert {t.dtype for t in fp32} == {torch.float32}                # converted, and stepped
    for x, y in zip(opt.master_weights()[0], other.master_weights()[0]):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-4)


def test_compact_masters_with_bf16_moments_follow_the_twin():
    a, b = _params(), _params()
    low = MasterAdamW(a, lr=1e-2, impl="triton", compact=True, moments="bf16")
    w, m, v, s = _state(b, torch.bfloat16)
    for step in range(3):
        for p, g in zip(a, _grads(step)):
            p.grad = g
        low.step()
        master_adamw_reference_([p.data for p in b], _grads(step), w, m, v, s, weight_decay=0.0,
                                **KW)
    _assert_masters_close([join_master(p, lo) for p, lo in zip(a, low.masters[0])], w, steps=3)


def test_bf16_moments_need_the_master_weight_update():
    from eyas.train.config import OptimConfig
    from eyas.train.optim import build_optimizer
    with pytest.raises(ValueError, match="optim.moments=bf16 needs the master-weight update"):
        build_optimizer([torch.nn.Parameter(torch.zeros(3))], OptimConfig(), master_weights=False,
                        moments="bf16")
    with pytest.raises(ValueError, match="moments must be fp32 or bf16, got 'fp8'"):
        MasterAdamW(_params(), lr=1e-3, moments="fp8")
