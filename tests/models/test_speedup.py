"""The speedup model's arithmetic against hand-computed cases (models/speedup.py)."""

import math

import pytest

from eyas.data.common.targets import load_target_config, text_config
from eyas.models.speedup import (HARDWARE, Hardware, MeasuredCosts, RooflineCosts, TargetShape,
                                 speedup, tau)


def chain(rate: float, k: int) -> list[float]:
    """Unconditional per-position acceptance when each draft is accepted with probability
    `rate` given the ones before it: a_j = rate^j."""
    return [rate ** j for j in range(1, k + 1)]


def test_tau_sums_the_first_k_unconditional_acceptances():
    acc = chain(0.5, 3)
    assert acc == [0.5, 0.25, 0.125]
    assert tau(acc, 0) == 1.0 and tau(acc, 2) == 1.75 and tau(acc, 3) == 1.875
    with pytest.raises(ValueError, match="K=4: acceptance is known for 3 positions"):
        tau(acc, 4)


def test_speedup_is_tokens_per_round_over_the_round_in_plain_steps():
    # τ 2 tokens per round; plain step 10 ms; verify 12 ms + 3 drafts of 1 ms = 15 ms
    assert speedup(2.0, 3, t1=10.0, t_verify=12.0, t_draft=1.0) == pytest.approx(20 / 15)


def test_routed_experts_touched_by_a_batch():
    t = TargetShape(dense_params=100, expert_params=10, moe_layers=2, experts=4, top_k=2)
    assert t.active_params(1) == 100 + 2 * 2 * 10          # 4·(1 − ½) = 2 experts
    assert t.active_params(2) == 100 + 2 * 3 * 10          # 4·(1 − ¼) = 3 experts
    assert t.active_params(50) == pytest.approx(100 + 2 * 4 * 10)
    assert TargetShape(dense_params=7).active_params(64) == 7


def test_a_tiny_llama_config_counted_by_hand():
    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16}
    t = TargetShape.from_config(cfg)
    # embed + lm_head 2·10·8; per layer q,o 2·8·8, k,v 2·8·4, MLP 3·8·16
    assert t.dense_params == 160 + 2 * (128 + 64 + 384)
    assert t.kv_bytes_per_token == 2 * (2 * 1 * 4 * 2) and t.layers == 2 and not t.experts


def test_real_configs_give_the_published_parameter_counts():
    llama = TargetShape.from_config(text_config(load_target_config("llama-3.1-8b")))
    assert llama.active_params(1) == 8_029_995_008            # 8.03 B without the norms
    kimi = TargetShape.from_config(text_config(load_target_config("kimi-k2.5")))
    assert 32e9 < kimi.active_params(1) < 33.5e9               # "32 B activated"
    total = kimi.dense_params + kimi.moe_layers * kimi.experts * kimi.expert_params
    assert 1.0e12 < total < 1.06e12                           # "1 T total"
    assert kimi.active_params(6) / kimi.active_params(1) == pytest.approx(4.02, abs=0.01)


def test_roofline_step_is_the_slower_of_bytes_and_flops_plus_layer_overhead():
    hw = Hardware("toy", flops=1e12, bandwidth=1e11, memory=1e10)
    rc = RooflineCosts(TargetShape(dense_params=1e9, layers=4), drafter_params=1e8, hardware=hw,
                       weight_bytes=2, context=0, efficiency=1.0, layer_overhead_s=1e-3)
    assert rc.target_step(1, 1) == pytest.approx(2e9 / 1e11 + 4e-3)       # bytes bound
    assert rc.target_step(100, 1) == pytest.approx(2e9 * 100 / 1e12 + 4e-3)  # FLOPs bound
    assert rc.draft_step(1) == pytest.approx(2e8 / 1e11 + 1e-3)
    two = RooflineCosts(rc.target, 1e8, hw, gpus=2, weight_bytes=2, context=0,
                        efficiency=1.0, layer_overhead_s=1e-3)
    assert two.target_step(1, 1) == pytest.approx(1e9 / 1e11 + 4e-3)
    t1, t4, td = rc.target_step(1, 1), rc.target_step(4, 1), rc.draft_step(1)
    assert rc.speedup(2.5, 3, 1) == pytest.approx(2.5 * t1 / (t4 + 3 * td))


def test_the_seed_case_moe_target_at_low_acceptance_loses():
    """The run behind eyas: ~15 % acceptance per position, K = 5, Kimi-K2.5 on 8 GPUs, where
    the engine measured 0.66× of plain decoding."""
    kimi = TargetShape.from_config(text_config(load_target_config("kimi-k2.5")))
    rc = RooflineCosts(kimi, 963.4e6, HARDWARE["h200"], gpus=8, weight_bytes=1)
    s = rc.speedup(tau(chain(0.15, 5), 5), 5, 1)
    assert 0.5 < s < 0.7
    assert rc.speedup(tau(chain(0.15, 1), 1), 1, 1) > s     # a smaller K loses less
    llama = TargetShape.from_config(text_config(load_target_config("llama-3.1-8b")))
    dense = RooflineCosts(llama, 424.7e6, HARDWARE["h100"])
    assert dense.speedup(tau(chain(0.7, 5), 5), 5, 1) > 2   # a dense target at good acceptance


def test_measured_costs_recover_a_linear_round_and_predict_the_measured_speedup():
    base, per_k, t1, c = 0.030, 0.004, 0.020, 4
    rows = []
    for k, tau_k in ((1, 1.6), (3, 2.1), (5, 2.3), (7, 2.35)):
        round_s = base + per_k * k
        drafts = 400                                     # rounds summed over the C sequences
        seconds = round_s * drafts / c
        rows.append({"k": k, "concurrency": c, "drafts": drafts, "seconds": seconds,
                     "tau": tau_k, "tokens_per_s_without_speculation": c / t1,
                     "tokens_per_s": drafts * tau_k / seconds})
    m = MeasuredCosts.from_rows(rows)
    assert (m.concurrency, m.t1) == (c, pytest.approx(t1))
    assert m.base == pytest.approx(base) and m.per_k == pytest.approx(per_k)
    for r in rows:
        measured = r["tokens_per_s"] / r["tokens_per_s_without_speculation"]
        assert m.speedup(r["tau"], r["k"]) == pytest.approx(measured)
    with pytest.raises(ValueError, match="has one K"):
        MeasuredCosts.from_rows(rows[:1])
    assert not math.isnan(m.speedup(1.0, 0))
