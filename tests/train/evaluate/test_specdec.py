"""Real speculative decoding (train.evaluate.specdec) against target-only greedy decoding.

Target: the tiny random Llama preset in fp32 (one-token and multi-token forwards then agree to
float noise, so greedy outputs must be identical token for token). Drafters:
  * an exported random-weight drafter, loaded through the engine reference like vLLM loads it
    (acceptance ~0, identity must hold);
  * a scripted drafter: the same engine reference (its KV cache, prefill/step bookkeeping), with
    the logits of the row at position q replaced by the true greedy token at q+2 except at
    chosen indices. Every acceptance length 0..K occurs and the expected counts follow from a
    10-line simulation of the decoding rule; the rows the drafter is fed (position, paired
    token, aux features) are checked against a full forward of the final sequence.
"""

import json
import logging
import math

import pytest
import torch

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.export import export_drafter
from eyas.models.serving.reference import EngineDrafter
from eyas.train.evaluate.specdec import (TargetRunner, decode_prompts, drafter_aux_layer_ids,
                                        greedy_decode, load_engine_drafter, speculative_decode,
                                        stop_token_ids)
from eyas.train.evaluate.specdec_summary import summarize
from eyas.data.common.targets import default_aux_layer_ids, load_target
from eyas.models.serving.contract import TensorDir

K = 3
QUESTIONS = ["Hi there", "What is 2+2?", "Tell me a story about a cat.", "Name a colour."]

pytestmark = pytest.mark.usefixtures("one_thread")


def run_prompts(model, drafter, drafter_cfg, prompts, *, k, max_new_tokens, stop_ids,
                names=None, progress=True, temperature=0.0, draft="argmax", seed=0):
    """`decode_prompts` then `summarize`: tau, per-position acceptance, forwards, tokens/s,
    speedup and token identity of the speculative output against target-only greedy."""
    pairs = decode_prompts(model, drafter, drafter_cfg, prompts, k=k, max_new_tokens=max_new_tokens,
                           stop_ids=stop_ids, names=names, progress=progress,
                           temperature=temperature, draft=draft, seed=seed)
    res = summarize(pairs, k, temperature=temperature)
    if temperature > 0:
        res.update(draft=draft, seed=seed)
    return res


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_target("tiny-llama", dtype=torch.float32)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False))
               for q in QUESTIONS]
    return model, tok, prompts


@pytest.fixture(scope="module")
def random_export(tiny, tmp_path_factory):
    model, _, _ = tiny
    cfg = Eagle3Config.from_target(model.config.to_dict(), draft_vocab_size=4096,
                                   aux_layer_ids=default_aux_layer_ids(8))
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="eager")
    d2t = torch.sort(torch.randperm(cfg.vocab_size)[:4096]).values - torch.arange(4096)
    d.set_vocab_map(d2t)
    return export_drafter(d.state_dict(), cfg, d2t, None, tmp_path_factory.mktemp("x") / "rand",
                          target_config=model.config.to_dict())


def test_random_drafter_is_token_identical(tiny, random_export, caplog):
    model, tok, prompts = tiny
    emb = model.get_input_embeddings().weight.detach()
    engine, cfg = load_engine_drafter(random_export, emb, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="eyas.train.evaluate.specdec"):
        res = run_prompts(model, engine, cfg, prompts, k=K, max_new_tokens=12,
                          stop_ids=stop_token_ids(model, tok))
    assert res["tokens_identical"], res["mismatches"]
    n = len(prompts)
    # progress in logs, where the bar is off: the last line carries the final counts
    assert caplog.messages[-1] == (f"specdec: {n}/{n} prompts, {res['tokens_generated']} tokens, "
                                   f"tau so far {res['tau']:.3f}")
    assert res["tokens_generated"] == res["baseline_tokens_generated"]
    # one prefill per prompt + one verify forward per round; the prefill yields one token
    assert res["target_forwards"] == res["decode_rounds"] + n
    assert res["decode_tokens"] == res["tokens_generated"] - n
    assert res["drafter_forwards"] == K * res["decode_rounds"]
    assert res["counts"]["reached"][0] == res["decode_rounds"]
    assert res["tau"] == 1 + res["mean_accepted_drafts"]
    assert res["tau_emitted"] == res["decode_tokens"] / res["decode_rounds"]
    reached, accepted = res["counts"]["reached"], res["counts"]["accepted"]
    hist = res["accepted_drafts_histogram"]
    assert len(hist) == K + 1 and sum(hist) == res["decode_rounds"]
    for j in range(K):
        if reached[j]:
            assert res[f"cond_acc_{j}"] == accepted[j] / reached[j]
        else:
            assert math.isnan(res[f"cond_acc_{j}"])
        assert res[f"alive_{j}"] == accepted[j] / res["decode_rounds"]
        assert accepted[j] == sum(hist[j + 1:]) and reached[j] == sum(hist[j:])
    assert not any(f"acc_{j}" in res for j in range(K))
    json.dumps(res)   # plain types only


