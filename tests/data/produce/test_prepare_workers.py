"""data.produce.encoding: `eyas prepare` in a pool of forked worker processes writes the same dataset
as one process (byte for byte), stops at the same first bad record, counts the same skips and
dropped reasoning, logs each once-only renderer warning once, and leaves no worker behind.

The chunks are cut to 3 lines here, so 2 workers each encode several chunks; the real SmolLM2
tokenizer renders with its own chat template and with shipped ones that split records into one
sample per turn (qwen3) or cut a token at a span boundary (llama-3.1).
"""

import logging
import multiprocessing

import pytest

from eyas.data.produce import encoding
from eyas.data.common.options import parse
from eyas.data.produce.prepare import PrepareError, PrepareOptions, prepare
from eyas.data.common.targets import load_tokenizer

from tests.data.produce.test_prepare import BAD, GOOD, TWO_TURNS, chat, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(encoding, "CHUNK_LINES", 3)


def records():
    """Good single- and multi-turn records (some with reasoning SmolLM2's template drops),
    every kind of malformed record, blank lines and a line that is not UTF-8."""
    bad = dict(BAD, too_long=chat("word " * 300, "Yo"))       # over max_length in any template
    recs = [GOOD, TWO_TURNS, chat("Name a colour.", "Blue."), "", *bad.values(), TWO_TURNS]
    recs += [chat(f"Count to {i}.", " ".join(str(j) for j in range(1, i + 1))) for i in (2, 5, 9)]
    return recs


def prepared(tmp_path, tok, name, recs, **kw):
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    if kw.pop("not_utf8", False):            # a byte-order mark first, a line not UTF-8 last
        src.write_bytes(b"\xef\xbb\xbf" + src.read_bytes() + b'{"messages": "caf\xe9"}\n')
    out = tmp_path / name
    summary = prepare(src, "smollm2", out, tokenizer=tok, max_length=256, **kw)
    return summary, out


@pytest.mark.parametrize("template,split,cuts", [(None, 0, 0), ("qwen3", 2, 0),
                                                 ("llama-3.1", 0, 2)])
def test_pool_writes_the_same_dataset_as_one_process(tmp_path, tok, small_chunks, caplog,
                                                     template, split, cuts):
    kw = dict(on_error="skip", not_utf8=True, chat_template=template)
    one, out1 = prepared(tmp_path, tok, "one", records(), workers=1, **kw)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eyas"):
        two, out2 = prepared(tmp_path, tok, "two", records(), workers=2, **kw)
    shards = sorted(p.name for p in out1.glob("*.safetensors"))
    assert shards == sorted(p.name for p in out2.glob("*.safetensors")) and shards
    for name in shards:
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes(), name
    one.pop("out_dir"), two.pop("out_dir")
    assert one == two
    assert one["skipped"] == {**{r: 1 for r in BAD}, "bad_encoding": 1}
    assert one["conversations"] == 7
    assert (one["split_records"], one["boundary_splits"]) == (split, cuts)
    assert one["reasoning_not_rendered"] == (0 if template == "qwen3" else 4)
    # the once-only warning each worker's renderer logged is logged once
    dropped = [r for r in caplog.records if "does not render reasoning_content" in r.getMessage()]
    assert len(dropped) == (0 if template == "qwen3" else 1)


def test_replayed_logs_once_only_events_once_and_the_rest_each_time(caplog):
    renderer = type("R", (), {"reasoning_dropped": 1})()
    once = ("eyas.data.common.templates", logging.WARNING, "first seen in %s", "first seen in a:1", True)
    every = ("eyas.data.produce.records", logging.WARNING, "line %d", "line 7", False)
    seen: set = set()
    with caplog.at_level(logging.WARNING, logger="eyas"):
        for n in (2, 3):
            chunk = encoding.Chunk(records=[], reasoning_dropped=n,
                                   events=[once, every])
            encoding._replayed(chunk, renderer, seen)
    assert [r.getMessage() for r in caplog.records] == ["first seen in a:1", "line 7", "line 7"]
    assert renderer.reasoning_dropped == 6


@pytest.mark.parametrize("workers", [1, 2])
def test_pool_stops_at_the_first_bad_record_like_one_process(tmp_path, tok, small_chunks,
                                                             workers):
    recs = [GOOD] * 7 + [BAD["bad_content"], GOOD, BAD["bad_json"]]
    with pytest.raises(PrepareError, match=r"in\.jsonl:8: bad_content: "):
        prepared(tmp_path, tok, "out", recs, workers=workers)
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not multiprocessing.active_children()          # the pool is shut down


def test_a_bad_worker_count_is_refused_before_any_generation(tmp_path, capsys):
    with pytest.raises(ValueError, match="workers must be >= 1"):
        prepare(tmp_path / "missing.jsonl", "smollm2", tmp_path / "out", generate=True,
                workers=0)
    args = ["--input", "a", "--target", "b", "--out", "c", "--workers"]
    assert parse(PrepareOptions, "eyas prepare", args + ["2"]).workers == 2
    with pytest.raises(SystemExit) as stop:
        parse(PrepareOptions, "eyas prepare", args + ["0"])
    assert stop.value.code == 2
    assert "expected a whole number >= 1, got '0'" in capsys.readouterr().err


def test_workers_chosen_by_input_size(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD] * 4)
    assert encoding.auto_workers(src, None) == 1               # under AUTO_POOL_BYTES
    assert encoding.auto_workers(src, 3) == 3
    monkeypatch.setattr(encoding, "AUTO_POOL_BYTES", 1)
    monkeypatch.setattr(encoding.os, "sched_getaffinity", lambda pid: set(range(40)),
                        raising=False)
    assert encoding.auto_workers(src, None) == encoding.AUTO_MAX_WORKERS
    with pytest.raises(ValueError, match="workers must be >= 1"):
        encoding.auto_workers(src, 0)
