"""data.produce.synthesize: user prompts sampled from the target (SmolLM2 on the CPU, fp32)."""

import json
import logging

import pytest
import torch

import random

from eyas.data.produce.synthesize import (LIST_HEADER, _end_of_line, _fold, example_list, line_break_ids,
                                  prompt_openers, prompt_texts, synthesize_prompts,
                                  user_turn_prefix)
from eyas.data.common.targets import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2", dtype=torch.float32)


def _texts(path):
    return [json.loads(x)["messages"][0]["content"] for x in path.read_text().splitlines()]


def test_prefix_is_the_template_up_to_the_user_content(smollm2):
    _, tok = smollm2
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert full.startswith(prefix + "Hello there")
    assert prefix.endswith("<|im_start|>user\n") and "<|im_start|>system" in prefix


@pytest.mark.slow
def test_distinct_reproducible_prompts_and_exclusion(tmp_path, smollm2):
    model, tok = smollm2
    kw = dict(max_new_tokens=40, batch_size=4, seed=3)
    a = synthesize_prompts(model, tok, 5, tmp_path / "a.jsonl", **kw)
    recs = [json.loads(x) for x in a.read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"synth-{i:06d}" for i in range(5)]
    texts = _texts(a)
    assert all(t and t == t.strip() for t in texts)
    assert len({_fold(t) for t in texts}) == 5
    # the same seed samples the same candidates: all of them are excluded the second time
    b = synthesize_prompts(model, tok, 3, tmp_path / "b.jsonl", exclude=[t.upper() for t in texts],
                           **kw)
    assert not {_fold(t) for t in _texts(b)} & {_fold(t) for t in texts}
    c = synthesize_prompts(model, tok, 5, tmp_path / "c.jsonl", **kw)
    assert c.read_bytes() == a.read_bytes()


def test_progress_lines_count_kept_prompts_and_batches(tmp_path, smollm2, caplog, monkeypatch):
    model, tok = smollm2
    monkeypatch.setattr("eyas.data.common.utils.PROGRESS_LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="eyas.data.produce.synthesize"):
        synthesize_prompts(model, tok, 5, tmp_path / "a.jsonl", max_new_tokens=40, batch_size=4,
                           seed=3)
    lines = [m for m in caplog.messages if m.startswith("synthesize: ")]
    kept = [int(m.split("/")[0].split()[-1]) for m in lines]
    batches = int(caplog.messages[-1].split(" batches")[0].split("(")[-1])
    assert len(lines) == batches and kept == sorted(kept) and kept[-1] == 5
    assert lines[-1].startswith(f"synthesize: 5/5 prompts kept after {batches} batches")


def test_openers_are_leading_words_with_repeats_kept():
    texts = ["Why do cats purr?", "Why do we dream?", "Hello", "Write a poem", "Hi there"]
    assert prompt_openers(texts, 2) == ["Why do", "Why do", "Write a"]
    assert prompt_openers(texts, 1) == ["Why", "Why", "Write", "Hi"]
    with pytest.raises(ValueError, match="more than 5 words"):
        prompt_openers(texts, 5)


@pytest.mark.slow
def test_opened_prompts_start_with_an_opener_and_go_on(tmp_path, smollm2):
    model, tok = smollm2
    openers = ["Why do", "Can you explain", "Write a"]
    kw = dict(max_new_tokens=40, batch_size=4, seed=5, openers=openers)
    a = synthesize_prompts(model, tok, 4, tmp_path / "a.jsonl", **kw)
    texts = _texts(a)
    assert len({_fold(t) for t in texts}) == 4
    for t in texts:
        start = next(o for o in openers if t.startswith(o))
        assert len(t) > len(start) + 1
    assert synthesize_prompts(model, tok, 4, tmp_path / "b.jsonl", **kw).read_bytes() == \
        a.read_bytes()


def test_no_progress_is_an_error_and_writes_nothing(tmp_path, smollm2):
    model, tok = smollm2
    out = tmp_path / "p.jsonl"
    with pytest.raises(RuntimeError, match="gave no new prompt"):
        # one token never ends a turn: every candidate is cut off
        synthesize_prompts(model, tok, 2, out, max_new_tokens=1, batch_size=2, max_rounds=2)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_prompt_texts_reads_user_messages(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "system", "content": "s"},
                                          {"role": "user", "content": "q1"}]}) + "\n\n" +
                 json.dumps({"messages": [{"role": "user", "content": "q2"}]}) + "\n")
    assert prompt_texts(p) == ["q1", "q2"]


EXAMPLES = ["Why do onions make people cry?", "Write a haiku about  rain.",
            "What is the meaning of 'catalyst'?", "How is a comet different from an asteroid?",
            "Explain the phases of the moon\nin simple terms.", "Is a four-day work week a good idea?"]


def test_example_list_numbers_distinct_examples_one_per_line():
    text = example_list(EXAMPLES, 3, random.Random(7))
    assert text.startswith(LIST_HEADER) and text.endswith("\n4.")
    items = text[len(LIST_HEADER):].split("\n")[:-1]
    assert [x.split(". ", 1)[0] for x in items] == ["1", "2", "3"]
    bodies = [x.split(". ", 1)[1] for x in items]
    folded = {" ".join(e.split()) for e in EXAMPLES}       # inner line breaks folded away
    assert len(set(bodies)) == 3 and set(bodies) <= folded
    assert example_list(EXAMPLES, 3, random.Random(7)) == text


def test_a_list_item_ends_at_its_line_break():
    rows = [("abc\ndef", "length", 5), ("xyz", "length", 3), ("q", "stop", 2)]
    assert _end_of_line(rows) == [("abc", "stop", 5), ("xyz", "length", 3), ("q", "stop", 2)]


def test_line_break_ids_are_the_tokens_holding_a_newline(smollm2):
    _, tok = smollm2
    ids = line_break_ids(tok)
    assert all("\n" in tok.decode([i]) for i in ids)
    for text in ("\n", "\n\n", " \n"):     # every token of a bare line break is one of them
        assert all(i in ids for i in tok(text, add_special_tokens=False)["input_ids"])
    assert not set(tok("a b.", add_special_tokens=False)["input_ids"]) & set(ids)


def test_listed_prompts_are_one_line_never_an_example_and_reproducible(tmp_path, smollm2):
    model, tok = smollm2
    kw = dict(max_new_tokens=40, batch_size=4, seed=11, examples=EXAMPLES, shots=3)
    a = synthesize_prompts(model, tok, 4, tmp_path / "a.jsonl", **kw)
    texts = _texts(a)
    assert len({_fold(t) for t in texts}) == 4
    assert all(t and "\n" not in t and t == t.strip() for t in texts)
    assert not {_fold(t) for t in texts} & {_fold(e) for e in EXAMPLES}
    assert synthesize_prompts(model, tok, 4, tmp_path / "b.jsonl", **kw).read_bytes() == \
        a.read_bytes()
    opened = _texts(synthesize_prompts(model, tok, 2, tmp_path / "c.jsonl", openers=["Why do"],
                                       **kw))
    assert all(t.startswith("Why do ") and "\n" not in t for t in opened)


def test_more_shots_than_examples_is_an_error(tmp_path, smollm2):
    model, tok = smollm2
    with pytest.raises(ValueError, match="a list of 7 examples needs 1 <= shots"):
        synthesize_prompts(model, tok, 1, tmp_path / "p.jsonl", examples=EXAMPLES, shots=7)
    assert not (tmp_path / "p.jsonl").exists()
