"""Offline τ vs real speculative decoding on SmolLM2-135M-Instruct (fp32): same text, same drafter.

Pipeline, with eyas' own parts end to end:
  1. the target answers held-out prompts greedily (train.evaluate.specdec.greedy_decode);
  2. prompt + answer become a token dataset, and `data.produce.extract.extract` (the training capture
     path) turns it into a hidden-state dataset (aux bf16, target argmax);
  3. a drafter with real, nontrivial acceptance: random layout-A layers (bf16 values) whose
     lm_head is fitted by least squares on the TTT features of these rows, each labelled with
     the target's token (3 of 4 rows) or a wrong one (1 of 4), so every chain length occurs;
  4. it is exported (layout A) and evaluated twice: `offline_eval` on the hidden-state dataset
     (imported into the training module, TTT forward) and real decoding (`speculative_decode`,
     drafter loaded like vLLM into the engine reference, target verifying K drafts per round).

What must agree, and why they may differ:
  * the speculative output is token-identical to target-only greedy decoding (fp32);
  * τ is counted as vLLM and SGLang count their mean acceptance length, 1 + accepted drafts per
    verification round, in real decoding (`tau`) and in the offline decoder walk over each
    answer (`tau_trajectory`). With the verifier's aux states rounded to bf16, as the dataset
    stores them, both see the same inputs up to float noise, and they are asserted EXACTLY
    equal: the same rounds, at the same positions, accepting the same drafts. The one place the
    text bounds the walk is a request's last round: the stored argmax of the answer's last
    token verifies one draft past the answer, while live decoding verifies all K against the
    target's continuation, so the walk counts min(n, emitted + 1) of that round's n drafts;
    the test counts that cap on the real side too;
  * with the fp32 aux states live decoding feeds in serving, a near-tie of the fitted head can
    flip a draft: there the two agree within TRAJ_TOL (relative);
  * the emitted-tokens figure `tau_emitted` is lower by the tokens the token cap cut;
  * `tau` (mean over EVERY start position, what the trainer logs) is a different average: a
    decoder visits only the positions right after each accepted chain, so its R rounds are a
    sample of the starts (fewer of them inside well-predicted stretches when acceptance varies
    along the text). With R ~ 40 rounds here that sampling error dominates: the test allows
    ALL_SE standard errors of the real per-round length (std(L+1) / sqrt(R)).
"""

import pytest
import torch

from eyas.data.store.dataset import open_dataset
from eyas.data.produce.extract import extract
from eyas.data.store.loader import PackedLoader
from eyas.data.produce.prompts import prompts_path
from eyas.data.store.shards import write_manifest, write_shard
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.export import export_drafter
from eyas.models.objective import metric_mask
from eyas.train.evaluate.specdec import (TargetRunner, drafter_aux_layer_ids, greedy_decode,
                            load_engine_drafter, speculative_decode, stop_token_ids)
from eyas.data.common.targets import default_aux_layer_ids, load_target
from eyas.models.serving.importer import load_training_drafter
from eyas.train.evaluate.offline import load_prompts, offline_eval
from eyas.train.evaluate.sampled import offline_sampling_eval

N_PROMPTS, N_NEW, K, VD = 4, 20, 3, 512
N_CAP = 11                      # real decoding's max_new_tokens for the capped walk
TRAJ_TOL = 0.05
ALL_SE = 3.0

pytestmark = pytest.mark.usefixtures("one_thread")