class ScriptedDrafter(EngineDrafter):
    """The engine reference whose row at position q predicts truth[q+2], except where q+2 is in
    `wrong` (then truth[q+2] + 1). Records every step-0 row it is fed."""

    truth: list[int]
    wrong: set[int]

    def _scripted(self, positions) -> torch.Tensor:
        logits = torch.full((len(positions), self.V), float("-inf"))
        for r, q in enumerate(positions):
            want = self.truth[q + 2]
            logits[r, (want + 1) % self.V if q + 2 in self.wrong else want] = 0.0
        return logits

    def prefill(self, aux, next_tokens, positions):
        self.rows.append((aux.clone(), next_tokens.clone(), positions.clone()))
        p, _ = super().prefill(aux, next_tokens, positions)
        return p, self._scripted(positions.tolist())

    def step(self, prev_prenorm, token, position):
        p, _ = super().step(prev_prenorm, token, position)
        return p, self._scripted([int(position)])[0]


def expected_counts(prompt_len: int, n_new: int, wrong: set[int], k: int):
    """The decoding rule by hand: drafts d_1..d_K of a round after committed index c guess
    indices c+1..c+K; a round accepts the leading correct ones and emits them + the bonus."""
    c, rounds, emitted, reached, accepted = prompt_len, 0, 0, [0] * k, [0] * k
    lengths, log = set(), []
    end = prompt_len + n_new - 1                                         # last generated index
    while c < end:
        n = 0
        while n < k and c + 1 + n not in wrong:
            n += 1
        lengths.add(n)
        for j in range(min(n + 1, k)):
            reached[j] += 1
            accepted[j] += j < n
        rounds += 1
        emitted += min(n + 1, end - c)
        log.append((c, n, min(n + 1, end - c)))
        c += n + 1
    return rounds, emitted, reached, accepted, lengths, log


