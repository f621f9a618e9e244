"""Conversation records as `eyas prepare` reads them: `weight: 0` turns, the types of every key
read, and lines that are not UTF-8 — each named file:line, or skipped and counted."""

import json

import pytest

from eyas.data.produce.prepare import PrepareError, prepare
from eyas.data.store.shards import open_dataset
from eyas.data.common.targets import load_tokenizer
from eyas.train.cli import main


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def write_lines(path, records):
    """JSONL from dicts (dumped) and bytes/str lines (written as given)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for r in records:
            line = r if isinstance(r, bytes) else (r if isinstance(r, str)
                                                   else json.dumps(r)).encode()
            f.write(line + b"\n")
    return path


def trained_text(tok, sample):
    ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
    return [tok.decode([t for t, m in zip(ids, mask) if m]),
            tok.decode(ids)]


def msgs(*turns):
    out = []
    for i, t in enumerate(turns):
        role = "user" if i % 2 == 0 else "assistant"
        out.append(dict(t, role=role) if isinstance(t, dict) else {"role": role, "content": t})
    return {"messages": out}


def run(tmp_path, tok, records, **kw):
    src = write_lines(tmp_path / "in.jsonl", records)
    summary = prepare(src, "smollm2", tmp_path / "out", tokenizer=tok, **kw)
    return summary, open_dataset(tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# weight


def test_weight_zero_turn_is_context_not_trained(tmp_path, tok):
    rec = msgs("Hi", {"content": "Bad answer.", "weight": 0}, "Again?",
               {"content": "Good answer.", "weight": 1})
    plain = msgs("Hi", "Bad answer.", "Again?", "Good answer.")
    summary, ds = run(tmp_path / "a", tok, [rec])
    trained, full = trained_text(tok, ds[0])
    assert trained == "Good answer.<|im_end|>"
    assert "Bad answer." in full                     # still in the context
    assert summary["untrained_turns"] == 1 == ds.manifest["prepare"]["untrained_turns"]
    # the token stream is the one without weights: the key never reaches the template
    _, ds_plain = run(tmp_path / "b", tok, [plain])
    assert ds[0]["input_ids"].equal(ds_plain[0]["input_ids"])
    assert trained_text(tok, ds_plain[0])[0] == "Bad answer.<|im_end|>Good answer.<|im_end|>"


def test_weight_zero_in_sharegpt_and_split_templates(tmp_path, tok):
    share = {"conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Skip me.", "weight": 0},
        {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4", "weight": 1.0}]}
    _, ds = run(tmp_path / "a", tok, [share])
    assert trained_text(tok, ds[0])[0] == "4<|im_end|>"
    # qwen3 re-renders earlier turns: one sample per *trained* turn
    summary, ds = run(tmp_path / "b", tok, [share], chat_template="qwen3")
    assert len(ds) == 1 and summary["samples"] == 1
    trained, full = trained_text(tok, ds[0])
    assert trained.endswith("4<|im_end|>") and "Skip me." in full


def test_all_turns_weight_zero_is_no_assistant(tmp_path, tok):
    rec = msgs("Hi", {"content": "Hello", "weight": 0})
    with pytest.raises(PrepareError, match=r"in\.jsonl:1: no_assistant: .*all 1 have weight 0"):
        run(tmp_path, tok, [rec])


@pytest.mark.parametrize("weight", [0.5, 2, -1, "0", True, [0]])
def test_other_weights_are_an_error_naming_the_value(tmp_path, tok, weight):
    rec = msgs("Hi", {"content": "Hello", "weight": weight})
    with pytest.raises(PrepareError, match=rf"in\.jsonl:2: bad_weight: message 1 has "
                                           rf"weight={weight!r}".replace("[", r"\[")):
        run(tmp_path, tok, [msgs("Q", "A"), rec])


# ---------------------------------------------------------------------------------------------
# malformed records: one line naming file:line, or skipped and counted

BAD = {
    "reasoning_int": ("bad_field", msgs("Hi", {"content": "Yo", "reasoning_content": 42})),
    "reasoning_list": ("bad_field", msgs("Hi", {"content": "Yo", "reasoning_content": ["a"]})),
    "reasoning_dict": ("bad_field", msgs("Hi", {"content": "Yo", "reasoning_content": {"a": 1}})),
    "tool_calls_int": ("bad_field", msgs("Hi", {"content": "Yo", "tool_calls": 3})),
    "tool_call_not_object": ("bad_field", msgs("Hi", {"content": "Yo", "tool_calls": ["f"]})),
    "tool_call_name_int": ("bad_field", msgs("Hi", {"content": "", "tool_calls": [
        {"type": "function", "function": {"name": 7, "arguments": "{}"}}]})),
    "tool_call_id_int": ("bad_field", msgs("Hi", {"content": "Yo", "tool_call_id": 5})),
    "name_list": ("bad_field", msgs({"content": "Hi", "name": ["x"]}, "Yo")),
    "tools_string": ("bad_field", dict(msgs("Hi", "Yo"), tools="get_weather")),
    "id_object": ("bad_field", dict(msgs("Hi", "Yo"), id={"a": 1})),
    "content_dict": ("bad_content", msgs({"content": {"text": "Hi"}}, "Yo")),
    "sharegpt_value_int": ("bad_content", {"conversations": [{"from": "human", "value": 3},
                                                            {"from": "gpt", "value": "Yo"}]}),
    "role_missing": ("missing_role", {"messages": [{"content": "Hi"},
                                                   {"role": "assistant", "content": "Yo"}]}),
    "role_int": ("unknown_role", {"messages": [{"role": 1, "content": "Hi"},
                                               {"role": "assistant", "content": "Yo"}]}),
    "messages_string": ("no_messages", {"messages": "Hi"}),
    "not_utf8": ("bad_encoding", b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'),
}
GOOD = msgs("Hi", "Hello!")


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_record_names_file_line_and_problem(tmp_path, tok, case):
    reason, rec = BAD[case]
    with pytest.raises(PrepareError, match=rf"in\.jsonl:2: {reason}: ") as e:
        run(tmp_path, tok, [GOOD, rec, GOOD])
    assert "\n" not in str(e.value)


def test_malformed_records_skipped_and_counted_through_the_cli(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [GOOD, *(r for _, r in BAD.values()), GOOD,
                                              b"\xff\xfe not even json"])
    argv = ["prepare", "--input", str(src), "--target", "smollm2", "--out", str(tmp_path / "o")]
    assert main(argv + ["--on-error", "skip"]) == 0
    summary = json.loads(capsys.readouterr().out)
    expected: dict[str, int] = {}
    for reason, _ in BAD.values():
        expected[reason] = expected.get(reason, 0) + 1
    expected["bad_encoding"] += 1
    assert summary["skipped"] == expected
    assert summary["records"] == len(BAD) + 3 and summary["conversations"] == 2
    assert open_dataset(tmp_path / "o").manifest["prepare"]["skipped"] == expected
    # the default, raise: one line naming the first bad record's file:line, exit 2
    assert main(argv[:-1] + [str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if x.startswith("eyas prepare")]
    assert len(line) == 1 and f"{src}:2: " in line[0], err


def test_bom_and_crlf_lines_are_read(tmp_path, tok):
    raw = b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n" + json.dumps(GOOD).encode()
    summary, ds = run(tmp_path, tok, [raw])
    assert summary["conversations"] == 2 and not summary["skipped"]


def test_bad_byte_after_a_bom_is_named_at_its_raw_offset():
    from eyas.data.produce.records import parse_line
    msg = "bad_encoding: not valid UTF-8 (byte 0xff at byte {} of the line); re-encode the file " \
          "as UTF-8"
    assert str(parse_line(1, b'\xef\xbb\xbf{"a":"\xff"}\n')) == msg.format(10)
    assert str(parse_line(1, b'{"a":"\xff"}\n')) == msg.format(7)
    assert str(parse_line(1, b'\xef\xbb\xbf\xfe{}\n')) == msg.replace("0xff", "0xfe").format(4)
    assert parse_line(1, b'\xef\xbb\xbf{"a": 1}\n') == {"a": 1}


def test_synthesize_prompt_files_name_file_line(tmp_path):
    from eyas.data.produce.synthesize import prompt_texts
    good = write_lines(tmp_path / "ok.jsonl", [
        msgs("Why is the sky blue?"), {"conversations": [{"from": "human", "value": "Hi there"}]}])
    assert prompt_texts(good) == ["Why is the sky blue?", "Hi there"]
    for i, bad in enumerate([b"\xff", b"[1]", b'{"messages": [{"role": "user", "content": 4}]}']):
        path = write_lines(tmp_path / f"bad{i}.jsonl", [msgs("Fine"), bad])
        with pytest.raises(PrepareError, match=rf"bad{i}\.jsonl:2: "):
            prompt_texts(path)


def test_generate_reads_prompts_the_same_way(tmp_path, caplog):
    """`eyas prepare --generate`'s reader: file:line in raise mode, counted in skip mode (with
    nothing left to answer, no model is loaded)."""
    from eyas.data.produce.generate import generate_conversations
    src = write_lines(tmp_path / "p.jsonl", [BAD["not_utf8"][1], BAD["reasoning_int"][1]])
    with pytest.raises(PrepareError, match=r"p\.jsonl:1: bad_encoding: "):
        generate_conversations(src, "no-such-target", tmp_path / "g.jsonl")
    with caplog.at_level("WARNING"):
        out = generate_conversations(src, "no-such-target", tmp_path / "g.jsonl",
                                     on_error="skip")
    assert out == tmp_path / "g.jsonl"
    assert "skipped 2 prompt records" in caplog.text
    assert "'bad_encoding': 1" in caplog.text and "'bad_field': 1" in caplog.text
