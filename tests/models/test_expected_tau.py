"""The offline τ under sampling (models.expected_tau): β (acceptance given the emitted token) by
formula and by sampler, the chain product by hand, the top-k teacher against the full one, the
walk and its standard error."""

import math

import pytest
import torch

from eyas.models.expected_tau import (add_expected, expected_counts, paired_ratio_se, ratio_se,
                                      ratio_se_of, step_acceptance, summarize_expected,
                                      topk_step_acceptance)
from eyas.train.evaluate.sampling import accept_or_resample, probs

V, VD, T = 8, 5, 0.8


def _case(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.tensor([0, 2, 3, 5, 7])                    # draft id i -> target id
    return (torch.randn(n, VD, generator=g) * 2, torch.randn(n, V, generator=g) * 2, draft_ids)


def _to_draft(ids):
    to_draft = torch.full((V,), -1)
    to_draft[ids] = torch.arange(VD)
    return to_draft


@pytest.mark.parametrize("draft", ["sample", "argmax"])
def test_beta_is_the_acceptance_given_the_emitted_token(draft):
    """The sampler run many times on one row: among rounds that emitted token y, the share that
    accepted the draft is β(y) = min(1, q(y)/p(y)) (argmax: 1[y = draft])."""
    z, logits, ids = _case(n=1)
    q = torch.zeros(1, V)
    q[0, ids] = probs(z, T)[0]                                      # q over target ids
    p = probs(logits, T)
    n = 200_000
    g = torch.Generator().manual_seed(3)
    if draft == "sample":
        drafts = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=g)[:, 0]
        acc, emitted = accept_or_resample(drafts, q.expand(n, -1), p.expand(n, -1), g)
    else:
        drafts = ids[z.argmax(-1)].expand(n)
        acc, emitted = accept_or_resample(drafts, None, p.expand(n, -1), g)
    tokens = torch.arange(V)
    beta = step_acceptance(z.expand(V, -1), logits.expand(V, -1), _to_draft(ids), tokens,
                           temperature=T, draft=draft)
    if draft == "sample":
        want = torch.clamp(q[0] / p[0], max=1.0).double()
    else:
        want = (tokens == ids[z.argmax()]).double()
    torch.testing.assert_close(beta, want, rtol=1e-6, atol=1e-9)
    for y in range(V):
        hits = emitted == y
        m = int(hits.sum())
        assert abs(m / n - float(p[0, y])) < 5 * math.sqrt(float(p[0, y]) / n) + 1e-4  # y ~ p
        if m > 1000:
            share = float(acc[hits].double().mean())
            b = float(beta[y])
            assert abs(share - b) < 5 * math.sqrt(max(b * (1 - b), 1e-4) / m), (y, share, b)


@pytest.mark.parametrize("draft", ["sample", "argmax"])
def test_topk_teacher_with_every_id_equals_the_full_teacher(draft):
    z, logits, ids = _case(seed=1)
    to_draft = _to_draft(ids)
    token = torch.tensor([0, 2, 7, 4])                              # 4: outside the draft vocab
    top_v, top_i = logits.topk(V, dim=-1)
    full = step_acceptance(z, logits, to_draft, token, temperature=T, draft=draft)
    topk = topk_step_acceptance(z, top_i, top_v, to_draft, token, temperature=T, draft=draft)
    torch.testing.assert_close(topk, full, rtol=1e-6, atol=1e-7)
    assert float(full[3]) == 0.0                                    # q(4) = 0: never accepted
    # fewer ids: the teacher renormalised over its top 3 over-states p, so β can only fall
    part = topk_step_acceptance(z, top_i[:, :3], top_v[:, :3], to_draft, token, temperature=T,
                                draft=draft)
    assert part.shape == full.shape and bool(((part >= 0) & (part <= full + 1e-9)).all())


def test_ratio_se_is_the_delta_method():
    g = torch.Generator().manual_seed(2)
    R = torch.randint(5, 40, (30,), generator=g).double()
    A = (R * torch.rand(30, generator=g, dtype=torch.float64)).round()
    r = float(A.sum() / R.sum())
    want = math.sqrt(float(((A - r * R) ** 2).sum()) / (30 * 29)) / float(R.mean())
    got = ratio_se(30, float(A.sum()), float(R.sum()), float((A * A).sum()),
                   float((R * R).sum()), float((A * R).sum()))
    assert got == pytest.approx(want, rel=1e-9)
    assert math.isnan(ratio_se(1, 1.0, 2.0, 1.0, 4.0, 2.0))