@pytest.mark.parametrize("pattern", ["perfect", "mixed"])
def test_scripted_drafter_exact_acceptance(tiny, random_export, pattern):
    model, tok, prompts = tiny
    prompt, n_new = prompts[2], 20
    emb = model.get_input_embeddings().weight.detach()
    cfg = json.loads((random_export / "config.json").read_text())
    plain = TargetRunner(model)
    ref = greedy_decode(plain, prompt, max_new_tokens=n_new + K + 2, stop_ids=set()).tokens
    truth = prompt + ref
    P = len(prompt)
    # mixed: misses chosen so that rounds accept 0, 1, 2 and 3 drafts
    wrong = set() if pattern == "perfect" else {P + 1, P + 3, P + 4, P + 9, P + 11, P + 12, P + 15}
    tensors = TensorDir(random_export).load_all()
    drafter = ScriptedDrafter.from_tensors(cfg, tensors, emb, dtype=torch.float32)
    drafter.truth, drafter.wrong, drafter.rows = truth, wrong, []
    aux_ids = drafter_aux_layer_ids(cfg, 8)
    verifier = TargetRunner(model, aux_ids)
    res = speculative_decode(verifier, drafter, prompt, k=K, max_new_tokens=n_new, stop_ids=set())
    assert res.tokens == ref[:n_new]
    rounds, emitted, reached, accepted, lengths, log = expected_counts(P, n_new, wrong, K)
    assert (res.rounds, res.decode_tokens, res.reached, res.accepted) == \
        (rounds, emitted, reached, accepted)
    assert res.round_log == log
    assert res.target_forwards == rounds + 1
    assert lengths == ({K} if pattern == "perfect" else {0, 1, 2, 3})
    out = summarize([("p", res, res)], K)
    # τ as vLLM and SGLang count it: 1 + accepted drafts per round. perfect: the last round is
    # cut by the token cap (it accepts 3 drafts, but only 3 of its 4 tokens fit), so the
    # emitted-tokens figure is lower by exactly 1 token / rounds; mixed: the cap falls on a
    # round's end, and the two agree
    cut = sum(n + 1 - out_ for _, n, out_ in log)
    assert cut == log[-1][1] + 1 - log[-1][2] == (1 if pattern == "perfect" else 0)
    assert out["tau"] == 1 + sum(accepted) / rounds == 1 + out["mean_accepted_drafts"]
    assert out["tau_emitted"] == emitted / rounds
    assert out["tau"] - out["tau_emitted"] == pytest.approx(cut / rounds, abs=1e-12)
    if pattern == "perfect":
        assert (rounds, sum(accepted), emitted) == (5, 15, 19)
        assert (out["tau"], out["tau_emitted"]) == (4.0, 3.8)
    # by context: rounds bucketed by their chain start c - 1 (c: the verified position), split
    # at P+8
    by = summarize([("p", res, res)], K, context_buckets=(0, P + 8))["by_context"]
    for b, part in zip(by, ([r for r in log if r[0] - 1 < P + 8],
                            [r for r in log if r[0] - 1 >= P + 8])):
        assert b["rounds"] == len(part) and b["tokens"] == sum(r[2] for r in part)
        assert b["tau"] == 1 + sum(r[1] for r in part) / len(part)
        assert b["cond_acc"] == [sum(r[1] > j for r in part) / sum(r[1] >= j for r in part)
                                 for j in range(K)]
    assert (by[0]["lo"], by[0]["hi"], by[1]["hi"]) == (0, P + 8, None)
    assert [out[f"cond_acc_{j}"] for j in range(K)] == [a / r for a, r in zip(accepted, reached)]
    assert [out[f"alive_{j}"] for j in range(K)] == [a / rounds for a in accepted]
    # rounds accepting exactly n drafts: reached n, did not accept draft n (all K: accepted K-1)
    assert out["accepted_drafts_histogram"] == \
        [r - a for r, a in zip(reached, accepted)] + [accepted[-1]]

    # the drafter saw every verified position exactly once, in order, paired with token i+1,
    # with the target's aux states at i (compared with one full forward of the final text)
    aux = torch.cat([r[0] for r in drafter.rows])
    nxt = torch.cat([r[1] for r in drafter.rows])
    pos = torch.cat([r[2] for r in drafter.rows])
    L = pos.numel()
    assert torch.equal(pos, torch.arange(L))
    assert drafter.cache_len == L
    seq = torch.tensor(truth[:L + 1])
    assert torch.equal(nxt, seq[1:])
    with torch.no_grad():
        hs = model(seq[None], output_hidden_states=True).hidden_states
    full = torch.cat([hs[a][0, :L] for a in aux_ids], dim=-1)
    torch.testing.assert_close(aux, full, rtol=1e-4, atol=1e-4)
    verifier.close()


def test_bf16_divergence_is_reported_with_its_logit_gap(random_export):
    """bf16: one-token and multi-token forwards may round differently. Any divergence must be
    reported with the target's top-2 logit gap at that step, and only a near-tie may flip."""
    model, tok = load_target("tiny-llama", dtype=torch.bfloat16)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False))
               for q in QUESTIONS[:2]]
    engine, cfg = load_engine_drafter(random_export, model.get_input_embeddings().weight.detach(),
                                      dtype=torch.bfloat16)
    res = run_prompts(model, engine, cfg, prompts, k=K, max_new_tokens=10,
                      stop_ids=set(), progress=False)
    assert res["tokens_identical"] == (not res["mismatches"])
    for m in res["mismatches"]:
        assert m["target_top2_logit_gap"] < 0.1, m      # bf16 logits of magnitude ~1-10


