"""`eyas evaluate --prompts --speedup K,...` without an engine: eyas's own decoding measured at
each K, and predicted from the step costs timed inside it (train/evaluate/decode_sweep.py). Target: the
tiny random Llama preset in fp32; drafter: a random-weight export over the whole vocabulary."""

import json

import pytest
import torch

from eyas.data.common.targets import load_target
from eyas.train.evaluate.specdec import (TargetRunner, greedy_decode, load_engine_drafter,
                                         speculative_decode)
from eyas.train.evaluate.decode_sweep import decode_rates, decode_sweep, rows_from
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "evaluate")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-llama", dtype=torch.float32)


@pytest.fixture(scope="module")
def export(tmp_path_factory, full_vocab_export, target):
    return full_vocab_export(target[0], tmp_path_factory.mktemp("x") / "rand")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "messages": [
        {"role": "user", "content": q}]}) + "\n" for i, q in enumerate(
            ["Hi there", "What is 2+2?", "Name a colour."])))
    return path


def _result(k, alive, *, tokens, decode_tokens, seconds, prefill, base_tokens, base_seconds,
            base_prefill, verify, prompts=2):
    return {"k": k, "num_prompts": prompts, "tau": 1 + sum(alive[:k]), "speedup": 9.0,
            "tau_emitted": 1.0, "step_seconds": {"target": 0.1, "verify": verify, "draft": 0.01},
            **{f"alive_{j}": a for j, a in enumerate(alive[:k])},
            "decode_tokens": decode_tokens, "tokens_generated": tokens, "seconds": seconds,
            "prefill_seconds": prefill, "baseline_tokens_generated": base_tokens,
            "baseline_seconds": base_seconds, "baseline_prefill_seconds": base_prefill,
            "decode_rounds": 10, "tokens_identical": True}


def test_rows_measure_the_decoding_phase_and_predict_from_the_step_costs():
    alive = [0.5, 0.25, 0.125]
    results = {1: _result(1, alive, tokens=40, decode_tokens=38, seconds=2.5, prefill=0.5,
                          base_tokens=40, base_seconds=4.4, base_prefill=0.4, verify=0.12),
               3: _result(3, alive, tokens=40, decode_tokens=38, seconds=1.5, prefill=0.5,
                          base_tokens=40, base_seconds=4.2, base_prefill=0.2, verify=0.15)}
    r1, r3 = rows_from(results)
    # decoding phase: 38 tokens / 2.0 s against 38 / 4.0 s; K 3: 38 / 1.0 against 38 / 4.0
    assert r1["measured"] == pytest.approx(2.0) and r3["measured"] == pytest.approx(4.0)
    assert decode_rates(results[3]) == (pytest.approx(38.0), pytest.approx(9.5))
    # τ(1) = 1.5 and τ(3) = 1.875 from the largest K's alive_j; 1.5·0.1/(0.12+0.01)
    assert r1["predicted"] == pytest.approx(1.5 * 0.1 / 0.13)
    assert r3["predicted"] == pytest.approx(1.875 * 0.1 / (0.15 + 3 * 0.01))
    assert (r1["tau_predicted_from"], r3["concurrency"], r3["measured_end_to_end"]) == \
        (1.5, 1, 9.0)


def test_a_decode_times_its_steps_within_its_decoding_phase(target, export):
    model, _ = target
    drafter, _ = load_engine_drafter(export, model.get_input_embeddings().weight.detach(),
                                     dtype=torch.float32)
    prompt = [5, 17, 99, 3, 42]
    base = greedy_decode(TargetRunner(model), prompt, max_new_tokens=8, stop_ids=set())
    spec = speculative_decode(TargetRunner(model, [2, 4, 5]), drafter, prompt, k=3,
                              max_new_tokens=8, stop_ids=set())
    for d in (base, spec):
        assert 0 < d.prefill_seconds < d.seconds
        assert 0 < d.target_seconds < d.seconds - d.prefill_seconds
    assert base.draft_seconds == 0 and spec.drafter_forwards == 3 * spec.rounds
    assert 0 < spec.draft_seconds < spec.seconds - spec.prefill_seconds - spec.target_seconds


@pytest.mark.slow
def test_the_sweep_decodes_each_k_and_predicts_from_what_it_timed(target, export, prompts_file):
    model, tok = target
    sw = decode_sweep(export, "tiny-llama", prompts_file, ks=[2, 1], num_prompts=None,
                      max_new_tokens=6, model=model, tokenizer=tok)
    rows = sw["rows"]
    assert [r["k"] for r in rows] == [1, 2] and sw["num_prompts"] == 3
    assert sw["hardware"].startswith("CPU: eyas real decoding")
    assert all(r["identical_to_no_speculation"] is True for r in rows)
    assert all(r["tokens"] == 18 for r in rows)      # random tiny target: no stop token early
    for r in rows:
        c = r["step_seconds"]
        assert r["predicted"] == pytest.approx(r["tau_predicted_from"] * c["target"] / (
            c["verify"] + r["k"] * c["draft"]))
        assert r["measured"] == pytest.approx(r["tokens_per_s"]
                                              / r["tokens_per_s_without_speculation"])
        assert all(0 < t < 5 for t in c.values())
    assert rows[1]["tau_predicted_from"] == pytest.approx(rows[1]["tau"])
    assert sw["best_k"] == {"1": max(rows, key=lambda r: r["measured"])["k"]}


@pytest.mark.parametrize("argv,message", [
    (["--concurrency", "4", "--speedup", "1,2"], "one sequence at a time: --concurrency"),
    (["--processes", "2", "--speedup", "1,2"], "leave --processes at 1"),
    (["--concurrency", "4"], "--concurrency goes with --speedup"),
    (["--temperatures", "0,0.5", "--speedup", "1"], "one --temperature"),
])
def test_sweep_options_that_cannot_hold_are_refused(argv, message, capsys, prompts_file):
    with pytest.raises(SystemExit) as e:
        cli_main(["--drafter", "d", "--target", "tiny-llama", "--k", "2", "--prompts",
                  str(prompts_file),
                  *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