def _fitted_drafter(model, ds, seed=0, ridge=0.1):
    """Random drafter layers (bf16 values) + an lm_head fitted by ridge regression on the TTT
    features of the dataset's assistant rows: 3/4 labelled with the target's token, 1/4 wrong."""
    g = torch.Generator().manual_seed(seed)
    tcfg = model.config.to_dict()
    loader = PackedLoader(ds, int(ds.sample_lengths.sum()), 0, 1, seed=0, shuffle=False,
                          num_workers=0)
    (batch,) = list(loader)
    V = tcfg["vocab_size"]
    seen = torch.unique(torch.cat([batch.input_ids, batch.target_argmax]))   # sorted
    extra = torch.randperm(V, generator=g)
    extra = extra[~torch.isin(extra, seen)][:VD - len(seen)]
    ids = torch.sort(torch.cat([seen, extra])).values                         # [VD] target ids
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=VD,
                                   aux_layer_ids=default_aux_layer_ids(tcfg["num_hidden_layers"]))
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg, attention="eager")
    d.load_target_embedding(model.get_input_embeddings().weight.detach().float())
    d.set_vocab_map(ids - torch.arange(VD))
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p.bfloat16().float())
        out = d(batch.input_ids, batch.aux, batch.doc_ids, batch.positions, K)
    mask = metric_mask(out.valid, batch.loss_mask)                      # [K, T]
    X = out.hidden[mask].double()                                       # [N, H] normed features
    to_draft = torch.full((V,), -1, dtype=torch.long)
    to_draft[ids] = torch.arange(VD)
    wanted = torch.stack([torch.cat([batch.target_argmax[1 + k:],
                                     torch.zeros(1 + k, dtype=torch.long)]) for k in range(K)])
    label = to_draft[wanted[mask]]                                      # [N] draft ids
    assert bool((label >= 0).all())
    wrong = torch.rand(label.shape, generator=g) < 0.25
    label = torch.where(wrong, (label + 1) % VD, label)
    Y = torch.nn.functional.one_hot(label, VD).double()                 # [N, Vd]
    W = torch.linalg.solve(X.T @ X + ridge * torch.eye(X.shape[1], dtype=X.dtype), X.T @ Y).T
    state = d.state_dict()
    state["lm_head.weight"] = (4.0 * W).float()                         # margins ~4 >> bf16 noise
    return state, cfg


@pytest.fixture(scope="module")
def smol_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree")
    model, tok = load_target("smollm2", dtype=torch.float32)
    prompts = [p for _, p in load_prompts(prompts_path("heldout"), tok, num_prompts=N_PROMPTS)]
    stop = stop_token_ids(model, tok)
    plain = TargetRunner(model)
    answers = [greedy_decode(plain, p, max_new_tokens=N_NEW, stop_ids=stop).tokens
               for p in prompts]
    samples = [{"input_ids": torch.tensor(p + a),
                "loss_mask": torch.tensor([False] * len(p) + [True] * len(a))}
               for p, a in zip(prompts, answers)]
    write_manifest(root / "tokens", {"kind": "tokens"}, [write_shard(root / "tokens", 0, samples)])
    extract(root / "tokens", "smollm2", root / "hidden", model=model)
    ds = open_dataset(root / "hidden")
    state, cfg = _fitted_drafter(model, ds)
    export = export_drafter(state, cfg, None, None, root / "drafter",
                            target_config=model.config.to_dict())
    return model, tok, prompts, answers, stop, root, export


class Bf16AuxRunner(TargetRunner):
    """The verifier with its aux states rounded to bf16, the precision the dataset stores."""

    def forward(self, tokens, *, last_only=False, all_logits=False):
        arg, aux, logits = super().forward(tokens, last_only=last_only, all_logits=all_logits)
        return arg, None if aux is None else aux.bfloat16().float(), logits


def _real(model, engine, cfg, prompts, answers, stop, runner=TargetRunner, max_new=N_NEW):
    """Real decoding of every prompt (at most `max_new` tokens): (rounds, accepted drafts,
    accepted drafts the stored answers can verify, emitted tokens, histogram, per-prompt round
    logs)."""
    verifier = runner(model, drafter_aux_layer_ids(cfg, model.config.num_hidden_layers))
    rounds = emitted = accepted = walkable = 0
    hist, logs = [0] * (K + 1), []
    try:
        for p, a in zip(prompts, answers):
            res = speculative_decode(verifier, engine, p, k=K, max_new_tokens=max_new,
                                     stop_ids=stop)
            assert res.tokens == a[:max_new]                 # token-identical to greedy
            rounds += res.rounds
            emitted += res.decode_tokens
            accepted += sum(res.accepted)
            # what the text can verify: every draft, but in the last round at most one past the
            # stored answer's end (emitted + 1 where the answer ends with this decoding)
            *body, (_, n_last, out_last) = res.round_log
            left = len(a) - (len(res.tokens) - out_last)     # answer tokens from that round on
            walkable += sum(n for _, n, _ in body) + min(n_last, left + 1)
            hist = [a + b for a, b in zip(hist, res.histogram)]
            logs.append(res.round_log)
    finally:
        verifier.close()
    return rounds, accepted, walkable, emitted, hist, logs


