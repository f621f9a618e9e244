"""The proof: the engines' incremental decoding reproduces the training unroll at every step.

For real target features (SmolLM2-135M-Instruct on chat-templated text, and the tiny random
Llama / DeepSeek-V3 targets), packed into one batch of several documents plus padding, the
training forward's logits lm_head(hidden[k, t]) must equal what `models.serving.reference.EngineDrafter`
computes when it serves the same checkpoint (layout-A names, d2t scatter, KV cache, pre-norm
feedback) for every start row t and draft step k:
  * fp32: to 1e-5 relative to the logit scale (|Δ| <= 1e-5 · max|logit|; logits reach ~10-25);
  * bf16 (both sides in bf16, as trained and served): the training logits may be no further from
    the fp32 truth than BF16_FACTOR × the engine's own bf16 error + BF16_SLACK, and the greedy
    draft (argmax) agrees on at least BF16_ARGMAX_AGREE of the rows.
"""

import pytest
import torch

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.reference import EngineDrafter, serve_packed
from eyas.data.common.targets import default_aux_layer_ids, load_target

K = 5
FP32_TOL = 1e-5                          # × max(1, max |logit|): fp32 rounding of two orderings
BF16_FACTOR, BF16_SLACK = 2.0, 0.05     # two independent bf16 computations differ by ~1x each
BF16_ARGMAX_AGREE = 0.97                 # near-ties may flip under bf16 rounding

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The serving loop is ~10^3 tiny ops: one intra-op thread avoids thread-pool barriers, which
    dominate on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "user", "content": "Name two prime numbers."},
     {"role": "assistant", "content": "Two and three are both prime."}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
]


def _features(name: str, n_docs: int, pad: int = 5):
    """Packed batch (ids, aux bf16, doc_ids, positions) from the target's hidden states."""
    model, tok = load_target(name, dtype=torch.float32)       # fp32 GEMMs: fast on CPU
    aux_ids = default_aux_layer_ids(model.config.num_hidden_layers)
    parts = []
    for chat in CHATS[:n_docs]:
        ids = torch.tensor(tok.apply_chat_template(chat, tokenize=True, return_dict=False))
        ids = ids[-28:] if name != "smollm2" else ids                 # tiny targets: keep it short
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        parts.append((ids, torch.cat([hs[i][0] for i in aux_ids], dim=-1)))
    ids = torch.cat([p[0] for p in parts] + [torch.zeros(pad, dtype=torch.long)])
    aux = torch.cat([p[1] for p in parts] + [torch.zeros(pad, parts[0][1].shape[1]).bfloat16()])
    doc = torch.cat([torch.full((len(p[0]),), i) for i, p in enumerate(parts)]
                    + [torch.full((pad,), -1)]).int()
    pos = torch.cat([torch.arange(len(p[0])) for p in parts] + [torch.zeros(pad, dtype=torch.long)])
    return model, ids, aux.bfloat16(), doc, pos, aux_ids


def _drafter(model, aux_ids, ids, draft_vocab=1024):
    """A drafter for `model`: target embedding, lm_head from target head rows, a d2t that holds
    the batch's tokens plus random others (so some targets are in, some out of the vocabulary)."""
    cfg = Eagle3Config.from_target(model.config.to_dict(), draft_vocab_size=draft_vocab,
                                   aux_layer_ids=aux_ids)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, attention="eager")
    drafter.reset_parameters(std=0.05)
    V = cfg.vocab_size
    pool = torch.unique(torch.cat([ids, torch.randperm(V)[:draft_vocab]]))[:draft_vocab]
    chosen = torch.sort(pool).values
    drafter.load_target_embedding(model.get_input_embeddings().weight.float())
    head = model.get_output_embeddings().weight.float()
    drafter.init_lm_head_from_target(head / head.std() * 0.2, chosen - torch.arange(draft_vocab))
    return drafter


