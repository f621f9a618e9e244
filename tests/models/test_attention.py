"""TTT attention: the mask written out by hand, and flex == lse-eager == eager (values, gradients).

torch's flex_attention has no backward on CPU, so on CPU the flex path is checked for values
only; its log-sum-exp decomposition is checked for gradients through "lse-eager" (same merge,
dense step-0 part). The GPU test at the bottom checks compiled flex gradients too.
"""

import pytest
import torch

from eyas.models.attention import (TTTAttention, dense_step0, flex_step0, step0_block_mask, step0_mask,
                              ttt_mask)

# two documents and one padding row:  a0 a1 a2 | b0 b1 | pad
DOC = torch.tensor([0, 0, 0, 1, 1, -1], dtype=torch.int32)

STEP0 = [  # query row → step-0 key rows it sees (causal within its document; padding sees itself)
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0],
    [0, 0, 0, 1, 0, 0],
    [0, 0, 0, 1, 1, 0],
    [0, 0, 0, 0, 0, 1],
]
STEP2 = [  # KV = [K_0 (6 rows) | K_1 (6 rows) | K_2 (6 rows)]: prefix + own row at steps 1 and 2
    [1, 0, 0, 0, 0, 0,  1, 0, 0, 0, 0, 0,  1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0,  0, 1, 0, 0, 0, 0,  0, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0,  0, 0, 1, 0, 0, 0,  0, 0, 1, 0, 0, 0],
    [0, 0, 0, 1, 0, 0,  0, 0, 0, 1, 0, 0,  0, 0, 0, 1, 0, 0],
    [0, 0, 0, 1, 1, 0,  0, 0, 0, 0, 1, 0,  0, 0, 0, 0, 1, 0],
    [0, 0, 0, 0, 0, 1,  0, 0, 0, 0, 0, 1,  0, 0, 0, 0, 0, 1],
]


def test_masks_by_hand():
    assert torch.equal(step0_mask(DOC), torch.tensor(STEP0, dtype=torch.bool))
    assert torch.equal(ttt_mask(DOC, 0), torch.tensor(STEP0, dtype=torch.bool))
    assert torch.equal(ttt_mask(DOC, 2), torch.tensor(STEP2, dtype=torch.bool))
    step1 = torch.tensor(STEP2, dtype=torch.bool)[:, :12]
    assert torch.equal(ttt_mask(DOC, 1), step1)


@pytest.mark.parametrize("kind", ["flex", "eager", "lse-eager"])
def test_attention_support_equals_the_mask(kind):
    """Zero queries/keys give uniform attention over the visible keys; one-hot values reveal them."""
    T, K, d = 6, 3, 24                                   # d >= T·K: one value slot per (step, row)
    attn = TTTAttention(DOC, kind, head_dim=d, compile_flex=False)
    with torch.no_grad():
        for k in range(K):
            v = torch.zeros(1, T, d)
            v[0, torch.arange(T), k * T + torch.arange(T)] = 1.0
            out = attn(torch.zeros(2, T, d), torch.zeros(1, T, d), v)      # 2 query heads, 1 KV head
            expect = torch.tensor(STEP2, dtype=torch.float32)[:, :T * (k + 1)]
            expect = expect / expect.sum(1, keepdim=True)
            for h in range(2):
                torch.testing.assert_close(out[h, :, :T * (k + 1)], expect, atol=1e-6, rtol=0)


def _qkv(T, nh, nkv, d, steps, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g).requires_grad_(requires_grad)  # noqa: E731
    return [(make(nh, T, d), make(nkv, T, d), make(nkv, T, d)) for _ in range(steps)]


def _run(kind, doc, steps_qkv, d):
    attn = TTTAttention(doc, kind, head_dim=d, compile_flex=False)
    return [attn(q, k, v) for q, k, v in steps_qkv]


PACKED = torch.tensor([0] * 7 + [1] * 12 + [2] * 3 + [-1] * 3, dtype=torch.int32)   # T = 25


def _elements_of(block_mask, doc):
    """The [T, T] mask a BlockMask computes: full tiles all on, partial tiles through its
    mask_mod, unlisted tiles off."""
    T = doc.numel()
    B = block_mask.BLOCK_SIZE[0]
    q, kv = torch.arange(T)[:, None], torch.arange(T)[None, :]
    on = torch.zeros(T, T, dtype=torch.bool)
    for nums, idx, full in ((block_mask.kv_num_blocks, block_mask.kv_indices, False),
                            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True)):
        for i in range(nums.shape[-1]):
            for j in idx[0, 0, i, :int(nums[0, 0, i])].tolist():
                rows, cols = slice(i * B, (i + 1) * B), slice(j * B, (j + 1) * B)
                assert not on[rows, cols].any(), "a tile listed twice"
                on[rows, cols] = True if full else block_mask.mask_mod(0, 0, q[rows], kv[:, cols])
    return on


