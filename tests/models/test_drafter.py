"""Eagle3Drafter: the TTT shift by hand, flex == eager through the whole unroll, weights and vocab."""

import pytest
import torch

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.rope import apply_rope, rope_parameters
from eyas.data.common.targets import load_target_config
from eyas.models.ttt import shifted_for_steps, step_positions, step_tokens, structural_valid

# 6-token packed batch: document 0 = (10 11 12), document 1 = (20 21), one padding row
IDS = torch.tensor([10, 11, 12, 20, 21, 0])
DOC = torch.tensor([0, 0, 0, 1, 1, -1], dtype=torch.int32)
POS = torch.tensor([0, 1, 2, 0, 1, 0])


def test_shift_by_hand():
    assert step_tokens(IDS, 0).tolist() == [11, 12, 20, 21, 0, 0]      # input_ids[t+1]
    assert step_tokens(IDS, 1).tolist() == [12, 20, 21, 0, 0, 0]      # input_ids[t+2]
    assert step_tokens(IDS, 2).tolist() == [20, 21, 0, 0, 0, 0]
    assert step_positions(POS, 2).tolist() == [2, 3, 4, 2, 3, 2]      # positions[t] + k
    assert structural_valid(DOC, 3).int().tolist() == [
        [1, 1, 0, 1, 0, 0],      # k=0: t+1 in the same document
        [1, 0, 0, 0, 0, 0],      # k=1: only row 0 (token 2) stays in document 0
        [0, 0, 0, 0, 0, 0],      # k=2: no document has 4 tokens
    ]
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.bool)
    assert shifted_for_steps(loss_mask, 2, False).int().tolist() == [
        [1, 1, 0, 1, 0, 0],      # loss_mask[t+1]
        [1, 0, 1, 0, 0, 0],      # loss_mask[t+2]
    ]


def _tiny(attention="eager", dtype=torch.float32, seed=0):
    cfg = Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=256,
                                   aux_layer_ids=[2, 4, 5], ttt_steps=4)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, attention=attention, compile_flex=False)
    drafter.embed_tokens.weight.data.normal_()
    return drafter.to(dtype)


def _packed(T=30, seed=0, tH=64):
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([0] * 9 + [1] * 14 + [2] * 4 + [-1] * (T - 27), dtype=torch.int32)
    pos = torch.cat([torch.arange(9), torch.arange(14), torch.arange(4),
                     torch.zeros(T - 27, dtype=torch.long)])
    ids = torch.randint(1, 49152, (T,), generator=g)
    return ids, torch.randn(T, 3 * tH, generator=g).bfloat16(), doc, pos


def test_forward_shapes_and_flex_equals_eager_values():
    drafter = _tiny()
    ids, aux, doc, pos = _packed()
    with torch.no_grad():
        eager = drafter(ids, aux, doc, pos, return_prenorm=True)
        drafter.attention = "flex"
        flex = drafter(ids, aux, doc, pos, return_prenorm=True)
    assert eager.hidden.shape == eager.prenorm.shape == (4, 30, 64)
    assert torch.equal(eager.valid, structural_valid(doc, 4))
    torch.testing.assert_close(flex.hidden, eager.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex.prenorm, eager.prenorm, atol=1e-5, rtol=1e-5)
    # the final norm is applied to the pre-norm output: hidden = norm(prenorm)
    torch.testing.assert_close(drafter.norm(eager.prenorm), eager.hidden)


def test_gradients_of_the_unroll_agree_between_attention_paths():
    """eager (one softmax over [K_0|..|K_k]) vs the flex decomposition (lse merge), fp32."""
    ids, aux, doc, pos = _packed(seed=1)
    w = torch.randn(4, 30, 64, generator=torch.Generator().manual_seed(5))
    grads = {}
    for kind in ("eager", "lse-eager"):
        drafter = _tiny(kind)
        out = drafter(ids, aux, doc, pos)
        (out.hidden * w * out.valid[..., None]).sum().backward()
        grads[kind] = {n: p.grad for n, p in drafter.named_parameters() if p.requires_grad}
        assert drafter.embed_tokens.weight.grad is None                # frozen
    assert grads["eager"].keys() == grads["lse-eager"].keys()
    for name in grads["eager"]:
        torch.testing.assert_close(grads["lse-eager"][name], grads["eager"][name],
                                   atol=1e-5, rtol=1e-4, msg=name)


