"""Producers refuse the wrong output directory before touching it: prepare never deletes a
hidden-state dataset or an unfinished extraction, extract never overwrites a token dataset or
its own input (also named through a symlink or a relative path)."""

import os

import pytest
import torch

from eyas.data.produce.extract import extract
from eyas.data.produce.outdir import PLAN_NAME
from eyas.data.produce.prepare import prepare
from eyas.data.store.shards import write_manifest, write_shard
from eyas.train.cli import main

from tests.ports import free_port


def _tokens(out, n=3):
    samples = [{"input_ids": torch.arange(4 + i, dtype=torch.int32),
                "loss_mask": torch.ones(4 + i, dtype=torch.bool)} for i in range(n)]
    metas = [write_shard(out, 0, samples)]
    write_manifest(out, {"kind": "tokens", "target": "tiny-llama"}, metas)
    return out


def _hidden_shards(out, n=2):
    """What a killed `eyas extract` leaves: its plan and some of its shards, no manifest."""
    for j in range(n):
        write_shard(out, j, [{"input_ids": torch.arange(5, dtype=torch.int32),
                              "loss_mask": torch.ones(5, dtype=torch.bool),
                              "aux": torch.randn(5, 3, 8), "last": torch.randn(5, 8),
                              "target_argmax": torch.arange(5)}])
    (out / PLAN_NAME).write_text('{"format": "eyas-extract-plan"}')
    return out


def _snapshot(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("complete", [False, True])
def test_prepare_refuses_a_hidden_state_directory(tmp_path, capsys, complete):
    out = _hidden_shards(tmp_path / "hs")
    if complete:
        write_manifest(out, {"kind": "hidden", "target": "tiny-llama"})
    before = _snapshot(out)
    (tmp_path / "in.jsonl").write_text('{"messages": []}\n')
    assert main(["prepare", "--input", str(tmp_path / "in.jsonl"), "--target", "smollm2",
                 "--out", str(out)]) == 2
    line = _one_line(capsys)
    what = "a complete dataset (kind hidden" if complete else "an unfinished hidden-state " \
        "extraction (extract_plan.json, 2 shard(s)"
    assert str(out) in line and what in line and "Fix: choose another --out" in line, line
    assert _snapshot(out) == before


def test_prepare_refuses_hidden_shards_without_a_plan(tmp_path):
    out = _hidden_shards(tmp_path / "hs")
    (out / PLAN_NAME).unlink()
    before = _snapshot(out)
    with pytest.raises(FileExistsError, match="hidden-state shards without a manifest"):
        prepare(tmp_path / "in.jsonl", "smollm2", out)
    assert _snapshot(out) == before


def test_prepare_still_clears_its_own_unfinished_run(tmp_path):
    from eyas.data.common.targets import load_tokenizer
    out = tmp_path / "tok"
    write_shard(out, 5, [{"input_ids": torch.arange(3, dtype=torch.int32),
                          "loss_mask": torch.ones(3, dtype=torch.bool)}])
    (tmp_path / "in.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "Hi"}, '
        '{"role": "assistant", "content": "Hello"}]}\n')
    prepare(tmp_path / "in.jsonl", "smollm2", out, tokenizer=load_tokenizer("smollm2"))
    assert not (out / "shard-00005.safetensors").exists() and (out / "manifest.json").is_file()


def test_extract_refuses_a_token_dataset(tmp_path, capsys):
    tokens, other = _tokens(tmp_path / "a"), _tokens(tmp_path / "b")
    before = _snapshot(other)
    assert main(["extract", "--tokens", str(tokens), "--target", "tiny-llama", "--out",
                 str(other), "--device", "cpu"]) == 2
    line = _one_line(capsys)
    assert str(other) in line and "a complete dataset (kind tokens" in line, line
    assert "not an extraction" in line and "Fix: choose another --out" in line
    assert _snapshot(other) == before


def test_extract_refuses_an_unfinished_token_dataset(tmp_path):
    tokens = _tokens(tmp_path / "a")
    partial = tmp_path / "b"
    write_shard(partial, 0, [{"input_ids": torch.arange(3, dtype=torch.int32),
                              "loss_mask": torch.ones(3, dtype=torch.bool)}])
    with pytest.raises(FileExistsError, match="an unfinished token dataset"):
        extract(tokens, "tiny-llama", partial, device="cpu")
    assert sorted(p.name for p in partial.iterdir()) == ["shard-00000.safetensors"]


@pytest.mark.parametrize("spelling", ["same", "symlink", "relative"])
def test_extract_refuses_its_own_input(tmp_path, monkeypatch, capsys, spelling):
    tokens = _tokens(tmp_path / "tok")
    out = str(tokens)
    if spelling == "symlink":
        os.symlink(tokens, tmp_path / "link")
        out = str(tmp_path / "link")
    elif spelling == "relative":
        monkeypatch.chdir(tmp_path / "tok")
        out = "."
    before = _snapshot(tokens)
    assert main(["extract", "--tokens", str(tokens), "--target", "tiny-llama", "--out", out,
                 "--device", "cpu"]) == 2
    line = _one_line(capsys)
    assert f"--out {out} is the --tokens dataset itself ({tokens.resolve()})" in line, line
    assert "overwrite its own input" in line and "Fix: choose another --out" in line
    assert _snapshot(tokens) == before


@pytest.mark.slow
def test_a_two_rank_extract_is_one_writer(tmp_path, lock_holder):
    """`accelerate launch -m eyas.data.produce.extract` with 2 CPU ranks: rank 0 takes the lock for
    both; a held directory stops both ranks at once with the holder's line, none writes."""
    import subprocess
    import sys
    from pathlib import Path
    tokens, out = _tokens(tmp_path / "tok", n=4), tmp_path / "hs"
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m", "eyas.data.produce.extract",
           "--tokens", str(tokens), "--target", "tiny-llama", "--out", str(out),
           "--device", "cpu", "--shard-tokens", "8"]
    holder = lock_holder(out)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    lines = {line for line in r.stderr.splitlines() if line.startswith("extract: ")}
    assert len(lines) == 1 and f"pid {holder.pid}" in lines.pop(), r.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [".eyas.lock"]
    holder.kill()
    holder.wait()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "manifest.json").is_file() and not (out / ".eyas.lock").exists()
    assert "taking over the stale lock" in r.stderr


def test_one_extract_at_a_time_writes_a_directory(tmp_path, lock_holder):
    """`extract` itself holds the output's lock: a second writer stops before any work, naming
    the holder, and leaves the directory as it was."""
    tokens, out = _tokens(tmp_path / "tok", n=4), tmp_path / "hs"
    holder = lock_holder(out)
    with pytest.raises(Exception, match=f"pid {holder.pid}"):
        extract(tokens, "tiny-llama", out, device="cpu", shard_tokens=8)
    assert sorted(p.name for p in out.iterdir()) == [".eyas.lock"]
