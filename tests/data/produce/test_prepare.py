"""data.produce.prepare: exact assistant masks under real chat templates, input shapes, bad records.

Every mask check decodes the runs of masked tokens and compares them with the text the model
generates in each assistant turn (content/reasoning/tool call + end-of-turn marker), and checks
that the unmasked tokens decode to the rest of the rendered conversation.
"""

import json

import pytest

from eyas.data.produce.prepare import PrepareError, prepare
from eyas.data.store.shards import open_dataset
from eyas.data.common.templates import available_templates, load_template, template_sha256
from eyas.data.common.targets import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of masked tokens, and of the unmasked remainder."""
    runs, cur, rest = [], [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        else:
            rest.append(t)
            if cur:
                runs.append(tok.decode(cur))
                cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs, tok.decode(ids.tolist())


def run_prepare(tmp_path, tok, records, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    summary = prepare(src, "smollm2", out, tokenizer=tok, **kw)
    return summary, open_dataset(out)


def chat(*turns, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        role = "user" if i % 2 == 0 else "assistant"
        msgs.append(dict(t, role=role) if isinstance(t, dict) else {"role": role, "content": t})
    return {"messages": msgs}


TWO_TURNS = chat("Hi", {"content": "Hello!", "reasoning_content": "User greets."},
                 "2+2?", {"content": "4", "reasoning_content": "Simple sum."}, system="Be brief.")


def test_smollm2_own_template_masks_content_and_end_of_turn(tmp_path, tok):
    summary, ds = run_prepare(tmp_path, tok, [TWO_TURNS], template_kwargs=None)
    assert len(ds) == 1 and summary["split_records"] == 0
    s = ds[0]
    runs, full = masked_runs(tok, s["input_ids"], s["loss_mask"])
    assert runs == ["Hello!<|im_end|>", "4<|im_end|>"]
    assert full == tok.apply_chat_template(TWO_TURNS["messages"], tokenize=False)
    # SmolLM2's template has no reasoning field: counted, not silently lost
    assert summary["reasoning_not_rendered"] == 2
    assert s["loss_mask"].sum() == summary["loss_tokens"]


@pytest.mark.parametrize("name,eot", [("llama-3.1", "<|eot_id|>"),
                                      ("deepseek-v3", "<｜end▁of▁sentence｜>")])
def test_shipped_templates_mask_exactly(tmp_path, tok, name, eot):
    summary, ds = run_prepare(tmp_path, tok, [TWO_TURNS], chat_template=name)
    runs, full = masked_runs(tok, ds[0]["input_ids"], ds[0]["loss_mask"])
    assert runs == ["Hello!" + eot, "4" + eot]
    template = load_template(name)
    assert full == tok.apply_chat_template(TWO_TURNS["messages"], tokenize=False,
                                           chat_template=template)
    ident = ds.manifest["tokenizer"]
    assert ident["chat_template"] == name and ident["vocab_size"] == 49152
    assert ident["chat_template_sha256"] == template_sha256(template)


def test_qwen3_thinking_splits_turns_and_trains_reasoning(tmp_path, tok):
    """Qwen3 drops earlier reasoning once a later user turn follows: one sample per turn."""
    summary, ds = run_prepare(tmp_path, tok, [TWO_TURNS], chat_template="qwen3")
    assert len(ds) == 2 and summary["split_records"] == 1
    assert summary["reasoning_not_rendered"] == 0
    first, full0 = masked_runs(tok, ds[0]["input_ids"], ds[0]["loss_mask"])
    second, full1 = masked_runs(tok, ds[1]["input_ids"], ds[1]["loss_mask"])
    assert first == ["<think>\nUser greets.\n</think>\n\nHello!<|im_end|>"]
    assert second == ["<think>\nSimple sum.\n</think>\n\n4<|im_end|>"]
    # the second sample's history is the template's own re-rendering: reasoning dropped
    assert "User greets." not in full1 and "<|im_start|>assistant\nHello!<|im_end|>" in full1
    assert full0.endswith("Hello!<|im_end|>\n")


def test_qwen3_nonprefix_raise_mode_names_the_turn(tmp_path, tok):
    with pytest.raises(PrepareError, match=r"in\.jsonl:1: non_prefix_render: .*message 2"):
        run_prepare(tmp_path, tok, [TWO_TURNS], chat_template="qwen3", on_nonprefix="raise")


def test_qwen3_single_turn_empty_think_block_and_tool_calls(tmp_path, tok):
    call = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": "Paris"}}}
    tool_conv = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "18C, sunny"},
        {"role": "assistant", "content": "It is 18C and sunny."}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}
    summary, ds = run_prepare(tmp_path, tok, [chat("Hi", "Hello"), tool_conv],
                              chat_template="qwen3")
    runs, _ = masked_runs(tok, ds[0]["input_ids"], ds[0]["loss_mask"])
    assert runs == ["<think>\n\n</think>\n\nHello<|im_end|>"]
    # the tool conversation: the call is trained, the tool response is not
    assert summary["samples"] == 2 + 1 and summary["split_records"] == 1
    call_runs, _ = masked_runs(tok, ds[1]["input_ids"], ds[1]["loss_mask"])
    assert call_runs == ['<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                         '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>']
    answer_runs, full = masked_runs(tok, ds[2]["input_ids"], ds[2]["loss_mask"])
    assert answer_runs == ["<think>\n\n</think>\n\nIt is 18C and sunny.<|im_end|>"]
    assert "<tool_response>\n18C, sunny\n</tool_response>" in full


def test_template_that_drops_tool_calls_is_an_error(tmp_path, tok):
    rec = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "Let me check.", "tool_calls": [
                            {"type": "function", "function": {"name": "get_weather",
                                                              "arguments": "{}"}}]}]}
    with pytest.raises(PrepareError, match="template_error: .*get_weather"):
        run_prepare(tmp_path, tok, [rec])       # SmolLM2's template ignores tool_calls


def test_sharegpt_input_equals_openai_input(tmp_path, tok):
    share = {"id": "s1", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "2+2?"},
        {"from": "gpt", "value": "4"}]}
    openai = chat("Hi", "Hello!", "2+2?", "4", system="Be brief.")
    _, ds_share = run_prepare(tmp_path / "a", tok, [share])
    _, ds_openai = run_prepare(tmp_path / "b", tok, [openai])
    for key in ("input_ids", "loss_mask"):
        assert ds_share[0][key].equal(ds_openai[0][key])
    runs, _ = masked_runs(tok, ds_share[0]["input_ids"], ds_share[0]["loss_mask"])
    assert runs == ["Hello!<|im_end|>", "4<|im_end|>"]


def test_output_dataset_shards_and_manifest(tmp_path, tok):
    recs = [chat(f"Question {i}?", f"Answer {i}.") for i in range(5)]
    summary, ds = run_prepare(tmp_path, tok, recs, shard_samples=2)
    assert ds.kind == "tokens" and len(ds) == 5 and ds.num_shards == 3
    assert ds.manifest["prepare"]["samples"] == 5 == summary["samples"]
    assert summary["tokens"] == ds.num_tokens
    assert ds[3]["input_ids"].dtype.is_floating_point is False
    runs, _ = masked_runs(tok, ds[3]["input_ids"], ds[3]["loss_mask"])
    assert runs == ["Answer 3.<|im_end|>"]
    with pytest.raises(FileExistsError, match="already holds a complete dataset"):
        prepare(tmp_path / "in.jsonl", "smollm2", tmp_path / "out", tokenizer=tok)


GOOD = chat("Hi", "Hello!")
BAD = {
    "bad_json": '{"messages": [',
    "not_an_object": "[1, 2]",
    "no_messages": {"id": "x", "text": "hello"},
    "missing_role": {"messages": [{"content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
    "unknown_role": {"messages": [{"role": "narrator", "content": "Once"},
                                  {"role": "assistant", "content": "Yo"}]},
    "bad_content": {"messages": [{"role": "user", "content": 42},
                                 {"role": "assistant", "content": "Yo"}]},
    "empty_assistant": chat("Hi", "   "),
    "no_assistant": {"messages": [{"role": "user", "content": "Hi"}]},
    "too_long": chat("word " * 80, "Yo"),
}
BAD_SHAREGPT = {"conversations": [{"from": "wizard", "value": "Hi"},
                                  {"from": "gpt", "value": "Yo"}]}


@pytest.mark.parametrize("reason", sorted(BAD))
def test_malformed_record_raises_with_file_line_and_reason(tmp_path, tok, reason):
    with pytest.raises(PrepareError, match=rf"in\.jsonl:2: {reason}: "):
        run_prepare(tmp_path, tok, [GOOD, BAD[reason], GOOD], max_length=64)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_malformed_records_skipped_and_counted(tmp_path, tok):
    records = [GOOD, *BAD.values(), BAD_SHAREGPT, "", GOOD]
    summary, ds = run_prepare(tmp_path, tok, records, max_length=64, on_error="skip")
    expected = {r: 1 for r in BAD}
    expected["unknown_role"] += 1
    assert summary["skipped"] == expected
    assert ds.manifest["prepare"]["skipped"] == expected
    assert summary["records"] == len(records) - 1        # the blank line is not a record
    assert summary["conversations"] == 2 and len(ds) == 2


def test_no_usable_record_is_an_error(tmp_path, tok):
    with pytest.raises(PrepareError, match="no usable conversation"):
        run_prepare(tmp_path, tok, [BAD["no_assistant"]], on_error="skip")


def test_shipped_templates_listed():
    assert {"llama-3.1", "qwen3", "deepseek-v3"} <= set(available_templates())
    with pytest.raises(FileNotFoundError, match="neither a file nor a shipped template"):
        load_template("no-such-template")
