"""eyas extract --estimate: the bytes on disk of every storage mode, exact against real
extractions of a tiny real-architecture target, and the time from a timed capture."""

import json

import pytest

from eyas.data.produce.estimate import estimate, estimate_bytes
from eyas.data.produce.extract import extract
from eyas.data.produce.prepare import prepare
from eyas.data.store.shards import open_dataset
from eyas.data.common.targets import load_target, load_tokenizer
from eyas.train.cli import main

CONVS = [("Name a fruit.", "Apple."), ("What is 2+2?", "4."), ("Hi", "Hello! How can I help?"),
         ("Say something short.", "Short."), ("Count to five.", "One, two, three, four, five.")]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    with open(root / "conv.jsonl", "w") as f:
        for u, a in CONVS:
            f.write(json.dumps({"messages": [{"role": "user", "content": u},
                                             {"role": "assistant", "content": a}]}) + "\n")
    prepare(root / "conv.jsonl", "smollm2", root / "ds", tokenizer=load_tokenizer("smollm2"),
            shard_samples=2)
    return root / "ds"


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny-llama")[0]


@pytest.mark.parametrize("aux_format,teacher,shard_tokens", [
    ("bf16", "both", 70), ("fp8", "topk", None), ("fp8", "last", 45), ("bf16", "last", 1000)])
def test_bytes_are_exactly_the_files_extract_writes(tmp_path, tokens_dir, tiny, aux_format,
                                                    teacher, shard_tokens):
    lengths = [int(x) for x in open_dataset(tokens_dir).sample_lengths]
    want = estimate_bytes(lengths, 64, aux_format, teacher, 4, shard_tokens)
    out = tmp_path / "hid"
    extract(tokens_dir, "tiny-llama", out, model=tiny, aux_format=aux_format, teacher=teacher,
            topk=4, shard_tokens=shard_tokens)
    files = sorted(out.glob("shard-*.safetensors"))
    assert want["shards"] == len(files)
    assert want["shard_bytes"] == sum(f.stat().st_size for f in files)
    assert want["index_bytes"] == (out / "index.safetensors").stat().st_size
    ds = open_dataset(out)
    assert want["shard_bytes"] == ds.manifest["bytes"] and want["tokens"] == ds.num_tokens
    from eyas.data.store.inspect import summarize
    assert want["payload_bytes_per_token"] == summarize(out)["payload_bytes_per_token"]


def test_estimate_times_the_target_and_lists_every_mode(tmp_path, tokens_dir, tiny):
    r = estimate(tokens_dir, "tiny-llama", aux_format="fp8", teacher="both", topk=4,
                 model=tiny, batches=2, batch_tokens=64)
    assert len(r["modes"]) == 6 and r["timing"]["tokens"] > 0 and r["seconds"] > 0
    assert r["timing"]["tokens_per_s"] == pytest.approx(r["timing"]["tokens"] /
                                                        r["timing"]["seconds"])
    extract(tokens_dir, "tiny-llama", tmp_path / "hid", model=tiny, aux_format="fp8",
            teacher="both", topk=4)
    assert r["bytes"] == open_dataset(tmp_path / "hid").manifest["bytes"] + \
        (tmp_path / "hid" / "index.safetensors").stat().st_size


def test_cli_estimate_captures_nothing(tmp_path, tokens_dir, capsys):
    argv = ["extract", "--tokens", str(tokens_dir), "--target", "tiny-llama", "--estimate"]
    assert main(argv + ["--tokens-per-s", "100"]) == 0
    out = capsys.readouterr().out
    tokens = int(open_dataset(tokens_dir).sample_lengths.sum())
    assert out.count("\n  bf16 ") == 3 and out.count("\n  fp8 ") == 3
    assert "<- these settings" in out and f"{tokens / 100:,.0f} s" in out
    assert main(argv + ["--estimate-batches", "1"]) == 0
    assert "timed:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:          # argparse's usage error: no --out
        main(["extract", "--tokens", str(tokens_dir), "--target", "tiny-llama"])
    assert e.value.code == 2 and "--out (or --estimate)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
