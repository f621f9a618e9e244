"""Exact acceptance metrics on hand-built accept patterns with known acc_k / cond_acc_k / τ."""

import math

import torch

from eyas.models.metrics import accept_counts, add_counts, summarize
from eyas.models.objective import metric_mask
from eyas.models.ttt import structural_valid

# Draft vocabulary = target ids {0, 2, 4, …} (d2t[i] = i), so draft id i means target id 2i.
D2T = torch.arange(50)


def _case(correct: list[list[int]], mask: list[list[int]]):
    """(draft_argmax, d2t, target_argmax, mask) realising a [K, T] correct pattern on counted rows."""
    K, T = len(correct), len(correct[0])
    target_argmax = torch.arange(T + K + 1) * 2 % 100        # target ids: all in the draft vocab
    target_argmax = target_argmax[:T]
    draft = torch.zeros(K, T, dtype=torch.long)
    for k in range(K):
        for t in range(T):
            want = int(target_argmax[t + 1 + k]) if t + 1 + k < T else 0
            draft[k, t] = want // 2 if correct[k][t] else (want // 2 + 1) % 50
    return draft, D2T, target_argmax, torch.tensor(mask, dtype=torch.bool)


def test_hand_built_pattern():
    # 8 tokens in one document, K = 3; counted rows: t + 1 + k < 8 (all loss_mask = 1)
    correct = [
        [1, 1, 1, 0, 1, 1, 0, 0],   # step 0
        [1, 0, 1, 1, 1, 0, 0, 0],   # step 1
        [1, 1, 0, 1, 0, 0, 0, 0],   # step 2
    ]
    mask = [
        [1, 1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ]
    counts = accept_counts(*_case(correct, mask))
    assert counts["correct"].tolist() == [5, 4, 3]
    assert counts["total"].tolist() == [7, 6, 5]
    # alive: step0 rows {0,1,2,4,5}; step1 ∩ → {0,2,4}; step2 ∩ → {0}
    assert counts["cond_correct"].tolist() == [5, 3, 1]
    assert counts["cond_total"].tolist() == [7, 5, 3]
    # chains from the 7 starts: L = 3,1,2,0,2,1,0 → Σ(L+1) = 9 + 7
    assert int(counts["chain_starts"]) == 7
    assert int(counts["tau_sum"]) == 16
    assert all(v.dtype == torch.int64 for v in counts.values())
    m_ = summarize(counts)
    assert m_["acc_0"] == 5 / 7 and m_["acc_1"] == 4 / 6 and m_["acc_2"] == 3 / 5
    assert m_["cond_acc_0"] == 5 / 7 and m_["cond_acc_1"] == 3 / 5 and m_["cond_acc_2"] == 1 / 3
    assert m_["acc_overall"] == 12 / 18
    assert m_["tau"] == 16 / 7
    assert math.isclose(m_["tau_independent"],
                        1 + 5 / 7 + 5 / 7 * 4 / 6 + 5 / 7 * 4 / 6 * 3 / 5, rel_tol=1e-15)
    # τ identity: tau = 1 + Σ_k cond_correct_k / starts
    assert m_["tau"] == 1 + sum(counts["cond_correct"].tolist()) / 7


def test_all_correct_and_all_wrong():
    ones = [[1] * 6] * 3
    mask = [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    m_ = summarize(accept_counts(*_case(ones, mask)))
    assert [m_[f"acc_{k}"] for k in range(3)] == [1.0, 1.0, 1.0]
    # chains are capped by the document end: rows 0-2 get 3, row 3 gets 2, row 4 gets 1
    assert m_["tau"] == (4 + 4 + 4 + 3 + 2) / 5
    zeros = [[0] * 6] * 3
    m0 = summarize(accept_counts(*_case(zeros, mask)))
    assert m0["acc_0"] == 0.0 and m0["tau"] == 1.0 and m0["tau_independent"] == 1.0
    assert math.isnan(m0["cond_acc_1"])                       # no chain survives to step 1


def test_out_of_draft_vocab_target_is_a_miss():
    # target argmax at index 2 is the odd id 7, which no draft id maps to
    target_argmax = torch.tensor([0, 2, 7, 4, 6, 8])
    draft = (target_argmax.roll(-1) // 2).clamp(max=49)[None]  # best possible draft ids [1, 6]
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    counts = accept_counts(draft, D2T, target_argmax, mask)
    assert counts["correct"].tolist() == [4] and counts["total"].tolist() == [5]


def test_counts_sum_across_batches_like_ranks():
    a = accept_counts(*_case([[1, 0, 1, 0]], [[1, 1, 1, 0]]))
    b = accept_counts(*_case([[1, 1, 1, 1]], [[1, 1, 0, 0]]))
    total = add_counts(add_counts(None, a), b)
    assert total["correct"].tolist() == [4] and total["total"].tolist() == [5]
    assert summarize(total)["tau"] == (2 + 1 + 2 + 2 + 2) / 5


def test_metric_mask_uses_validity_and_shifted_loss_mask():
    doc = torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.int32)
    loss_mask = torch.tensor([0, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert metric_mask(structural_valid(doc, 2), loss_mask).int().tolist() == [
        [0, 1, 1, 0, 1, 0],     # valid [1,1,1,0,1,0] · loss_mask[t+1] [0,1,1,0,1,0]
        [1, 1, 0, 0, 0, 0],     # valid [1,1,0,0,0,0] · loss_mask[t+2] [1,1,0,1,0,0]
    ]
