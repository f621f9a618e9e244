"""data.produce.generate: answering prompts with the target, multi-turn order, batching, resume."""

import json
import logging

import pytest
import torch

from eyas.data.produce.generate import generate_conversations
from eyas.data.produce.prepare import PrepareError, prepare
from eyas.data.produce.records import scan_written
from eyas.data.store.shards import open_dataset
from eyas.data.common.targets import load_target

PROMPTS = [
    {"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "b", "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Name a color."},
                             {"role": "user", "content": "Now name another one."}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Say hi."}]},
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny-llama")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def gen(tmp_path, tiny, out, **kw):
    model, tok = tiny
    src = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    kw = {"max_new_tokens": 4, "batch_size": 1, **kw}
    return generate_conversations(src, "tiny-llama", out, model=model, tokenizer=tok, **kw)


def test_every_user_turn_answered_in_order(tmp_path, tiny):
    out = gen(tmp_path, tiny, tmp_path / "conv.jsonl", batch_size=2)
    recs = {r["id"]: r for r in lines(out)}
    assert sorted(recs) == ["a", "b", "c"]
    roles = [m["role"] for m in recs["b"]["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert recs["b"]["messages"][3]["content"] == "Now name another one."
    assert len(recs["b"]["generation"]["finish_reason"]) == 2
    assert recs["c"]["messages"][0] == {"role": "user", "content": "Say hi."}
    for r in recs.values():
        assert all(m["content"] for m in r["messages"] if m["role"] == "assistant")
        assert r["generation"]["max_new_tokens"] == 4


def test_progress_is_logged_per_generate_call_with_turns_of_the_total(tmp_path, tiny, caplog,
                                                                        monkeypatch):
    monkeypatch.setattr("eyas.data.common.utils.PROGRESS_LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="eyas.data.produce.generate"):
        gen(tmp_path, tiny, tmp_path / "conv.jsonl", batch_size=2)
    done = [m.split(" turns")[0].split(": ")[1] for m in caplog.messages
            if m.startswith("generate: ")]
    # round 1 answers the first turn of a, b, c in two calls (2 + 1), round 2 b's second turn
    assert done == ["2/4", "3/4", "4/4"]


def test_progress_counts_the_turns_an_empty_answer_drops(tmp_path, tiny, caplog, monkeypatch):
    """Every token stops generation, so every answer is empty: b's second turn is never asked,
    and the last line says so and has nothing left to wait for."""
    monkeypatch.setattr("eyas.data.common.utils.PROGRESS_LOG_EVERY_S", 0.0)
    vocab = tiny[0].config.vocab_size
    monkeypatch.setattr("eyas.data.produce.generate._stop_ids", lambda model, tok: list(range(vocab)))
    with caplog.at_level(logging.INFO, logger="eyas.data.produce.generate"):
        out = gen(tmp_path, tiny, tmp_path / "conv.jsonl", batch_size=3)
    progress = [m for m in caplog.messages if m.startswith("generate: ")]
    assert len(progress) == 1 and progress[0].startswith("generate: 3/4 turns answered (1 dropped)")
    assert progress[0].endswith("about 0 s left")
    assert lines(out) == []                         # no record is written with an empty answer


@pytest.mark.parametrize("counts, left", [(dict(stop=2, new_tokens=9), 30),
                                           (dict(stop=2, new_tokens=9, turns_dropped=1), 15),
                                           (dict(stop=3, new_tokens=9, turns_dropped=1), 0)])
def test_time_left_leaves_out_the_dropped_turns(monkeypatch, caplog, counts, left):
    """Of 4 turns, 2 answered in 30 s: 2 left take 30 s; with 1 of them dropped, 15 s."""
    from collections import Counter

    from eyas.data.produce import generate
    now = [0.0]
    monkeypatch.setattr(generate.time, "perf_counter", lambda: now[0])
    progress = generate._Progress(4, Counter(counts))
    now[0] = 30.0
    with caplog.at_level(logging.INFO, logger="eyas.data.produce.generate"):
        progress()
    assert caplog.messages[-1].endswith(f"about {left} s left")


def test_resume_skips_done_ids_and_discards_partial_line(tmp_path, tiny, caplog):
    ref = lines(gen(tmp_path, tiny, tmp_path / "ref.jsonl"))
    out = tmp_path / "crashed.jsonl"
    kept = dict(ref[0], messages=ref[0]["messages"][:1] + [{"role": "assistant",
                                                            "content": "KEPT"}])
    partial = json.dumps(ref[1])[:40]                     # a crash in the middle of line 2
    out.write_text(json.dumps(kept) + "\n" + partial)
    with caplog.at_level(logging.WARNING, logger="eyas.data.produce.generate"):
        gen(tmp_path, tiny, out)
    assert "discarding a partial last line" in caplog.text
    got = lines(out)
    assert [r["id"] for r in got] == ["a", "b", "c"]
    assert got[0]["messages"][1]["content"] == "KEPT"     # not regenerated
    assert got[1:] == ref[1:]                             # greedy: same answers as a clean run
    assert set(scan_written(out)) == {"a", "b", "c"}
    gen(tmp_path, tiny, out)                              # nothing left: file unchanged
    assert lines(out) == got


def test_corrupt_middle_line_is_an_error(tmp_path, tiny):
    out = tmp_path / "bad.jsonl"
    out.write_text('{"id": "a", "messages": []}\nnot json\n{"id": "b", "messages": []}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: corrupt line"):
        gen(tmp_path, tiny, out)


def test_bad_prompt_records(tmp_path, tiny):
    model, tok = tiny
    src = write_jsonl(tmp_path / "p.jsonl", [PROMPTS[0], PROMPTS[0],
                                             {"id": "z", "messages": [
                                                 {"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Yo"}]}])
    with pytest.raises(PrepareError, match=r"p\.jsonl:2: duplicate_id"):
        generate_conversations(src, "tiny-llama", tmp_path / "o.jsonl", model=model,
                               tokenizer=tok, max_new_tokens=2)
    out = generate_conversations(src, "tiny-llama", tmp_path / "o.jsonl", model=model,
                                 tokenizer=tok, max_new_tokens=2, on_error="skip")
    assert [r["id"] for r in lines(out)] == ["a"]


def test_prepare_generate_end_to_end(tmp_path, tiny):
    model, tok = tiny
    src = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    summary = prepare(src, "tiny-llama", tmp_path / "ds", tokenizer=tok, generate=True,
                      generate_kwargs={"model": model, "tokenizer": tok, "max_new_tokens": 3})
    assert (tmp_path / "ds" / "generated.jsonl").exists()
    ds = open_dataset(tmp_path / "ds")
    assert len(ds) == 3 and summary["conversations"] == 3
    # b: two generated turns, both trained (SmolLM2 template re-renders history unchanged)
    assert int((ds[1]["loss_mask"][1:].int() - ds[1]["loss_mask"][:-1].int() == 1).sum()) == 2
    # how the answers were sampled travels into the manifest (greedy here)
    assert summary["answer_sampling"] == [{"temperature": 0.0, "top_p": 1.0, "records": 3}]
    assert ds.manifest["prepare"]["answer_sampling"] == summary["answer_sampling"]


def test_answer_sampling_of_mixed_records(tmp_path):
    """Records answered at different settings are counted per setting; others not at all."""
    from eyas.data.common.targets import load_tokenizer
    recs = [{"id": str(i), "messages": [{"role": "user", "content": "Hi."},
                                        {"role": "assistant", "content": "Hello."}],
             **({"generation": {"temperature": t, "top_p": 0.9}} if t is not None else {})}
            for i, t in enumerate([0.7, 0.7, 1.0, None])]
    summary = prepare(write_jsonl(tmp_path / "in.jsonl", recs), "tiny-llama", tmp_path / "ds",
                      tokenizer=load_tokenizer("tiny-llama"))
    assert summary["answer_sampling"] == [{"temperature": 0.7, "top_p": 0.9, "records": 2},
                                          {"temperature": 1.0, "top_p": 0.9, "records": 1}]


def test_left_padded_batches_match_single_prompts_on_smollm2(tmp_path):
    model, tok = load_target("smollm2", dtype=torch.float32)   # what generation uses on a CPU
    recs = [PROMPTS[0], {"id": "d", "messages": [
        {"role": "user", "content": "What is the capital of France? Answer in one short "
                                    "sentence, please, and nothing else."}]}]
    src = write_jsonl(tmp_path / "p.jsonl", recs)
    kw = dict(model=model, tokenizer=tok, max_new_tokens=7)
    batched = lines(generate_conversations(src, "smollm2", tmp_path / "b.jsonl", batch_size=2,
                                           **kw))
    single = lines(generate_conversations(src, "smollm2", tmp_path / "s.jsonl", batch_size=1,
                                          **kw))
    assert "Paris" in batched[0]["messages"][-1]["content"]
    assert [r["messages"] for r in batched] == [r["messages"] for r in single]


def test_static_cache_answers_match_the_dynamic_ones_on_smollm2(tmp_path, monkeypatch):
    """The static cache pads each batch to batch_size rows and its prompts to a multiple of 64
    tokens; the answers are the dynamic cache's, and the padding rows are not written."""
    model, tok = load_target("smollm2", dtype=torch.float32)
    recs = [PROMPTS[0], PROMPTS[2], {"id": "d", "messages": [
        {"role": "user", "content": "Name three primary colors, separated by commas."}]}]
    src = write_jsonl(tmp_path / "p.jsonl", recs)
    calls, generate = [], model.generate

    def recording(**kw):            # the real generate, its inputs noted
        calls.append((tuple(kw["input_ids"].shape), kw.get("cache_implementation")))
        return generate(**kw)

    monkeypatch.setattr(model, "generate", recording)
    kw = dict(model=model, tokenizer=tok, max_new_tokens=6, batch_size=2)
    dynamic = lines(generate_conversations(src, "smollm2", tmp_path / "d.jsonl", **kw))
    assert [c[1] for c in calls] == [None, None] and calls[1][0][0] == 1   # 2 + 1 rows
    calls.clear()
    static = lines(generate_conversations(src, "smollm2", tmp_path / "s.jsonl", cache="static",
                                          **kw))
    assert calls == [((2, 64), "static"), ((2, 64), "static")]   # padded rows and prompts
    assert [r["id"] for r in static] == ["a", "c", "d"]
    assert [r["messages"] for r in static] == [r["messages"] for r in dynamic]
    with pytest.raises(ValueError, match=r"data.generation_cache='paged'; expected one of"):
        generate_conversations(src, "smollm2", tmp_path / "x.jsonl", cache="paged", **kw)


def test_static_batches_return_one_answer_per_prompt_and_refuse_what_does_not_fit(tiny):
    from eyas.data.produce.generate import _generate_batch
    model, tok = tiny
    kw = dict(stop=[0], max_new_tokens=2, temperature=0.0, top_p=1.0, cache="static")
    assert len(_generate_batch(model, tok, ["a b", "c"], rows=4, prompt_tokens=64, **kw)) == 2
    with pytest.raises(ValueError, match="static cache: 3 prompts for a batch of 2 rows"):
        _generate_batch(model, tok, ["a", "b", "c"], rows=2, prompt_tokens=64, **kw)
    with pytest.raises(ValueError, match=r"a prompt of \d+ tokens does not fit the batch's "
                                         r"padded length of 2"):
        _generate_batch(model, tok, ["a long prompt of several words"], rows=1,
                        prompt_tokens=2, **kw)


def test_new_token_count_includes_the_stop_token_once():
    from eyas.data.produce.generate import _generate_batch

    class Tok:
        padding_side, pad_token_id = "right", 0

        def __call__(self, prompts, **kw):
            ones = torch.ones(len(prompts), 2, dtype=torch.long)
            return {"input_ids": ones, "attention_mask": ones}

        def decode(self, ids, **kw):
            return "".join({5: "a", 6: "b", 10: "\n"}[i] for i in ids)

    class Model:
        device = "cpu"

        def generate(self, input_ids, **kw):   # prompt, then "a", "b", stop 10, padding
            new = torch.tensor([[5, 6, 10, 0, 0], [5, 6, 5, 6, 5]])
            return torch.cat([input_ids, new], 1)

    kw = dict(max_new_tokens=5, temperature=0.0, top_p=1.0)
    got = _generate_batch(Model(), Tok(), ["x", "y"], [2, 10], **kw)
    assert got == [("ab", "stop", 3), ("ababa", "length", 5)]
    got = _generate_batch(Model(), Tok(), ["x", "y"], [2, 10], keep=frozenset({10}), **kw)
    assert got == [("ab\n", "stop", 3), ("ababa", "length", 5)]