@pytest.mark.parametrize("lengths", [[7, 12, 3, 2], [16, 16], [40], [5] * 6 + [2], [9, 30, 1],
                                     [7, 12, 3, -10], [9, 20, -3]])
@pytest.mark.parametrize("block", [4, 8])
def test_block_mask_lists_the_tiles_of_create_block_mask(lengths, block):
    """Packed rows of T = 24, 32 or 40 tokens (multiples of the block); a negative length is
    that many padding rows (-1)."""
    from eyas.models.attention import reference_block_mask
    doc = torch.cat([torch.full((abs(n),), i if n > 0 else -1, dtype=torch.int32)
                     for i, n in enumerate(lengths)])
    ours, ref = step0_block_mask(doc, block), reference_block_mask(doc, block)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert torch.equal(_elements_of(ours, doc), step0_mask(doc))


@pytest.mark.parametrize("doc", [PACKED, torch.tensor([0, 0, 1, 1, 0, 0, 2, -1, 1, 1, -1, 2]),
                                 torch.tensor([3, 3, 3, 1, 1, 1, 1, 2, 2, 0, 0, 0, 0, 0]),
                                 torch.tensor([0] * 20), torch.tensor([0] * 9 + [1] * 9 + [-1])])
def test_block_mask_is_exact_for_any_document_ids(doc):
    """Padding rows, ids out of order, documents split in two runs, T not a multiple of the
    block: tiles may be listed that a finer test would skip, but every element computes
    exactly the step-0 mask."""
    for block in (2, 4, 8):
        assert torch.equal(_elements_of(step0_block_mask(doc, block), doc), step0_mask(doc))


def test_flex_step0_matches_dense_out_and_lse():
    (q, k, v), = _qkv(25, 4, 2, 16, 1)
    with torch.no_grad():
        out_f, lse_f = flex_step0(q, k, v, step0_block_mask(PACKED), 0.25, compile_flex=False)
        out_d, lse_d = dense_step0(q, k, v, step0_mask(PACKED), 0.25)
    torch.testing.assert_close(out_f.float(), out_d, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_f, lse_d, atol=1e-5, rtol=1e-5)     # natural-log lse


def test_flex_values_equal_eager_on_cpu():
    qkv = _qkv(25, 4, 2, 16, 4, seed=1)
    with torch.no_grad():
        flex, eager = _run("flex", PACKED, qkv, 16), _run("eager", PACKED, qkv, 16)
    for a, b in zip(flex, eager):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def test_flex_refuses_cpu_backward_with_a_clear_error():
    qkv = _qkv(25, 4, 2, 16, 1, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attention='eager'"):
        _run("flex", PACKED, qkv, 16)


def test_lse_merge_values_and_gradients_equal_eager():
    qkv = _qkv(25, 4, 2, 16, 4, seed=2, requires_grad=True)
    weights = [torch.randn(4, 25, 16, generator=torch.Generator().manual_seed(9 + i))
               for i in range(4)]
    grads = {}
    for kind in ("eager", "lse-eager"):
        outs = _run(kind, PACKED, qkv, 16)
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        grads[kind] = [o.detach() for o in outs] + list(
            torch.autograd.grad(loss, [t for step in qkv for t in step]))
    for a, b in zip(grads["eager"], grads["lse-eager"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_compiled_flex_gradients_equal_eager_on_gpu():
    T = 300
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate([100, 150, 40])]
                    + [torch.full((10,), -1)]).int().cuda()
    qkv = [tuple(t.cuda().detach().requires_grad_(True) for t in step)
           for step in _qkv(T, 8, 2, 64, 4, seed=3)]
    weights = [torch.randn(8, T, 64, device="cuda") for _ in range(4)]
    grads = {}
    for kind in ("eager", "flex"):
        attn = TTTAttention(doc, kind, head_dim=64, compile_flex=True)
        outs = [attn(q, k, v) for q, k, v in qkv]
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        grads[kind] = [o.detach() for o in outs] + list(
            torch.autograd.grad(loss, [t for step in qkv for t in step]))
    for a, b in zip(grads["eager"], grads["flex"]):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_the_compiled_merge_equals_eager_and_leaves_dynamo_config_alone():
    """The merge's raised recompile limit holds for its own calls, not process-wide."""
    from eyas.models import attention
    before = torch._dynamo.config.recompile_limit
    merge = attention.compiled_merge()
    g = torch.Generator().manual_seed(0)
    nh, T, d = 2, 8, 16
    q, out0 = torch.randn(nh, T, d, generator=g), torch.randn(nh, T, d, generator=g)
    lse0 = torch.randn(nh, T, generator=g)
    ks, vs = [torch.randn(nh, T, d, generator=g)], [torch.randn(nh, T, d, generator=g)]
    got = merge(out0, lse0, q, ks, vs, 0.25)
    torch.testing.assert_close(got, attention._merge_and_cast(out0, lse0, q, ks, vs, 0.25))
    assert torch._dynamo.config.recompile_limit == before
