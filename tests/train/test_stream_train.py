"""Streamed training (data.stream) trains the drafter that extraction then training trains, on
one rank and on two, and a killed streamed run resumes to the same drafter."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.data.produce.extract import extract
from eyas.data.produce.prepare import prepare
from eyas.data.produce.prompts import prompts_path
from eyas.data.common.targets import load_tokenizer
from tests.ports import free_port
from tests.train.test_trainer import MAIN, SMALL, _cmd, _env

pytestmark = pytest.mark.slow

COMMON = [*SMALL, "target=tiny_llama", "train.epochs=2", "train.deterministic=true",
          "target.dtype=float32", "data.vocab_count=next_token", "train.eval_every=4"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-train")
    src = root / "conv.jsonl"
    with open(src, "w") as f:
        for i, line in enumerate(prompts_path("default").read_text().splitlines()[:40]):
            user = [m for m in json.loads(line)["messages"] if m["role"] == "user"][:1]
            answer = {"role": "assistant", "content": "Sure. " * (3 + i % 9)}
            f.write(json.dumps({"messages": user + [answer]}) + "\n")
    prepare(src, "smollm2", root / "tokens", tokenizer=load_tokenizer("smollm2"))
    return root / "tokens"


@pytest.fixture(scope="module")
def extracted(tokens):
    """The reference: `eyas extract` of the tokens, then a training on it."""
    out = tokens.parent / "extracted"
    extract(tokens, "tiny-llama", out, dtype="float32", shard_tokens=300, device="cpu")
    return out


def _run(run_dir: Path, *overrides, nproc=1, check=True):
    r = subprocess.run([*_cmd(nproc, free_port()), *COMMON, f"hydra.run.dir={run_dir}",
                        "data.stream.ahead=8", *overrides], cwd=run_dir.parent, env=_env(),
                       capture_output=True, text=True, timeout=900)
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    return r


def _export(run_dir: Path) -> dict:
    return load_file(str(run_dir / "export" / "model.safetensors"))


def _same_export(a: Path, b: Path) -> None:
    ta, tb = _export(a), _export(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def _same_dataset(a: Path, b: Path) -> None:
    assert json.loads((a / "manifest.json").read_text()) == \
        json.loads((b / "manifest.json").read_text())
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert names == sorted(p.name for p in b.glob("*.safetensors")) and len(names) > 2
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_keep_all_and_keep_none_train_what_extraction_trains(tmp_path, tokens, extracted):
    ref = tmp_path / "ref"
    _run(ref, f"data.dataset={extracted}")
    kept = tmp_path / "kept"
    r = _run(tmp_path / "all", "data.stream=true", f"data.tokens={tokens}",
             f"data.dataset={kept}", "data.stream.shard_tokens=300")
    assert "stream:" in r.stderr
    _same_export(ref, tmp_path / "all")
    _same_dataset(extracted, kept)
    _run(tmp_path / "none", "data.stream=true", "data.stream.keep=none", f"data.tokens={tokens}",
         "data.stream.shard_tokens=300")
    _same_export(ref, tmp_path / "none")
    assert not (tmp_path / "none" / "stream-spool").exists()    # a finished run's spool goes


def test_two_ranks_capture_their_own_samples(tmp_path, tokens, extracted):
    kept = tmp_path / "kept"
    r = _run(tmp_path / "two", "data.stream=true", f"data.tokens={tokens}",
             f"data.dataset={kept}", "data.stream.shard_tokens=300", nproc=2)
    _same_dataset(extracted, kept)
    counts = [int(line.split(" captured ")[1].split()[0]) for line in r.stderr.splitlines()
              if "stream: rank 0 captured" in line]
    # rank 0 captured its share (about half), rank 1 the rest: the shards needed both
    assert len(counts) == 1 and 0 < counts[0] <= 40 // 2 + 4, counts


def test_kill9_of_a_streamed_run_resumes_to_the_same_drafter(tmp_path, tokens, extracted):
    ref = tmp_path / "ref"
    _run(ref, f"data.dataset={extracted}")
    b, kept = tmp_path / "b", tmp_path / "kept"
    b.mkdir()
    args = [sys.executable, MAIN, *COMMON, f"hydra.run.dir={b}", "data.stream=true",
            "data.stream.ahead=8", f"data.tokens={tokens}", f"data.dataset={kept}",
            "data.stream.shard_tokens=300", "train.save_every=1"]
    p = subprocess.Popen(args, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    latest = b / "checkpoints" / "latest"
    deadline = time.time() + 400
    while time.time() < deadline:
        if latest.is_file() and latest.read_text().strip() >= "step-000003":
            break
        if p.poll() is not None:
            pytest.fail("the streamed run ended before it could be killed")
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (kept / "manifest.json").exists()       # killed inside the first epoch
    _run(b, "data.stream=true", f"data.tokens={tokens}", f"data.dataset={kept}",
         "data.stream.shard_tokens=300", "train.save_every=1", "train.resume=latest")
    _same_export(ref, b)
    _same_dataset(extracted, kept)


def test_the_embedded_default_streams_into_its_cache(tmp_path):
    """No data.dataset and no data.tokens: the embedded default answers and tokenises as
    always, then trains while it captures, keeping the shards in its cache, where a later run
    finds the dataset complete; the cache equals `eyas extract` of the same tokens."""
    cache = tmp_path / "cache"
    small = [o for o in COMMON if not o.startswith(("data.vocab_count", "train.eval_every"))]
    embedded = [f"data.cache_dir={cache}", "data.num_prompts=12", "data.max_new_tokens=24",
                "train.epochs=1"]
    r = subprocess.run([sys.executable, MAIN, *small, *embedded, "data.stream=true",
                        f"hydra.run.dir={tmp_path / 'a'}"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "stream: capturing (hf, keep=all)" in r.stderr
    (root,) = (cache / "datasets").iterdir()
    hidden = root / "hidden"
    assert (hidden / "manifest.json").is_file() and (tmp_path / "a" / "export").is_dir()
    ref = tmp_path / "extracted"
    extract(root / "tokens", "tiny-llama", ref, dtype="float32", device="cpu")
    _same_files(ref, hidden)
    r = subprocess.run([sys.executable, MAIN, *small, *embedded,
                        f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "embedded dataset: cached at" in r.stderr, r.stderr[-3000:]


def _same_files(a: Path, b: Path) -> None:
    assert json.loads((a / "manifest.json").read_text()) == \
        json.loads((b / "manifest.json").read_text())
    for p in a.glob("*.safetensors"):
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name
