"""Loss weights by hand, and the fp32 reference loss against the fused-loss entry point."""

import pytest
import torch

from models.objective import reference_loss, row_weights

DOC = torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.int32)
VALID = torch.tensor([[1, 1, 1, 0, 1, 0],
                      [1, 1, 0, 0, 0, 0]], dtype=torch.bool)            # structural_valid(DOC, 2)
LOSS_MASK = torch.tensor([0, 1, 1, 1, 0, 1], dtype=torch.bool)
TARGET_ARGMAX = torch.tensor([5, 1, 9, 2, 3, 4])                      # at index t+1+k
T2D = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)   # ids 8, 9 outside the draft vocab


def test_row_weights_by_hand():
    # k=0: valid·loss_mask[t+1] = [1,1,1,0,1,0]·[1,1,1,0,1,0]; t2d[argmax[t+1]] = t2d[1,9,2,3,4,-] = [1,0,1,1,1,·]
    #      → mask [1,0,1,0,1,0] (3 rows)
    # k=1: valid [1,1,0,0,0,0]·loss_mask[t+2] [1,1,0,1,0,0]; t2d[argmax[t+2]] = t2d[9,2,..] = [0,1,..]
    #      → mask [0,1,0,0,0,0] (1 row)
    from models.ttt import structural_valid
    assert torch.equal(structural_valid(DOC, 2), VALID)
    w = row_weights(VALID, LOSS_MASK, TARGET_ARGMAX, T2D)
    third = 1 / 3
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([[third, 0, third, 0, third, 0],
                                                [0, 0.8, 0, 0, 0, 0]]), atol=1e-7, rtol=0)
    no_pos = row_weights(VALID, LOSS_MASK, TARGET_ARGMAX, T2D, position_mask=False, step_weight=1.0)
    torch.testing.assert_close(no_pos, torch.tensor([[0.25, 0.25, 0.25, 0, 0.25, 0],
                                                     [0.5, 0.5, 0, 0, 0, 0]]), atol=1e-7, rtol=0)
    sf = row_weights(VALID, LOSS_MASK, TARGET_ARGMAX, T2D, normalisation="specforge")
    torch.testing.assert_close(sf, torch.tensor([[1, 0, 1, 0, 1, 0],
                                                 [0, 0.8, 0, 0, 0, 0]]) / 6, atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="normalisation"):
        row_weights(VALID, LOSS_MASK, TARGET_ARGMAX, T2D, normalisation="mean")


def test_rows_with_nothing_to_learn_give_zero_weights_not_nan():
    w = row_weights(torch.zeros(3, 6, dtype=torch.bool), LOSS_MASK, TARGET_ARGMAX, T2D)
    assert torch.equal(w, torch.zeros(3, 6))


def test_reference_loss_by_definition_and_against_the_fused_entry_point():
    kernels = pytest.importorskip("kernels")
    g = torch.Generator().manual_seed(0)
    K, T, H, tH, Vd = 3, 11, 16, 12, 37
    hidden = torch.randn(K, T, H, generator=g, requires_grad=True)
    weight = torch.randn(Vd, H, generator=g, requires_grad=True)
    last, rows = torch.randn(T, tH, generator=g), torch.randn(Vd, tH, generator=g)
    doc = torch.tensor([0] * 6 + [1] * 5, dtype=torch.int32)
    from models.ttt import structural_valid
    w = row_weights(structural_valid(doc, K), torch.ones(T, dtype=torch.bool),
                    torch.zeros(T, dtype=torch.long), torch.ones(Vd, dtype=torch.bool))
    loss = reference_loss(hidden, weight, last, rows, w)
    # by definition, one row at a time: step 1, row 2 is scored against the teacher at index 4
    p = torch.softmax(last[4] @ rows.T, -1)
    ce = -(p * torch.log_softmax(hidden[1, 2] @ weight.T, -1)).sum()
    by_rows = 0.0
    for k in range(K):
        for t in range(T):
            if w[k, t] > 0:
                pk = torch.softmax(last[t + 1 + k] @ rows.T, -1)
                by_rows = by_rows + w[k, t] * -(pk * torch.log_softmax(hidden[k, t] @ weight.T, -1)).sum()
    torch.testing.assert_close(loss, by_rows)
    assert w[1, 2] > 0 and torch.isfinite(ce)
    # the fused loss takes the teacher shifted by one (row t = target at t+1)
    teacher = torch.softmax(torch.cat([last[1:], last[-1:]]) @ rows.T, -1)
    fused = kernels.eagle3_loss(hidden, weight, teacher, w, impl="torch")
    torch.testing.assert_close(fused.loss, loss, atol=1e-5, rtol=1e-5)
    g_ref = torch.autograd.grad(loss, [hidden, weight])
    g_fused = torch.autograd.grad(fused.loss, [hidden, weight])
    for a, b in zip(g_ref, g_fused):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
