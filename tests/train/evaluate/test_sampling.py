"""Speculative sampling (train.evaluate.sampling): the output is distributed as the target.

Two levels, both seeded so every statistic below is one fixed number:
  * the rejection rule on a 6-token vocabulary, vectorised over many independent rows: the
    emitted token's frequencies against p (Pearson chi-square, 5 degrees of freedom, bound at
    the 1e-4 tail so a correct rule fails only by a seed-independent coding error) and the
    acceptance rate against Σ min(p, q) (or p(d) for the engines' argmax proposal);
  * the real loop (`speculative_decode` on the tiny random Llama, an exported drafter): the
    first token a speculative round emits, checked by the randomised probability integral
    transform against the target's exact next-token distribution given the committed prefix
    (u = F(x−) + V·p(x), V ~ U[0, 1), is uniform iff x ~ p), over 5 bins.
"""

import pytest
import torch

from eyas.train.evaluate.sampling import (accept_or_resample, probs, round_lengths_se, sample,
                                          verify)
from eyas.train.evaluate.specdec import (TargetRunner, drafter_aux_layer_ids,
                                         load_engine_drafter, speculative_decode)
from eyas.data.common.targets import load_target

P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
Q = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.05, 0.10])
N = 200_000
CHI2_5_TAIL = 25.7     # P(chi2_5 > 25.7) ~ 1e-4
CHI2_4_TAIL = 23.5     # P(chi2_4 > 23.5) ~ 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


def _chi2_counts(counts: torch.Tensor, p: torch.Tensor) -> float:
    counts = counts.double()
    expected = p.double() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    return _chi2_counts(torch.bincount(tokens, minlength=p.numel()), p)


@pytest.mark.parametrize("proposal", ["sample", "argmax"])
def test_rejection_rule_emits_the_target_distribution(proposal):
    g = torch.Generator().manual_seed(1)
    p = P.expand(N, -1)
    if proposal == "sample":
        drafts = torch.multinomial(Q.expand(N, -1), 1, replacement=True, generator=g)[:, 0]
        q, rate = Q.expand(N, -1), float(torch.minimum(P, Q).sum())
    else:                                   # the engines: the drafter's argmax, q one-hot
        drafts, q, rate = torch.full((N,), int(Q.argmax())), None, float(P[Q.argmax()])
    accepted, tokens = accept_or_resample(drafts, q, p, g)
    assert _chi2(tokens, P) < CHI2_5_TAIL
    se = (rate * (1 - rate) / N) ** 0.5
    assert abs(float(accepted.double().mean()) - rate) < 4 * se
    # the proposal alone is far from p: a rule that skipped the residual would fail the bound
    assert _chi2(drafts, P) > 100 * CHI2_5_TAIL


def test_verify_round_first_token_and_bonus():
    g = torch.Generator().manual_seed(2)
    p = torch.stack([P, P.flip(0), Q])                       # K = 2 drafts + the bonus row
    first, lengths = [], []
    for _ in range(3000):
        d = sample(Q.expand(2, -1), g).tolist()
        n, out = verify(d, Q.expand(2, -1), p, g)
        assert len(out) == n + 1 and out[:n] == d[:n]
        first.append(out[0])
        lengths.append(n)
    assert _chi2(torch.tensor(first), P) < CHI2_5_TAIL
    hist = torch.bincount(torch.tensor(lengths), minlength=3)
    assert all(h > 0 for h in hist.tolist())
    se = round_lengths_se(hist.tolist())
    assert se == pytest.approx(float((1.0 + torch.tensor(lengths).double()).std()) / 3000 ** 0.5)


def test_verify_is_reproducible_per_seed():
    p = torch.stack([P, P, P])
    runs = [[verify([1, 3], None, p, g) for _ in range(50)]
            for g in (torch.Generator().manual_seed(s) for s in (5, 5, 6))]
    assert runs[0] == runs[1]
    assert runs[2] != runs[0]         # the seed drives the draws: another one, other rounds


@pytest.fixture(scope="module")
def tiny_case(tmp_path_factory, full_vocab_export):
    model, tok = load_target("tiny-llama", dtype=torch.float32)
    export = full_vocab_export(model, tmp_path_factory.mktemp("x") / "full")
    prompt = tok("Name a colour.", add_special_tokens=False)["input_ids"]
    engine, ecfg = load_engine_drafter(export, model.get_input_embeddings().weight.detach(),
                                       dtype=torch.float32)
    return model, prompt, engine, ecfg, export


def test_real_loop_first_round_token_follows_the_target(tiny_case):
    model, prompt, engine, cfg, _ = tiny_case
    T, K, draws, bins = 1.0, 2, 150, 5
    verifier = TargetRunner(model, drafter_aux_layer_ids(cfg, model.config.num_hidden_layers))
    pairs, accepted = [], 0
    try:
        for i in range(draws):
            res = speculative_decode(verifier, engine, prompt, k=K, max_new_tokens=2,
                                     stop_ids=set(), temperature=T, draft="sample",
                                     generator=torch.Generator().manual_seed(i))
            pairs.append(res.tokens)
            accepted += res.accepted[0]
    finally:
        verifier.close()
    # the target's exact distribution of the second token given the prompt and the first
    with torch.no_grad():
        seqs = torch.tensor([prompt + [t0] for t0, _ in pairs])
        p = probs(model(seqs).logits[:, -1], T)                          # [draws, V]
    g = torch.Generator().manual_seed(11)
    u = []
    for row, (_, t1) in zip(p, pairs):
        order = torch.argsort(row, descending=True, stable=True)
        below = float(row[order[:int((order == t1).nonzero())]].sum())
        u.append(below + float(torch.rand(1, generator=g)) * float(row[t1]))
    counts = torch.bincount((torch.tensor(u) * bins).long().clamp(0, bins - 1), minlength=bins)
    assert _chi2_counts(counts, torch.full((bins,), 1 / bins)) < CHI2_4_TAIL, counts.tolist()
    # near-uniform p and q over the full vocabulary: most first drafts are accepted, so the
    # statistic above covers the accepted path as well as the residual
    assert draws // 2 < accepted < draws, accepted


def test_greedy_stays_greedy_and_sampling_is_seeded(tiny_case):
    model, prompt, engine, cfg, _ = tiny_case
    verifier = TargetRunner(model, drafter_aux_layer_ids(cfg, model.config.num_hidden_layers))
    try:
        greedy = [speculative_decode(verifier, engine, prompt, k=3, max_new_tokens=8,
                                     stop_ids=set()).tokens for _ in range(2)]
        runs = [speculative_decode(verifier, engine, prompt, k=3, max_new_tokens=8,
                                   stop_ids=set(), temperature=0.7, draft="sample",
                                   generator=torch.Generator().manual_seed(s)).tokens
                for s in (3, 3, 4)]
        with pytest.raises(ValueError, match="seeded torch.Generator"):
            speculative_decode(verifier, engine, prompt, k=3, max_new_tokens=2, stop_ids=set(),
                               temperature=0.7)
    finally:
        verifier.close()
    assert greedy[0] == greedy[1]
    assert runs[0] == runs[1] and runs[0] != runs[2]
