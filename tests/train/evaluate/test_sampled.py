"""The offline expected τ under sampling against real speculative sampling, on the tiny target.

Text: the tiny random Llama (fp32) answers held-out prompts by SAMPLING at temperature T, the
answers are extracted (`data.produce.extract`, the training capture path: aux, last hidden state) and a
drafter over the full vocabulary (random layers: at T = 1 both distributions are broad, so
drafts are accepted often and every chain length occurs) is exported. Then
  * offline: `offline_sampling_eval` (TTT forward over the stored text, β = min(1, q(s)/p(s))
    of each stored token s, p from the stored last state times the target's head);
  * real: `speculative_decode` at T with sampled drafts, several seeds per prompt.
Both are unbiased estimates of the same τ (models/expected_tau.py) from independent samples of
the text, so they must agree within REAL_SE combined standard errors over answers (the real
one over prompt runs, the offline one over the stored answers).
"""

import json

import pytest
import torch

from eyas.data.store.dataset import open_dataset
from eyas.data.produce.extract import extract
from eyas.data.produce.prompts import prompts_path
from eyas.data.store.shards import write_manifest, write_shard
from eyas.data.common.targets import load_embedding_and_head, load_target
from eyas.models.expected_tau import ratio_se_of
from eyas.train.evaluate.specdec import (TargetRunner, drafter_aux_layer_ids, greedy_decode,
                                         load_engine_drafter, speculative_decode)
from eyas.models.serving.importer import load_training_drafter
from eyas.train.evaluate.offline import load_prompts, offline_eval
from eyas.train.evaluate.sampled import answer_temperatures, offline_sampling_eval
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "evaluate")

N_PROMPTS, N_NEW, K, T, SEEDS = 6, 20, 2, 1.0, 3
REAL_SE = 3.0

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sampled_case(tmp_path_factory, full_vocab_export):
    root = tmp_path_factory.mktemp("sampled")
    model, tok = load_target("tiny-llama", dtype=torch.float32)
    prompts = [p for _, p in load_prompts(prompts_path("heldout"), tok, num_prompts=N_PROMPTS)]
    plain = TargetRunner(model)
    answers = [greedy_decode(plain, p, max_new_tokens=N_NEW, stop_ids=set(), temperature=T,
                             generator=torch.Generator().manual_seed(100 + i)).tokens
               for i, p in enumerate(prompts)]
    samples = [{"input_ids": torch.tensor(p + a),
                "loss_mask": torch.tensor([False] * len(p) + [True] * len(a))}
               for p, a in zip(prompts, answers)]
    write_manifest(root / "tokens", {"kind": "tokens"}, [write_shard(root / "tokens", 0, samples)])
    extract(root / "tokens", "tiny-llama", root / "hidden", model=model)
    export = full_vocab_export(model, root / "drafter")
    return model, tok, prompts, root, export


def test_offline_expected_tau_predicts_real_sampling(sampled_case):
    model, _, prompts, root, export = sampled_case
    assert "last" in open_dataset(root / "hidden").fields
    drafter = load_training_drafter(export, "tiny-llama", attention="eager")
    off = offline_sampling_eval(drafter, root / "hidden", k=K, temperature=T, draft="sample",
                                token_budget=1024, head=load_embedding_and_head("tiny-llama")[1])
    assert off["teacher"] == "last" and off["temperature"] == T and len(off["tau_by_k"]) == K

    engine, cfg = load_engine_drafter(export, model.get_input_embeddings().weight.detach(),
                                      dtype=torch.float32)
    verifier = TargetRunner(model, drafter_aux_layer_ids(cfg, model.config.num_hidden_layers))
    hist, per_run = [0] * (K + 1), []
    try:
        for s in range(SEEDS):
            for i, p in enumerate(prompts):
                res = speculative_decode(verifier, engine, p, k=K, max_new_tokens=N_NEW,
                                         stop_ids=set(), temperature=T, draft="sample",
                                         generator=torch.Generator().manual_seed(s * 100 + i))
                hist = [a + b for a, b in zip(hist, res.histogram)]
                per_run.append((sum(res.accepted), res.rounds))
    finally:
        verifier.close()
    real = 1 + sum(a for a, _ in per_run) / sum(r for _, r in per_run)
    real_se = ratio_se_of(per_run)
    assert all(h > 0 for h in hist) and 1.5 < real < K + 1, hist   # a nontrivial acceptance
    se = (real_se ** 2 + off["tau_trajectory_se"] ** 2) ** 0.5
    assert abs(off["tau_trajectory"] - real) <= REAL_SE * se, (off["tau_trajectory"], real, se)
    # the engines' argmax proposal on the same drafter: p(argmax q) ~ 1/V here, so τ ~ 1
    arg = offline_sampling_eval(drafter, root / "hidden", k=K, temperature=T, draft="argmax",
                                token_budget=1024, head=load_embedding_and_head("tiny-llama")[1])
    assert 1.0 <= arg["tau"] < 1.01


