"""data.encoding: `eyas prepare` in a pool of spawned worker processes writes the same dataset
as one process (byte for byte), stops at the same first bad record, counts the same skips and
dropped reasoning, and logs each renderer warning once.

The chunks are cut to 3 lines here, so 2 workers each encode several chunks and every kind of
record lands in a chunk of its own order; the real SmolLM2 tokenizer and chat template render.
"""

import logging

import pytest

from eyas.data import encoding
from eyas.data.prepare import PrepareError, prepare
from eyas.data.targets import load_tokenizer

from tests.data.test_prepare import BAD, GOOD, TWO_TURNS, chat, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(encoding, "CHUNK_LINES", 3)


def records():
    """Good single- and multi-turn records (some with reasoning SmolLM2's template drops),
    every kind of malformed record, blank lines and a line that is not UTF-8."""
    recs = [GOOD, TWO_TURNS, chat("Name a colour.", "Blue."), "", *BAD.values(), TWO_TURNS]
    recs += [chat(f"Count to {i}.", " ".join(str(j) for j in range(1, i + 1))) for i in (2, 5, 9)]
    return recs


def prepared(tmp_path, tok, name, recs, **kw):
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    if kw.pop("not_utf8", False):
        with open(src, "ab") as f:
            f.write(b'{"messages": "caf\xe9"}\n')
    out = tmp_path / name
    summary = prepare(src, "smollm2", out, tokenizer=tok, max_length=64, **kw)
    return summary, out


def test_pool_writes_the_same_dataset_as_one_process(tmp_path, tok, small_chunks, caplog):
    one, out1 = prepared(tmp_path, tok, "one", records(), on_error="skip", workers=1,
                         not_utf8=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eyas"):
        two, out2 = prepared(tmp_path, tok, "two", records(), on_error="skip", workers=2,
                             not_utf8=True)
    shards = sorted(p.name for p in out1.glob("*.safetensors"))
    assert shards == sorted(p.name for p in out2.glob("*.safetensors")) and shards
    for name in shards:
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes(), name
    one.pop("out_dir"), two.pop("out_dir")
    assert one == two
    assert one["skipped"] == {**{r: 1 for r in BAD}, "bad_encoding": 1}
    assert one["conversations"] == 7 and one["reasoning_not_rendered"] == 4
    # the warning each worker's renderer logged comes back, once
    dropped = [r for r in caplog.records if "does not render reasoning_content" in r.getMessage()]
    assert len(dropped) == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_pool_stops_at_the_first_bad_record_like_one_process(tmp_path, tok, small_chunks,
                                                             workers):
    recs = [GOOD] * 7 + [BAD["bad_content"], GOOD, BAD["bad_json"]]
    with pytest.raises(PrepareError, match=r"in\.jsonl:8: bad_content: "):
        prepared(tmp_path, tok, "out", recs, workers=workers)
    assert not (tmp_path / "out" / "manifest.json").exists()


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
