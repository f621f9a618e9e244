"""`eyas inspect`: summary figures from manifest/index, incomplete datasets, CLI output."""

import json

import pytest
import torch

from eyas.data.store.format import MANIFEST_NAME
from eyas.data.store.inspect import summarize
from eyas.data.store.shards import write_manifest, write_shard
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "inspect")

TH = 16  # target hidden (real: 4096)


def _write(root, aux_format="bf16", manifest=True):
    gen = torch.Generator().manual_seed(0)
    metas = []
    for s, lengths in enumerate([[3, 5], [8]]):
        ss = [{"input_ids": torch.randint(0, 100, (T,), generator=gen),
               "loss_mask": torch.ones(T, dtype=torch.bool),
               "aux": torch.randn(T, 3, TH, generator=gen).bfloat16(),
               "last": torch.randn(T, TH, generator=gen).bfloat16(),
               "target_argmax": torch.zeros(T, dtype=torch.int64)} for T in lengths]
        metas.append(write_shard(root, s, ss, aux_format=aux_format))
    if manifest:
        write_manifest(root, {"kind": "hidden", "target": "tiny-llama", "aux_layer_ids": [2, 4, 5],
                              "convention": "hf_hidden_states", "hidden_size": TH,
                              "teacher": {"kind": "last", "last": "post_norm"}}, metas)


def test_summary_figures(tmp_path):
    _write(tmp_path / "b")
    _write(tmp_path / "f", aux_format="fp8")
    b, f = summarize(tmp_path / "b"), summarize(tmp_path / "f")
    assert (b["samples"], b["tokens"], b["shards"]) == (3, 16, 2)
    assert b["complete"] and b["teacher"] == "last" and b["aux_layer_ids"] == [2, 4, 5]
    # payload per token: aux 6*tH + last 2*tH (= the 8*tH anchor) + ids 4 + mask 1 + argmax 4
    assert b["payload_bytes_per_token"] == 8 * TH + 9
    assert f["payload_bytes_per_token"] == 3 * TH + 12 + 2 * TH + 9 and f["aux_format"] == "fp8"
    total = sum(p.stat().st_size for p in (tmp_path / "b").glob("shard-*"))
    assert b["bytes"] == total and abs(b["bytes_per_token"] - total / 16) < 1e-9
    assert b["length"] == {"min": 3, "mean": pytest.approx(16 / 3), "p50": 5.0,
                           "p95": pytest.approx(7.7), "max": 8}  # lengths 3, 5, 8


def test_incomplete_dataset(tmp_path):
    _write(tmp_path, manifest=False)
    s = summarize(tmp_path)
    assert not s["complete"] and s["samples"] == 3 and s["tokens"] == 16


def test_cli(tmp_path, capsys):
    _write(tmp_path)
    assert cli_main([str(tmp_path), "--samples", "2", "--verify", "checksum"]) == 0
    out = capsys.readouterr().out
    assert "verify=checksum: ok" in out and "samples   3   tokens 16   shards 2" in out
    assert "aux bf16   teacher last" in out and "[1] tokens 5  trained 5 (100.0%)" in out
    assert cli_main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 16
    assert (tmp_path / MANIFEST_NAME).exists()


def test_token_dataset_shows_what_applies_and_no_none(tmp_path, capsys):
    """A real token dataset (SmolLM2's tokenizer, the shipped llama-3.1 template, a gzip input):
    its target, tokenizer, template and input in words; no aux/teacher/hidden line or None."""
    import gzip

    from eyas.data.produce.prepare import prepare
    from eyas.data.common.targets import load_tokenizer, resolve_target
    from eyas.data.common.templates import load_template, template_sha256
    rec = {"messages": [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"}]}
    text = json.dumps(rec) + "\nnot json\n"
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    prepare(tmp_path / "in.jsonl.gz", "smollm2", tmp_path / "ds", on_error="skip",
            chat_template="llama-3.1", template_kwargs={"date_string": "1 Jan 2026"},
            tokenizer=load_tokenizer("smollm2"))
    assert cli_main([str(tmp_path / "ds")]) == 0
    lines = capsys.readouterr().out.splitlines()
    sha = template_sha256(load_template("llama-3.1"))[:12]
    assert lines[1] == "kind      tokens   format v1"
    assert lines[5:8] == [
        f"target    smollm2   tokenizer {resolve_target('smollm2')} (49,152 tokens)",
        f"template  'llama-3.1'   sha256 {sha}…   args date_string='1 Jan 2026'",
        f"input     {tmp_path / 'in.jsonl.gz'} (gzip)   records 2   trained tokens "
        f"{summarize(tmp_path / 'ds')['prepare']['loss_tokens']}   skipped bad_json 1"]
    assert lines[8:] == ["fields:",
                         "  input_ids      int64     (stored int32        ) one per token      4 B",
                         "  loss_mask      bool      (stored bool         ) one per token      1 B"]
    assert not any("None" in x or x.startswith("modes") for x in lines)


def test_incomplete_dataset_says_what_is_unknown(tmp_path, capsys):
    _write(tmp_path, manifest=False)
    assert cli_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kind      hidden (from its fields)\n" in out and "modes     aux bf16\n" in out
    assert "None" not in out and "target " not in out