def _engine(drafter, dtype):
    """What an exporter writes and an engine loads: layout-A tensors without embed_tokens."""
    tensors = {k: v.to(dtype) if v.is_floating_point() else v
               for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    return EngineDrafter.from_tensors(drafter.config.to_config_dict(), tensors,
                                      drafter.embed_tokens.weight.to(dtype))


def _training_logits(drafter, ids, aux, doc, pos, dtype):
    with torch.no_grad():
        out = drafter.to(dtype)(ids, aux, doc, pos, K)
        return drafter.draft_logits(out.hidden), out.valid


def _check(name, n_docs):
    model, ids, aux, doc, pos, aux_ids = _features(name, n_docs)
    drafter = _drafter(model, aux_ids, ids)
    train32, valid = _training_logits(drafter, ids, aux, doc, pos, torch.float32)
    serve32 = serve_packed(_engine(drafter, torch.float32), ids, aux, doc, pos, K)
    reached = ~torch.isnan(serve32[..., 0])
    assert torch.equal(reached, valid)                           # same rows, same steps
    assert valid.sum(1).tolist()[:2] == [len(ids) - 5 - n_docs, len(ids) - 5 - 2 * n_docs]
    scale = float(train32[valid].abs().max())
    assert scale > 1.0                                           # logits with real spread
    torch.testing.assert_close(train32[valid], serve32[valid], atol=FP32_TOL * scale, rtol=0)

    train16, _ = _training_logits(drafter, ids, aux, doc, pos, torch.bfloat16)
    serve16 = serve_packed(_engine(drafter, torch.bfloat16), ids, aux, doc, pos, K)
    err_train = (train16[valid] - serve32[valid]).abs().max()
    err_serve = (serve16[valid] - serve32[valid]).abs().max()
    assert err_train <= BF16_FACTOR * err_serve + BF16_SLACK, (float(err_train), float(err_serve))
    agree = (train16[valid].argmax(-1) == serve16[valid].argmax(-1)).float().mean()
    assert agree >= BF16_ARGMAX_AGREE, float(agree)


def test_engine_parity_smollm2_real_hidden_states():
    _check("smollm2", 2)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])
def test_engine_parity_tiny_targets(name):
    _check(name, 3)


def test_greedy_chain_equals_teacher_forced_training_on_its_own_drafts():
    """Feed the engine's greedy chain back as the training tokens: every training argmax
    (mapped through d2t) reproduces the chain, step by step."""
    model, ids, aux, doc, pos, aux_ids = _features("tiny-llama", 1, pad=0)
    drafter = _drafter(model, aux_ids, ids)
    engine = _engine(drafter, torch.float32)
    t = 14                                                         # chain starts after row t
    chain = engine.draft_chain(aux[:t + 1], ids[1:t + 2], pos[:t + 1], K)
    assert engine.cache_len == t + 1                               # draft entries rolled back
    train_ids = torch.cat([ids[:t + 2], chain[:-1]])               # tokens t+2.. = the drafts
    T = train_ids.shape[0]
    train_aux = torch.cat([aux[:t + 1], torch.zeros(T - t - 1, aux.shape[1]).bfloat16()])
    logits, valid = _training_logits(drafter, train_ids, train_aux, torch.zeros(T).int(),
                                     torch.arange(T), torch.float32)
    assert valid[:, t].all()
    drafted = logits[:, t].argmax(-1)
    assert torch.equal(drafted + drafter.d2t[drafted], chain)


def _layout_a(drafter):
    return {k: v for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}


def test_loader_rejects_what_engines_reject_or_mis_serve():
    cfg = Eagle3Config.from_target({"hidden_size": 32, "num_hidden_layers": 8, "vocab_size": 300,
                                    "num_attention_heads": 2, "intermediate_size": 64},
                                   draft_vocab_size=100)
    drafter = Eagle3Drafter(cfg, attention="eager")
    emb, d = drafter.embed_tokens.weight, cfg.to_config_dict()
    EngineDrafter.from_tensors(d, _layout_a(drafter), emb)       # the good case loads
    cases = [
        (dict(_layout_a(drafter), **{"embed_tokens.weight": emb}), d, "not in layout A"),
        ({("model." + k): v for k, v in _layout_a(drafter).items()}, d, "not in layout A"),
        ({k: v for k, v in _layout_a(drafter).items() if k != "lm_head.weight"}, d, "missing"),
        ({k: v for k, v in _layout_a(drafter).items() if k != "d2t"}, d, "no d2t"),
        (dict(_layout_a(drafter), d2t=-torch.arange(100)), d, "OFFSETS"),     # all → id 0
        (_layout_a(drafter), dict(d, num_key_value_heads=1), "k_proj"),
        (_layout_a(drafter), dict(d, target_hidden_size=None), "target_hidden_size"),
    ]
    for tensors, config, match in cases:
        with pytest.raises(ValueError, match=match):
            EngineDrafter.from_tensors(config, tensors, emb)


def test_scattered_logits_are_minus_inf_outside_the_draft_vocab():
    cfg = Eagle3Config.from_target({"hidden_size": 32, "num_hidden_layers": 8, "vocab_size": 300,
                                    "num_attention_heads": 2, "intermediate_size": 64},
                                   draft_vocab_size=100)
    drafter = Eagle3Drafter(cfg, attention="eager")
    drafter.set_vocab_map(torch.arange(100) * 2 - torch.arange(100))    # even ids 0..198
    engine = EngineDrafter.from_tensors(cfg.to_config_dict(), _layout_a(drafter),
                                        drafter.embed_tokens.weight)
    _, logits = engine.prefill(torch.randn(3, 96), torch.tensor([4, 5, 6]), torch.arange(3))
    assert torch.isfinite(logits[:, 0:200:2]).all()
    assert torch.isinf(logits[:, 1:200:2]).all() and torch.isinf(logits[:, 200:]).all()
    assert logits.argmax(-1).remainder(2).eq(0).all()
