"""data.synthesize: user prompts sampled from the target (SmolLM2 on the CPU, fp32)."""

import json

import pytest
import torch

from eyas.data.synthesize import (_fold, prompt_openers, prompt_texts, synthesize_prompts,
                             user_turn_prefix)
from eyas.data.targets import load_target

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


def test_openers_are_leading_words_with_repeats_kept():
    texts = ["Why do cats purr?", "Why do we dream?", "Hello", "Write a poem", "Hi there"]
    assert prompt_openers(texts, 2) == ["Why do", "Why do", "Write a"]
    assert prompt_openers(texts, 1) == ["Why", "Why", "Write", "Hi"]
    with pytest.raises(ValueError, match="more than 5 words"):
        prompt_openers(texts, 5)


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
