"""data.produce.prepare's input is read once: FIFOs, `<(command)` and standard input work; gzip, bz2 and
xz files are read directly; zstd and a corrupt compressed file are refused in one line."""

import bz2
import gzip
import hashlib
import json
import lzma
import os
import shlex
import shutil
import subprocess
import sys
import threading

import pytest

from eyas.data.produce.prepare import PrepareError, prepare
from eyas.data.produce.records import iter_jsonl
from eyas.data.common.targets import load_tokenizer
from eyas.data.store.shards import open_dataset

RECORDS = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                        {"role": "assistant", "content": str(2 * i)}]}
           for i in range(5)]
TEXT = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()
CLI = [sys.executable, "-m", "eyas.train.cli", "prepare"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tok):
    """The token dataset of the uncompressed file, to compare every other way of reading with."""
    d = tmp_path_factory.mktemp("plain")
    (d / "in.jsonl").write_bytes(TEXT)
    prepare(d / "in.jsonl", "smollm2", d / "out", tokenizer=tok)
    return open_dataset(d / "out")


def same_samples(a, b):
    assert len(a) == len(b) == len(RECORDS)
    for i in range(len(a)):
        assert a[i]["input_ids"].tolist() == b[i]["input_ids"].tolist()
        assert a[i]["loss_mask"].tolist() == b[i]["loss_mask"].tolist()


def run_cli(args, timeout=120, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.parametrize("name,compress", [("gzip", gzip.compress), ("bz2", bz2.compress),
                                           ("xz", lzma.compress)])
def test_compressed_file_is_read_directly(tmp_path, tok, plain, name, compress):
    src = tmp_path / f"in.jsonl.{name}"
    src.write_bytes(compress(TEXT))
    summary = prepare(src, "smollm2", tmp_path / "out", tokenizer=tok)
    same_samples(open_dataset(tmp_path / "out"), plain)
    assert summary["input_compression"] == name
    assert summary["input_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert summary["records"] == len(RECORDS) and summary["skipped"] == {}
    assert [rec["id"] for _, rec in iter_jsonl(src)] == [r["id"] for r in RECORDS]


def test_plain_file_has_no_compression_key(tmp_path, tok):
    (tmp_path / "in.jsonl").write_bytes(TEXT)
    summary = prepare(tmp_path / "in.jsonl", "smollm2", tmp_path / "out", tokenizer=tok)
    assert "input_compression" not in summary
    assert summary["input_sha256"] == hashlib.sha256(TEXT).hexdigest()


def test_gzip_file_cut_short_is_one_clear_error(tmp_path, tok):
    src = tmp_path / "cut.jsonl.gz"
    src.write_bytes(gzip.compress(TEXT)[:40])
    with pytest.raises(PrepareError) as e:
        prepare(src, "smollm2", tmp_path / "out", tokenizer=tok)
    assert str(e.value) == (f"{src}: its gzip stream is corrupt or cut short (Compressed file "
                            f"ended before the end-of-stream marker was reached); check the "
                            f"file (gzip -t {src})")


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd command")
def test_zstd_file_is_refused_with_the_stream_to_use(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(TEXT)
    subprocess.run(["zstd", "-q", str(tmp_path / "in.jsonl")], check=True)
    r = run_cli([*CLI, "--input", "in.jsonl.zst", "--target", "smollm2", "--out", "out"],
                cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "eyas prepare: in.jsonl.zst: zstd-compressed, which eyas does not read; decompress it "
        "into a stream: --input <(zstd -dc in.jsonl.zst)")
    assert not (tmp_path / "out" / "manifest.json").exists()


def manifest_input(out):
    return json.loads((out / "manifest.json").read_text())["prepare"]


def test_fifo_is_read_once(tmp_path, plain):
    """The writer opens the FIFO once: a second open by prepare would block for ever."""
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)

    def write():
        with open(fifo, "wb") as f:
            f.write(TEXT)
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    r = run_cli([*CLI, "--input", str(fifo), "--target", "smollm2", "--out",
                 str(tmp_path / "out")])
    writer.join(timeout=5)
    assert r.returncode == 0, r.stderr
    got = manifest_input(tmp_path / "out")
    assert got["input"] == str(fifo) and got["records"] == len(RECORDS)
    assert got["input_sha256"] == hashlib.sha256(TEXT).hexdigest()
    same_samples(open_dataset(tmp_path / "out"), plain)


def test_process_substitution_of_zcat(tmp_path, plain):
    (tmp_path / "x.jsonl.gz").write_bytes(gzip.compress(TEXT))
    cmd = " ".join(map(shlex.quote, CLI)) + " --input <(zcat x.jsonl.gz) --target smollm2 --out out"
    r = run_cli(["bash", "-c", cmd], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = manifest_input(tmp_path / "out")
    assert got["input"].startswith("/dev/fd/") and got["records"] == len(RECORDS)
    assert got["input_sha256"] == hashlib.sha256(TEXT).hexdigest()   # not the empty stream's
    same_samples(open_dataset(tmp_path / "out"), plain)


def test_standard_input(tmp_path, plain):
    packed = gzip.compress(TEXT, mtime=0)
    r = subprocess.run([*CLI, "--input", "-", "--target", "smollm2", "--out", "out"],
                       cwd=tmp_path, input=packed, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    got = manifest_input(tmp_path / "out")
    assert (got["input"], got["input_compression"]) == ("-", "gzip")
    assert got["input_sha256"] == hashlib.sha256(packed).hexdigest()
    same_samples(open_dataset(tmp_path / "out"), plain)