def test_padding_and_other_documents_do_not_leak():
    """Changing another document's tokens/features leaves a document's valid rows unchanged."""
    drafter = _tiny()
    ids, aux, doc, pos = _packed(seed=2)
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[23:] = 7                      # document 2 and padding
    aux2[23:] = 0
    with torch.no_grad():
        a, b = drafter(ids, aux, doc, pos), drafter(ids2, aux2, doc, pos)
    rows = a.valid & (doc[None, :] <= 1)
    assert rows.sum() > 40
    torch.testing.assert_close(a.hidden[rows], b.hidden[rows], atol=0, rtol=0)


def test_bf16_parameters_run_and_stay_close_to_fp32():
    ids, aux, doc, pos = _packed(seed=3)
    with torch.no_grad():
        ref = _tiny().forward(ids, aux, doc, pos)
        low = _tiny(dtype=torch.bfloat16).forward(ids, aux, doc, pos)
    assert low.hidden.dtype == torch.bfloat16
    err = (low.hidden.float() - ref.hidden)[ref.valid].abs().max()
    assert err < 0.1, err


def test_forward_batch_uses_loader_batch():
    from eyas.data.store.loader import Batch
    drafter = _tiny()
    ids, aux, doc, pos = _packed(seed=4)
    batch = Batch(input_ids=ids, loss_mask=torch.ones(30, dtype=torch.bool), doc_ids=doc,
                  positions=pos, aux=aux, target_argmax=ids, num_tokens=27)
    with torch.no_grad():
        torch.testing.assert_close(drafter.forward_batch(batch, 2).hidden,
                                   drafter(ids, aux, doc, pos, 2).hidden)


def test_input_shape_errors_name_the_shapes():
    drafter = _tiny()
    ids, aux, doc, pos = _packed()
    with pytest.raises(ValueError, match=r"aux has shape \(30, 96\)"):
        drafter(ids, aux[:, :96], doc, pos)


def test_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)
    for scaling, theta in ((llama3, 500000.0), (dict(rope_type="linear", factor=4.0), 1e4)):
        hf = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_theta=theta,
                         rope_scaling=scaling, max_position_embeddings=131072)
        want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
        inv_freq, _ = rope_parameters(128, theta, scaling, 8192)
        torch.testing.assert_close(inv_freq, want, atol=0, rtol=0)
    # rotate-half layout: position 0 is the identity, and rotation preserves pairwise norms
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(apply_rope(x, torch.zeros(3, dtype=torch.long),
                                          rope_parameters(8, 1e4, None, 8192)[0]), x)


def test_vocab_map_and_lm_head_init():
    drafter = _tiny()
    ids = torch.sort(torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:256]).values
    d2t = ids - torch.arange(256)
    head = torch.randn(49152, 64)
    drafter.init_lm_head_from_target(head, d2t)
    assert torch.equal(drafter.d2t, d2t)
    assert torch.equal(drafter.t2d.nonzero()[:, 0], ids)
    assert torch.equal(drafter.lm_head.weight, head[ids])              # row i ↔ id i + d2t[i]
    with pytest.raises(ValueError, match=r"leaves \[0, 49152\): d2t must hold offsets"):
        drafter.set_vocab_map(ids)                                     # absolute ids, not offsets
    with pytest.raises(ValueError, match="not strictly increasing: row 0 -> 0, row 1 -> 0"):
        drafter.set_vocab_map(-torch.arange(256))                      # every row → id 0
    bad_t2d = drafter.t2d.clone()
    bad_t2d[ids[0]] = False
    with pytest.raises(ValueError, match="t2d selects 255 ids but d2t has Vd = 256 rows"):
        drafter.set_vocab_map(d2t, bad_t2d)
    emb = torch.randn(49152, 64)
    drafter.load_target_embedding(emb)
    assert torch.equal(drafter.embed_tokens.weight, emb)
    assert not drafter.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="vocab_size, hidden_size"):
        drafter.load_target_embedding(torch.randn(49152, 32))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_swiglu_down_recomputes_the_product_with_the_same_values_and_gradients(dtype):
    from eyas.models.layer import MLP
    torch.manual_seed(0)
    mlp = MLP(16, 48).to(dtype)
    x = torch.randn(10, 16, dtype=dtype, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        y = mlp(x)
    # gate and up [10, 48] are kept for the backward, the product silu(gate)·up is not
    assert sum(1 for s in saved if tuple(s) == (10, 48)) == 2
    y_ref = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *mlp.parameters()], dy)
    want = torch.autograd.grad(y_ref, [x, *mlp.parameters()], dy)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