def _units(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    R = torch.randint(20, 80, (n,), generator=g).double()
    return R, torch.rand(n, generator=g, dtype=torch.float64)


def test_paired_ratio_se_reduces_to_the_single_error_and_to_zero():
    R, p = _units(3)
    other = list(zip((R * p * 2).round().tolist(), R.tolist()))
    # a reference with the same accepted-per-round on every prompt has no variance of its
    # own: the ratio's error is then the other's τ error over the reference's τ
    ref = list(zip((R * 1.5).tolist(), R.tolist()))
    assert paired_ratio_se(ref, other) == pytest.approx(ratio_se_of(other) / 2.5, rel=1e-9)
    assert paired_ratio_se(other, other) == 0.0                 # a drafter against itself
    assert math.isnan(paired_ratio_se(other[:1], other[:1]))
    with pytest.raises(ValueError, match="paired units: 64 against 63"):
        paired_ratio_se(other, other[:63])


def test_paired_ratio_se_matches_a_paired_bootstrap_and_beats_the_unpaired_error():
    R, p = _units(4)                      # per-prompt difficulty p, shared by both drafters
    g = torch.Generator().manual_seed(5)
    a = (R * 2 * p).round()
    b = (R * 2 * (p * 0.97 + 0.05 * torch.rand(64, generator=g, dtype=torch.float64))).round()
    ref, other = list(zip(a.tolist(), R.tolist())), list(zip(b.tolist(), R.tolist()))
    idx = torch.randint(0, 64, (4000, 64), generator=g)
    tau_a = 1 + a[idx].sum(1) / R[idx].sum(1)
    tau_b = 1 + b[idx].sum(1) / R[idx].sum(1)
    boot = float((tau_b / tau_a).std())
    se = paired_ratio_se(ref, other)
    assert se == pytest.approx(boot, rel=0.1)
    ta, tb = 1 + float(a.sum() / R.sum()), 1 + float(b.sum() / R.sum())
    unpaired = tb / ta * math.hypot(ratio_se_of(ref) / ta, ratio_se_of(other) / tb)
    assert se < unpaired / 3


def test_chain_product_by_hand():
    alpha = torch.tensor([[0.5, 0.8, 0.9],
                          [0.4, 0.5, 0.7]], dtype=torch.float64)          # [K=2, T=3]
    mask = torch.tensor([[True, True, False],
                         [True, False, False]])                        # start 2 never counts
    counts = expected_counts(alpha, mask)
    # starts t=0: 0.5 + 0.5*0.4 = 0.7 accepted; t=1: 0.8 (step 1 does not count: chain stops)
    lengths = torch.tensor([0.7, 0.8], dtype=torch.float64)
    res = summarize_expected(add_expected(None, counts))
    assert res["chain_starts"] == 2
    assert res["tau"] == pytest.approx(1 + 0.75)
    assert res["tau_se"] == pytest.approx(float(lengths.std()) / math.sqrt(2))
    assert res["tau_by_k"] == pytest.approx([1 + (0.5 + 0.8) / 2, 1.75])
    assert res["cond_acc_0"] == pytest.approx(1.3 / 2)
    assert res["cond_acc_1"] == pytest.approx(0.2 / 0.5)           # only start 0 reaches step 1
    twice = summarize_expected(add_expected(counts, counts))
    assert twice["tau"] == pytest.approx(res["tau"]) and twice["chain_starts"] == 4


def test_temperature_zero_is_refused():
    z, logits, ids = _case()
    with pytest.raises(ValueError, match="temperature > 0"):
        step_acceptance(z, logits, _to_draft(ids), torch.zeros(4, dtype=torch.long),
                        temperature=0.0, draft="sample")


def _spans(T, g):
    """A mask [K=3, T] like metric_mask: starts in runs (assistant spans), rows k valid while
    t+1+k stays in the span."""
    K = 3
    m0 = torch.rand(T, generator=g) < 0.8
    m0[torch.arange(T) % 11 == 0] = False                                 # break into spans
    mask = torch.zeros(K, T, dtype=torch.bool)
    for k in range(K):
        ok = torch.zeros(T, dtype=torch.bool)
        ok[:T - k] = m0[k:]
        run = m0.clone()
        for j in range(1, k + 1):
            run[:T - j] &= m0[j:]
            run[T - j:] = False
        mask[k] = run & ok
    return mask


def test_expected_walk_of_certain_steps_is_the_greedy_walk():
    from eyas.models.metrics import trajectory_counts
    g = torch.Generator().manual_seed(4)
    mask = _spans(200, g)
    correct = (torch.rand(mask.shape, generator=g) < 0.7) & mask
    alive = torch.cumprod(correct.to(torch.int64), 0)
    walk = trajectory_counts(alive, mask[0])
    rounds, accepted = walk["traj_rounds"], walk["traj_accepted"]
    res = summarize_expected(expected_counts(correct.double(), mask))
    assert res["tau_trajectory"] == pytest.approx(1 + float(accepted[-1]) / float(rounds[-1]),
                                                  abs=1e-12)


def test_expected_walk_matches_simulated_walks():
    g = torch.Generator().manual_seed(6)
    mask = _spans(60, g)
    alpha = torch.rand(mask.shape, generator=g, dtype=torch.float64) * mask
    res = summarize_expected(expected_counts(alpha, mask))
    alive = torch.cumprod(alpha, 0)
    m0 = mask[0].tolist()
    spans, a = [], None
    for t, s in enumerate(m0 + [False]):
        if s and a is None:
            a = t
        if not s and a is not None:
            spans.append((a, t - 1))
            a = None
    rng = torch.Generator().manual_seed(7)
    rounds = accepted = 0
    for _ in range(4000):
        for a, b in spans:
            t = 0
            while t < b - a:
                n, u = 0, float(torch.rand(1, generator=rng))
                while n < 3 and u < float(alive[n, a + t]):                 # P(n >= j) = alive
                    n += 1
                rounds += 1
                accepted += n
                t += n + 1
    assert res["tau_trajectory"] == pytest.approx(1 + accepted / rounds, rel=5e-3)
