"""teacher_probs / teacher_from_topk against plain-torch references written here."""

import pytest
import torch

from eyas.kernels.loss import eagle3_loss
from eyas.kernels.teacher import teacher_from_topk, teacher_probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_teacher_probs_matches_softmax(dtype, chunk_size):
    g = torch.Generator().manual_seed(0)
    last = (torch.randn(10, 16, generator=g) * 2).to(dtype)
    rows = torch.randn(50, 16, generator=g).to(dtype)
    p = teacher_probs(last, rows, chunk_size=chunk_size)
    ref = torch.softmax(last.float() @ rows.float().T, dim=1)
    assert p.dtype == torch.bfloat16 and p.shape == (10, 50)
    torch.testing.assert_close(p.float(), ref, rtol=8e-3, atol=1e-6)   # bf16 output rounding
    torch.testing.assert_close(p.float().sum(1), torch.ones(10), rtol=0, atol=2e-2)


def test_teacher_probs_rejects_mismatched_hidden():
    with pytest.raises(ValueError, match="hidden sizes differ"):
        teacher_probs(torch.randn(4, 8), torch.randn(5, 9))


def _topk_reference(ids, logits, t2d, Vd):
    out = torch.zeros(ids.shape[0], Vd)
    for n in range(ids.shape[0]):
        keep = [(int(t2d[i]), float(l)) for i, l in zip(ids[n], logits[n]) if t2d[i] >= 0]
        if not keep:
            continue
        d, ls = zip(*keep)
        out[n, list(d)] = torch.softmax(torch.tensor(ls), 0)
    return out


def test_teacher_from_topk_renormalises_in_vocab_entries():
    V, Vd, N, k = 40, 12, 6, 5
    g = torch.Generator().manual_seed(1)
    draft_ids = torch.randperm(V, generator=g)[:Vd]
    t2d = torch.full((V,), -1, dtype=torch.int64)
    t2d[draft_ids] = torch.arange(Vd)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])
    ids[0] = draft_ids[:k]                                   # all in vocab
    ids[1] = torch.tensor([i for i in range(V) if t2d[i] < 0][:k])   # none in vocab
    ids[2, 0] = draft_ids[0]                                 # includes draft id 0 (scatter)
    logits = torch.randn(N, k, generator=g) * 3
    p = teacher_from_topk(ids, logits, t2d, Vd, dtype=torch.float32)
    ref = _topk_reference(ids, logits, t2d, Vd)
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(p[1], torch.zeros(Vd))
    assert teacher_from_topk(ids, logits, t2d, Vd).dtype == torch.bfloat16
    # A zero teacher row adds no loss and no gradient.
    h = torch.randn(1, N, 8, requires_grad=True)
    W = torch.randn(Vd, 8)
    w = torch.zeros(1, N)
    w[0, 1] = 1.0
    out = eagle3_loss(h, W, p, w, impl="torch")
    out.loss.backward()
    assert out.loss.item() == 0.0 and not h.grad.any()


def test_teacher_from_topk_validates_shapes():
    with pytest.raises(ValueError, match="both be"):
        teacher_from_topk(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 5),
                          torch.zeros(9, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="int64"):
        teacher_from_topk(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 4),
                          torch.zeros(9, dtype=torch.int32), 4)
