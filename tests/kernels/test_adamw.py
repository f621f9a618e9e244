"""kernels.adamw (fused master AdamW) and MasterAdamW's two implementations against torch AdamW."""

import copy

import pytest
import torch

from eyas.kernels.adamw import master_adamw_
from eyas.train.optim import MasterAdamW


# CPU runs go through Triton's interpreter (tests/conftest.py); with a GPU the kernel compiles
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _params(seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 11), (1000,), (3, 5, 7)]            # sizes not multiples of the block
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEV, dtype)) for s in shapes]


def _set_grads(params, step, seed=1):
    g = torch.Generator().manual_seed(seed + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(DEV, p.dtype)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_kernel_matches_torch_adamw_on_fp32_masters(wd):
    params = _params()
    masters = [p.detach().float().clone() for p in params]
    ref = [m.clone().requires_grad_() for m in masters]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    m1 = [torch.zeros_like(m) for m in masters]
    m2 = [torch.zeros_like(m) for m in masters]
    steps = [torch.zeros((), dtype=torch.float32, device=DEV) for _ in masters]
    for step in range(3):
        _set_grads(params, step)
        for r, p in zip(ref, params):
            r.grad = p.grad.float()
        opt.step()
        master_adamw_(params, [p.grad for p in params], masters, m1, m2, steps, lr=1e-2,
                      beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd)
    for r, m, p, a, b in zip(ref, masters, params, m1, m2):
        st = opt.state[r]
        torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, st["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(b, st["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        # param = bf16(master): exact on GPU; Triton's CPU interpreter truncates (1 ulp)
        torch.testing.assert_close(p.detach().float(), m, rtol=2 ** -7, atol=0)
    assert [float(s) for s in steps] == [3.0, 3.0, 3.0]


def test_master_adamw_triton_equals_torch_impl_and_state_round_trips():
    a, b = _params(), _params()
    opt_a = MasterAdamW(a, lr=1e-2, weight_decay=0.01, impl="torch")
    opt_b = MasterAdamW(b, lr=1e-2, weight_decay=0.01, impl="triton")
    for step in range(2):
        _set_grads(a, step)
        _set_grads(b, step)
        opt_a.step()
        opt_b.step()
    for pa, pb, ma, mb in zip(a, b, opt_a.masters[0], opt_b.masters[0]):
        torch.testing.assert_close(mb, ma, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pb.detach().float(), pa.detach().float(), rtol=2 ** -7, atol=0)
    # a checkpoint of the fused implementation resumes in the torch one with the same state
    c = _params()
    opt_c = MasterAdamW(c, lr=1e-2, weight_decay=0.01, impl="torch")
    opt_c.load_state_dict(copy.deepcopy(opt_b.state_dict()))      # as if saved and loaded
    _set_grads(b, 5)
    _set_grads(c, 5)
    opt_b.step()
    opt_c.step()
    for mb, mc in zip(opt_b.masters[0], opt_c.masters[0]):
        torch.testing.assert_close(mc, mb, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="impl"):
        MasterAdamW(_params(), lr=1e-3, impl="cuda")


def test_masters_follow_parameters_moved_after_construction():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    params = [torch.nn.Parameter(torch.randn(8, 4).bfloat16())]            # built on the CPU
    opt = MasterAdamW(params, lr=1e-2, impl="triton")
    # accelerate.prepare moves the parameters in place after the optimizer was built
    ref = MasterAdamW([torch.nn.Parameter(params[0].detach().cuda())], lr=1e-2, impl="torch")
    params[0].data = params[0].data.cuda()
    for o in (opt, ref):
        for p in o.param_groups[0]["params"]:
            p.grad = torch.full_like(p, 0.5)
        o.step()
    assert opt.masters[0][0].is_cuda
    torch.testing.assert_close(opt.masters[0][0], ref.masters[0][0], rtol=1e-5, atol=1e-6)


def _state(opt):
    """Bitwise copies of parameters, masters and AdamW state (moments, step counters)."""
    st = [opt.inner.state[m] for m in opt.masters[0]]
    return ([p.detach().clone() for p in opt.param_groups[0]["params"]],
            [m.clone() for m in opt.masters[0]],
            [{k: v.clone() for k, v in s.items()} for s in st])


def _assert_bitwise(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    for sa, sb in zip(a[2], b[2]):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("flag", [torch.tensor(True), torch.tensor(1.0), torch.tensor(3),
                                  torch.tensor(float("nan"))])
def test_skip_leaves_parameters_masters_and_moments_unchanged(impl, flag):
    params = _params()
    opt = MasterAdamW(params, lr=1e-2, weight_decay=0.1, impl=impl)
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    before = _state(opt)
    _set_grads(params, 2)
    params[0].grad[3, 4] = float("nan")              # what a skipped step usually carries
    opt.step(skip=flag.to(DEV))
    _assert_bitwise(_state(opt), before)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_skipped_first_step_leaves_the_initial_state(impl):
    params = _params()
    opt = MasterAdamW(params, lr=1e-2, impl=impl)
    ref = [p.detach().clone() for p in params]
    _set_grads(params, 0)
    opt.step(skip=torch.tensor(True, device=DEV))
    for p, r, m in zip(params, ref, opt.masters[0]):
        assert torch.equal(p.detach(), r) and torch.equal(m, r.float())
        st = opt.inner.state.get(m, {})
        assert all(not v.any() for v in st.values())   # zero moments, step 0 (or no state)
    # the next step is the first real one: as if the skipped one never happened
    fresh = _params()
    ref_opt = MasterAdamW(fresh, lr=1e-2, impl=impl)
    for o, ps in ((opt, params), (ref_opt, fresh)):
        _set_grads(ps, 1)
        o.step()
    for a, b in zip(opt.masters[0], ref_opt.masters[0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_skip_false_is_exactly_a_plain_step(impl):
    a, b = _params(), _params()
    opt_a = MasterAdamW(a, lr=1e-2, weight_decay=0.1, impl=impl)
    opt_b = MasterAdamW(b, lr=1e-2, weight_decay=0.1, impl=impl)
    for step in range(3):
        _set_grads(a, step)
        _set_grads(b, step)
        opt_a.step()
        opt_b.step(skip=torch.tensor(False, device=DEV))
    _assert_bitwise(_state(opt_b), _state(opt_a))


def test_kernel_skip_must_be_a_scalar():
    params = _params()
    with pytest.raises(ValueError, match="0-dim"):
        master_adamw_(params, [torch.zeros_like(p) for p in params],
                      [p.detach().float() for p in params],
                      [torch.zeros_like(p, dtype=torch.float32) for p in params],
                      [torch.zeros_like(p, dtype=torch.float32) for p in params],
                      [torch.zeros((), device=DEV) for _ in params], lr=1e-2, beta1=0.9,
                      beta2=0.95, eps=1e-8, weight_decay=0.0, skip=torch.zeros(2, dtype=torch.bool))


def test_a_refused_call_changes_no_step_counter():
    params = _params()
    steps = [torch.zeros((), device=DEV) for _ in params]
    moments = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    moments[-1] = torch.zeros(7, 5, 3, device=DEV).transpose(0, 2)    # the last one strided
    with pytest.raises(ValueError, match="contiguous"):
        master_adamw_(params, [torch.zeros_like(p) for p in params],
                      [p.detach().float() for p in params], moments,
                      [torch.zeros_like(p, dtype=torch.float32) for p in params], steps,
                      lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    assert [float(s) for s in steps] == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------ compact (int16) masters
def _awkward_fp32(n=4096, seed=0):
    """fp32 values of every sign and scale, plus exact bf16 ties (low 16 bits = 0x8000)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    ties = (x[:64].view(torch.int32) & ~0xFFFF) | 0x8000
    x[:64] = ties.view(torch.float32)
    x[64:68] = torch.tensor([0.0, -0.0, 1.0, -3.5])
    return x


def test_split_and_join_are_exact_and_round_to_nearest():
    from eyas.kernels.adamw import join_master, split_master
    x = _awkward_fp32()
    hi, lo = split_master(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(join_master(hi, lo).view(torch.int32), x.view(torch.int32))
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert tie[:64].all() and not tie[64:].any()
    assert torch.equal(hi[~tie], x[~tie].bfloat16())            # round to nearest off the ties
    away = hi[tie].float().abs() > x[tie].abs()                 # ties: away from zero
    assert away.all()


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_compact_masters_follow_the_fp32_trajectory_bitwise(wd):
    from eyas.kernels.adamw import join_master
    a, b = _params(), _params()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=wd, impl="triton")
    full, compact = MasterAdamW(a, **kw), MasterAdamW(b, compact=True, **kw)
    assert all(m.dtype == torch.int16 for m in compact.masters[0])
    for step in range(4):
        _set_grads(a, step)
        _set_grads(b, step)
        full.step()
        compact.step()
    for pa, pb, ma, lo, key in zip(a, b, full.masters[0], compact.masters[0], compact.masters[0]):
        assert torch.equal(join_master(pb, lo).view(torch.int32), ma.view(torch.int32))
        sa, sb = full.inner.state[ma], compact.inner.state[key]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"]) and torch.equal(sa["step"], sb["step"])
        # the parameter is the master rounded to nearest (ties away from zero)
        diff = (pb.detach().float() - ma).abs() > (pa.detach().float() - ma).abs()
        assert not diff.any()


def test_compact_checkpoints_hold_fp32_masters_and_load_either_way():
    a = _params()
    opt = MasterAdamW(a, lr=1e-2, impl="triton", compact=True)
    for step in range(2):
        _set_grads(a, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert all(m.dtype == torch.float32 for m in saved["masters"][0])
    b, c = _params(seed=5), _params(seed=6)
    into_full = MasterAdamW(b, lr=1e-2, impl="triton")
    into_compact = MasterAdamW(c, lr=1e-2, impl="triton", compact=True)
    into_full.load_state_dict(copy.deepcopy(saved))
    into_compact.load_state_dict(copy.deepcopy(saved))
    for o, ps in ((opt, a), (into_full, b), (into_compact, c)):
        _set_grads(ps, 7)
        o.step()
    for x, y, z in zip(opt.master_weights()[0], into_full.master_weights()[0],
                       into_compact.master_weights()[0]):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert all(torch.equal(p, q) for p, q in zip(a, c))
    with pytest.raises(ValueError, match="compact=True.*optim.compact_masters=false"):
        MasterAdamW(_params(), lr=1e-3, impl="torch", compact=True)
