"""Loss weights by hand, and the fp32 reference loss against the fused-loss entry point."""

import pytest
import torch

from eyas.models.objective import row_weights


def reference_loss(hidden, lm_head_weight, last, target_head_rows, row_weight):
    """Plain fp32 torch loss (the loss of models/objective.py's docstring); differentiable.

    hidden [K, T, H] (normed drafter outputs), lm_head_weight [Vd, H], last [T, tH] (the target's
    post-norm final hidden states, NOT shifted), target_head_rows [Vd, tH] (target lm_head rows
    i + d2t[i]), row_weight [K, T] (`row_weights`). Row (k, t) is scored against the teacher at
    index t+1+k:  Σ_{k,t} w(k,t) · −Σ_v p_{t+1+k}[v] · log_softmax(lm_head(hidden[k, t]))[v].
    """
    K, T, _ = hidden.shape
    p = torch.softmax(last.float() @ target_head_rows.float().T, dim=-1)  # [T, Vd]
    total = hidden.new_zeros((), dtype=torch.float32)
    for k in range(K):
        logq = torch.log_softmax(hidden[k].float() @ lm_head_weight.float().T, dim=-1)   # [T, Vd]
        idx = torch.arange(T, device=hidden.device) + 1 + k
        pk = p[idx.clamp_max(T - 1)]                                      # teacher at t+1+k
        ce = -(pk * logq).sum(-1)                                         # [T]
        w = row_weight[k].float()
        total = total + (w * torch.where(w != 0, ce, torch.zeros_like(ce))).sum()
    return total


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
    from eyas.models.ttt import structural_valid
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
    kernels = pytest.importorskip("eyas.kernels.loss")
    g = torch.Generator().manual_seed(0)
    K, T, H, tH, Vd = 3, 11, 16, 12, 37
    hidden = torch.randn(K, T, H, generator=g, requires_grad=True)
    weight = torch.randn(Vd, H, generator=g, requires_grad=True)
    last, rows = torch.randn(T, tH, generator=g), torch.randn(Vd, tH, generator=g)
    doc = torch.tensor([0] * 6 + [1] * 5, dtype=torch.int32)
    from eyas.models.ttt import structural_valid
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


def test_metric_rows_by_hand_cover_every_weighted_row():
    from eyas.models.objective import metric_rows
    # metric_mask = VALID · loss_mask[t+1+k]: k=0 → [1,1,1,0,1,0], k=1 → [1,1,0,0,0,0]
    rows = metric_rows(DOC, LOSS_MASK, 2)
    assert rows.dtype == torch.int64
    assert rows.tolist() == [0, 1, 2, 4, 6, 7]
    w = row_weights(VALID, LOSS_MASK, TARGET_ARGMAX, T2D).reshape(-1)
    listed = torch.zeros_like(w, dtype=torch.bool)
    listed[rows] = True
    assert not (w != 0)[~listed].any()                  # position mask only removes rows


def test_training_module_listed_rows_match_all_rows():
    """TrainingModule with host-listed rows: same loss and gradients, argmax −1 off the mask."""
    from eyas.models.config import Eagle3Config
    from eyas.models.drafter import Eagle3Drafter
    from eyas.models.objective import metric_rows
    from eyas.train.step import TrainingModule
    from types import SimpleNamespace
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=96, draft_vocab_size=48,
                       target_hidden_size=24, head_dim=8, aux_layer_ids=[2, 4, 6])
    drafter = Eagle3Drafter(cfg, attention="eager")
    drafter.embed_tokens.weight.data.normal_()
    ids = torch.randperm(96)[:48].sort().values
    drafter.set_vocab_map(ids - torch.arange(48))
    loss_cfg = SimpleNamespace(step_weight=0.8, normalisation="valid", position_mask=True,
                               chunk_size=7, objective="soft_ce", lk_eta=3.0)
    module = TrainingModule(drafter, torch.randn(48, 24), loss_cfg, loss_impl="torch",
                            ttt_steps=3)
    T = 20
    doc = torch.tensor([0] * 8 + [1] * 9 + [-1] * 3, dtype=torch.int32)
    pos = torch.cat([torch.arange(8), torch.arange(9), torch.zeros(3, dtype=torch.long)])
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                        dtype=torch.bool)
    inputs = dict(input_ids=torch.randint(0, 96, (T,)), aux=torch.randn(T, 72),
                  doc_ids=doc, positions=pos, loss_mask=mask,
                  target_argmax=torch.randint(0, 96, (T,)), last=torch.randn(T, 24))
    results = []
    for rows in (None, metric_rows(doc, mask, 3)):
        module.zero_grad(set_to_none=True)
        out = module(**inputs, rows=rows)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        results.append((out, grads))
    (full, g_full), (listed, g_listed) = results
    torch.testing.assert_close(listed.loss, full.loss, rtol=1e-6, atol=1e-7)
    assert g_full.keys() == g_listed.keys() and len(g_full) > 5
    for name in g_full:
        torch.testing.assert_close(g_listed[name], g_full[name], rtol=1e-5, atol=1e-7)
    m = full.metric_mask
    assert torch.equal(listed.draft_argmax[m], full.draft_argmax[m])
    assert (listed.draft_argmax[~m] == -1).all()