def test_engine_loading_errors_name_the_directory(tiny, random_export, tmp_path):
    model, _, _ = tiny
    emb = model.get_input_embeddings().weight.detach()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_engine_drafter(tmp_path, emb)
    (tmp_path / "config.json").write_text((random_export / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_engine_drafter(tmp_path, emb)
    with pytest.raises(ValueError, match=str(random_export)):
        load_engine_drafter(random_export, emb[:, :32])              # wrong target width
    runner = TargetRunner(model, [2, 4, 5])
    with pytest.raises(ValueError, match="k .* must be >= 1"):
        speculative_decode(runner, None, [1, 2], k=0, max_new_tokens=4, stop_ids=set())
    with pytest.raises(ValueError, match="empty prompt"):
        speculative_decode(runner, None, [], k=2, max_new_tokens=4, stop_ids=set())
    runner.close()


def test_mla_moe_target_is_token_identical(tmp_path):
    """The DeepSeek-V3 architecture (MLA attention, MoE layers): same loop, same identity."""
    model, tok = load_target("tiny-deepseek-v3", dtype=torch.float32)
    tcfg = model.config.to_dict()
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=4096,
                                   aux_layer_ids=default_aux_layer_ids(8))
    torch.manual_seed(1)
    d = Eagle3Drafter(cfg, attention="eager")
    d2t = torch.sort(torch.randperm(cfg.vocab_size)[:4096]).values - torch.arange(4096)
    d.set_vocab_map(d2t)
    out = export_drafter(d.state_dict(), cfg, d2t, None, tmp_path / "ds", target_config=tcfg)
    engine, dcfg = load_engine_drafter(out, model.get_input_embeddings().weight.detach(),
                                       dtype=torch.float32)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False))
               for q in QUESTIONS[:2]]
    res = run_prompts(model, engine, dcfg, prompts, k=K, max_new_tokens=10,
                      stop_ids=stop_token_ids(model, tok), progress=False)
    assert res["tokens_identical"], res["mismatches"]
    assert res["target_forwards"] == res["decode_rounds"] + 2


@pytest.mark.gpu
def test_drafter_on_the_gpu_matches_the_cpu_and_decodes_token_identically(tiny, random_export):
    """The engine reference on CUDA: the same step-0 logits and greedy chains as on the CPU
    (fp32 math, float noise only), and real decoding with target and drafter on the GPU
    stays token-identical to target-only greedy."""
    model, tok, prompts = tiny
    emb = model.get_input_embeddings().weight.detach()
    cpu, cfg = load_engine_drafter(random_export, emb, dtype=torch.float32)
    gpu, _ = load_engine_drafter(random_export, emb.cuda(), dtype=torch.float32, device="cuda")
    assert gpu.w["fc.weight"].is_cuda and gpu.k_cache.is_cuda
    torch.manual_seed(1)
    n, width = 9, 3 * model.config.hidden_size
    aux, nxt = torch.randn(n, width), torch.randint(0, cfg["vocab_size"], (n,))
    pos = torch.arange(n)
    (p_c, l_c), (p_g, l_g) = cpu.prefill(aux, nxt, pos), gpu.prefill(aux, nxt, pos)
    assert l_g.is_cuda
    torch.testing.assert_close(p_g.cpu(), p_c, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(l_g.cpu(), l_c, rtol=1e-4, atol=1e-4)
    chain_c = cpu.greedy_chain(p_c[-1], l_c[-1], n - 1, K)
    chain_g = gpu.greedy_chain(p_g[-1], l_g[-1], n - 1, K)
    assert chain_g.device.type == "cpu" and chain_g.tolist() == chain_c.tolist()
    assert gpu.cache_len == n                                   # draft entries rolled back
    model = model.cuda()
    try:
        emb = model.get_input_embeddings().weight.detach()
        engine, cfg = load_engine_drafter(random_export, emb, dtype=torch.float32, device="cuda")
        res = run_prompts(model, engine, cfg, prompts, k=K, max_new_tokens=12,
                          stop_ids=stop_token_ids(model, tok))
    finally:
        model.cpu()
    assert res["tokens_identical"], res["mismatches"]
    assert res["drafter_forwards"] == K * res["decode_rounds"]


def test_prompt_file_errors_name_the_line(tmp_path, tiny):
    """A malformed prompts record names file:line; a record with nothing to answer names its id;
    records past the first N are not read."""
    from eyas.train.evaluate.offline import load_prompts
    bad = tmp_path / "p.jsonl"
    bad.write_text('\n{"messages": 3}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: "):
        load_prompts(bad, tokenizer=None)
    bad.write_text('{"messages": [{"role": "assistant", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match=r"record 'p\.jsonl:1' has no user"):
        load_prompts(bad, tokenizer=None)
    bad.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
                   '{"messages": 3}\n')
    assert [i for i, _ in load_prompts(bad, tiny[1], num_prompts=1)] == ["a"]