def test_topk_teacher_over_every_id_matches_the_last_state(sampled_case, tmp_path):
    """A top-k dataset with k = V, built from the stored last states, gives the same expected τ
    through the top-k branch (the draft vocabulary mapped back through to_draft)."""
    _, _, _, root, export = sampled_case
    src = open_dataset(root / "hidden")
    head = load_embedding_and_head("tiny-llama")[1].float()
    samples = []
    for i in range(2):
        s = src[i]
        vals, ids = (s["last"].float() @ head.T).topk(head.shape[0], dim=-1)
        samples.append({"input_ids": s["input_ids"], "loss_mask": s["loss_mask"], "aux": s["aux"],
                        "target_argmax": s["target_argmax"], "topk_ids": ids, "topk_logits": vals})
    out = tmp_path / "topk"
    write_manifest(out, dict(src.manifest, teacher="topk"), [write_shard(out, 0, samples)])
    drafter = load_training_drafter(export, "tiny-llama", attention="eager")
    kw = dict(k=K, temperature=0.7, draft="sample", token_budget=1024, indices=[0, 1])
    topk = offline_sampling_eval(drafter, out, **kw)
    full = offline_sampling_eval(drafter, root / "hidden", head=head, **kw)
    assert topk["teacher"] == "topk" and full["teacher"] == "last"
    assert topk["tau"] == pytest.approx(full["tau"], rel=1e-5)
    assert topk["tau_trajectory"] == pytest.approx(full["tau_trajectory"], rel=1e-5)


def test_cli_temperatures(sampled_case, tmp_path, capsys):
    _, _, _, root, export = sampled_case
    f = tmp_path / "offline.json"
    assert cli_main(["--drafter", str(export), "--data", str(root / "hidden"), "--k", str(K),
                     "--out", str(f), "--all", "--temperatures", "0,1.0", "--token-budget", "1024",
                     "--draft-sampling", "sample"]) == 0
    res = json.loads(f.read_text())
    rows = res["by_temperature"]
    assert [r["temperature"] for r in rows] == [0.0, 1.0]
    assert all(set(r) == {"temperature", "tau", "tau_se", "offline_tau"} for r in rows)
    assert rows[0]["tau"] == res["tau"] and rows[1]["tau"] > rows[0]["tau"]
    assert rows[0]["offline_tau"] == res["tau_trajectory"]
    assert rows[1]["tau_se"] > 0
    assert "tau_se" in capsys.readouterr().out

    # real decoding with the offline estimate beside it, at each temperature
    f = tmp_path / "real.json"
    args = ["--drafter", str(export), "--target", "tiny-llama", "--prompts",
            str(prompts_path("heldout")), "--k", str(K), "--out", str(f), "--max-new-tokens", "6",
            "--num-prompts", "2", "--draft-sampling", "sample"]
    with pytest.raises(SystemExit) as e:
        cli_main(args + ["--temperatures", "0,-1"])
    assert e.value.code == 2
    assert "error: argument --temperatures: --temperatures '0,-1': expected distinct " \
        "comma-separated numbers >= 0" in capsys.readouterr().err
    assert cli_main(args + ["--temperatures", "1.0,0", "--data", str(root / "hidden"),
                            "--all", "--token-budget", "1024"]) == 0
    res = json.loads(f.read_text())
    assert res["mode"] == "speculative" and res["temperature"] == 1.0
    assert res["tau_se"] >= 0 and res["tokens_identical"] is None      # a sample, not greedy
    assert set(res["offline"]) >= {"tau", "tau_trajectory", "chain_starts"}
    rows = res["by_temperature"]
    assert [r["temperature"] for r in rows] == [1.0, 0.0]
    assert [set(r) for r in rows] == [{"temperature", "tau", "tau_se", "offline_tau"}] * 2
    assert rows[0]["offline_tau"] == res["offline"]["tau_trajectory"] == res["offline_tau"]
    assert "offline_tau (walk)" in capsys.readouterr().out
    # at T = 0 the estimate beside real decoding is the walk within the same 6 tokens
    greedy = offline_eval(export, root / "hidden", k=K, token_budget=1024, walk_cap=6)
    assert greedy["walk_cap"] == 6
    assert rows[1]["offline_tau"] == greedy["tau_trajectory_capped"]
    rounds = greedy["counts"]
    assert 0 < rounds["traj_cap_rounds"][-1] < rounds["traj_rounds"][-1]   # the cap bites


def test_answer_temperatures_warn_on_a_mismatch(caplog):
    def man(*rows):
        return {"prepare": {"answer_sampling": [dict(temperature=t, top_p=p, records=1)
                                                for t, p in rows]}}
    assert answer_temperatures({}, "d", 0.7) is None                   # unknown: no claim
    with caplog.at_level("WARNING"):
        assert answer_temperatures(man((0.7, 1.0)), "d", 0.7) == [0.7]
        assert not caplog.records
        assert answer_temperatures(man((0.0, 1.0), (0.7, 1.0)), "d", 0.7) == [0.0, 0.7]
        assert "sampled at temperature 0/0.7, not at 0.7" in caplog.records[-1].getMessage()
        answer_temperatures(man((0.7, 0.9)), "d", 0.7)
        assert "top_p < 1" in caplog.records[-1].getMessage()