@pytest.mark.slow
def test_offline_tau_agrees_with_real_decoding(smol_case):
    model, tok, prompts, answers, stop, root, export = smol_case
    off = offline_eval(export, root / "hidden", k=K, token_budget=1024, walk_cap=N_CAP)
    emb = model.get_input_embeddings().weight.detach()
    engine, cfg = load_engine_drafter(export, emb, dtype=torch.float32)

    rounds, accepted, walkable, emitted, hist, logs = _real(model, engine, cfg, prompts, answers,
                                                           stop, Bf16AuxRunner)
    real = 1 + accepted / rounds                             # vLLM's / SGLang's definition
    assert real > 1.8 and all(h > 0 for h in hist), hist    # every chain length 0..K occurred
    assert (off["counts"]["traj_rounds"][-1], off["counts"]["traj_accepted"][-1]) == \
        (rounds, walkable)
    assert off["tau_trajectory"] == 1 + walkable / rounds
    assert real - off["tau_trajectory"] == pytest.approx((accepted - walkable) / rounds)
    assert emitted / rounds <= off["tau_trajectory"]         # emitted: the cap cuts last rounds
    # the offline context buckets split the same counts (all answers start below 2k tokens)
    assert off["by_context"][0]["rounds"] == off["chain_starts"]
    assert off["by_context"][0]["tau"] == off["tau"]

    # the walk within each answer's first N_CAP tokens is real decoding with N_CAP new tokens
    assert max(map(len, answers)) > N_CAP
    rounds_c, _, walkable_c = _real(model, engine, cfg, prompts, answers, stop, Bf16AuxRunner,
                                    max_new=N_CAP)[:3]
    assert (off["counts"]["traj_cap_rounds"][-1], off["counts"]["traj_cap_accepted"][-1]) == \
        (rounds_c, walkable_c)
    assert off["tau_trajectory_capped"] == 1 + walkable_c / rounds_c

    # serving numerics (fp32 aux): the same text, within TRAJ_TOL
    rounds32, accepted32 = _real(model, engine, cfg, prompts, answers, stop)[:2]
    assert off["tau_trajectory"] == pytest.approx(1 + accepted32 / rounds32, rel=TRAJ_TOL)

    lengths = torch.repeat_interleave(torch.arange(1, K + 2).double(), torch.tensor(hist))
    se = float(lengths.std()) / rounds ** 0.5
    assert abs(off["tau"] - real) <= ALL_SE * se, (off["tau"], real, se)
    assert off["tau_by_k"][-1] == off["tau"] and len(off["tau_by_k"]) == K
    assert 1.0 <= off["tau_by_k"][0] <= off["tau_by_k"][1] <= off["tau_by_k"][2]


@pytest.mark.slow
def test_offline_walk_at_temperature_reproduces_real_sampling(smol_case, tmp_path):
    """At T > 0 with argmax drafts a draft is accepted exactly when the target's sample equals
    it (models/expected_tau.py), so the walk over the text real decoding SAMPLED counts the same
    rounds and the same accepted drafts (the text bounds the last round at what it emitted)."""
    model, tok, prompts, _, stop, root, export = smol_case
    temp = 0.3                  # the fitted head knows the greedy text: stay near it
    emb = model.get_input_embeddings().weight.detach()
    engine, cfg = load_engine_drafter(export, emb, dtype=torch.float32)
    verifier = Bf16AuxRunner(model, drafter_aux_layer_ids(cfg, model.config.num_hidden_layers))
    rounds = accepted = walkable = 0
    samples = []
    try:
        for i, p in enumerate(prompts):
            res = speculative_decode(verifier, engine, p, k=K, max_new_tokens=N_NEW,
                                     stop_ids=stop, temperature=temp, draft="argmax",
                                     generator=torch.Generator().manual_seed(10 + i))
            rounds += res.rounds
            accepted += sum(res.accepted)
            *body, (_, n_last, out_last) = res.round_log
            walkable += sum(n for _, n, _ in body) + min(n_last, out_last)
            samples.append({"input_ids": torch.tensor(p + res.tokens),
                            "loss_mask": torch.tensor([False] * len(p) + [True] * len(res.tokens))})
    finally:
        verifier.close()
    assert 1.2 < 1 + accepted / rounds, (accepted, rounds)        # drafts do get accepted
    write_manifest(tmp_path / "tokens", {"kind": "tokens"}, [write_shard(tmp_path / "tokens", 0,
                                                                         samples)])
    extract(tmp_path / "tokens", "smollm2", tmp_path / "hidden", model=model)
    drafter = load_training_drafter(export, "smollm2", attention="eager")
    off = offline_sampling_eval(drafter, tmp_path / "hidden", k=K, temperature=temp,
                                draft="argmax", token_budget=1024,
                                head=model.get_output_embeddings().weight.detach())
    assert off["tau_trajectory"] == pytest.approx(1 + walkable / rounds, abs=1e-12)
    assert off["tau_trajectory_se"] > 0
