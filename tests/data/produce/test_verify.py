"""eyas verify: real extractions from tiny real-architecture targets and SmolLM2, re-run through
the target. Clean and fp8 datasets pass; samples swapped between shards with their checksums
recomputed by the shard writer, and a dataset captured from other weights, fail."""

import json
import shutil

import pytest
import torch

from eyas.data.produce.extract import extract
from eyas.data.produce.prepare import prepare
from eyas.data.store.shards import open_dataset, write_manifest, write_shard
from eyas.data.common.targets import build_random_target, load_target, load_tokenizer
from eyas.data.produce.verify import verify
from eyas.data.produce.verify_checks import state_check
from eyas.train.cli import main

# token lengths 38 38 39 39 41 40 38: with shard_tokens=80 the hidden shards are
# [0, 1] [2, 3] [4] [5, 6], so samples 0 and 6 have equal lengths in different shards
CONVS = [("Name a fruit.", "Apple."), ("Name a color.", "Green."), ("Name a bird.", "Robin."),
         ("Name a tree.", "Oak."), ("What is 2+2?", "4."), ("Hi", "Hello! How can I help?"),
         ("Say something short.", "Short.")]
HIDDEN_FIELDS = ("aux", "last", "target_argmax", "topk_ids", "topk_logits")

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


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tokens_dir, tiny):
    out = tmp_path_factory.mktemp("hid") / "clean"
    extract(tokens_dir, "tiny-llama", out, model=tiny, teacher="both", topk=4, shard_tokens=80)
    assert open_dataset(out).num_shards == 4
    return out


def _rewrite(src, out, samples_by_shard):
    """The dataset at `src` with its shards rewritten from `samples_by_shard` by the shard
    writer itself (fresh per-sample crcs, shard checksums, index and manifest)."""
    shutil.copytree(src, out)
    old = json.loads((src / "manifest.json").read_text())
    manifest = {k: v for k, v in old.items() if k not in (
        "fields", "aux_format", "n_samples", "n_tokens", "n_shards", "bytes", "index", "shards")}
    metas = [write_shard(out, j, samples, aux_format=old["aux_format"])
             for j, samples in enumerate(samples_by_shard)]
    write_manifest(out, manifest, metas)
    return out


def _by_shard(ds):
    first = [0]
    for s in ds.manifest["shards"]:
        first.append(first[-1] + s["n_samples"])
    return [[{k: v.clone() for k, v in ds[i].items()} for i in range(a, b)]
            for a, b in zip(first, first[1:])]


def _bad(report):
    return {(r["sample"], r["field"]) for r in report["rows"] if not r["ok"]}


def test_clean_dataset_passes_bitwise(clean, tiny, capsys):
    r = verify(clean, "tiny-llama", samples=0, model=tiny)
    assert r["ok"] and r["samples"] == list(range(len(CONVS))), r
    assert {it["check"]: it["ok"] for it in r["identity"]}["fingerprint"] is True
    fields = {row["field"] for row in r["rows"]}
    assert fields == {"input_ids", "loss_mask", *HIDDEN_FIELDS}
    states = [row for row in r["rows"] if row["field"] in ("aux", "last", "topk_logits")]
    assert all(row["max_abs_err"] == 0 and row["cosine_min"] > 0.9999 for row in states)
    picks = verify(clean, "tiny-llama", samples=3, seed=1, model=tiny)["samples"]
    assert len(picks) == 3 and picks == verify(clean, "tiny-llama", samples=3, seed=1,
                                               model=tiny)["samples"]
    assert main(["verify", str(clean), "--target", "tiny-llama", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("verify: clean") and "fingerprint" in out


def test_clean_smollm2_dataset_passes(tmp_path, tokens_dir):
    model = load_target("smollm2", dtype=torch.float32)[0]   # bf16 matmuls are slow on a CPU
    extract(tokens_dir, "smollm2", tmp_path / "hid", model=model, teacher="last", max_samples=2,
            shard_tokens=40)
    r = verify(tmp_path / "hid", "smollm2", samples=0, model=model)
    assert r["ok"] and len(r["samples"]) == 2 and r["aux_format"] == "bf16", r
    # float32 states stored in bf16: a real rounding error, inside bf16's 2^-8 |f|
    assert all(row["max_abs_err"] > 0 for row in r["rows"] if row["field"] == "aux")
    assert {row["field"] for row in r["rows"]} == {"input_ids", "loss_mask", "aux", "last",
                                                   "target_argmax"}


def test_an_unreadable_token_dataset_is_a_note_and_the_stored_ids_run(tmp_path, clean, tiny):
    r = verify(clean, "tiny-llama", samples=1, tokens=str(tmp_path / "gone"), model=tiny)
    note = next(it for it in r["identity"] if it["check"] == "tokens_dataset")
    assert r["ok"] and note["ok"] is None and "--tokens" in note["note"]
    assert {row["field"] for row in r["rows"]} == set(HIDDEN_FIELDS)


def test_hidden_states_swapped_between_shards_fail_naming_the_samples(tmp_path, clean, tiny):
    """Samples 0 (shard 0) and 6 (shard 3), both 38 tokens, trade their captured fields; ids
    stay: what batched engine calls assigned to the wrong request look like."""
    shards = _by_shard(open_dataset(clean))
    a, b = shards[0][0], shards[3][1]
    for f in HIDDEN_FIELDS:
        a[f], b[f] = b[f], a[f]
    bad = _rewrite(clean, tmp_path / "swapped", shards)
    assert len(open_dataset(bad, verify="checksum")) == len(CONVS)     # every crc passes
    r = verify(bad, "tiny-llama", samples=0, model=tiny)
    assert not r["ok"] and r["bad_samples"] == [0, 6], r
    assert {(0, "aux"), (6, "aux"), (0, "last"), (6, "last")} <= _bad(r)
    assert not any(f in ("input_ids", "loss_mask") for _, f in _bad(r))


def test_whole_samples_swapped_between_shards_fail_on_their_ids(tmp_path, clean, tiny, capsys):
    """Samples 1 (38 tokens, shard 0) and 4 (41 tokens, shard 2) trade places whole: each is
    self-consistent, but no longer the token dataset's sample at its index."""
    shards = _by_shard(open_dataset(clean))
    shards[0][1], shards[2][0] = shards[2][0], shards[0][1]
    bad = _rewrite(clean, tmp_path / "moved", shards)
    assert len(open_dataset(bad, verify="checksum")) == len(CONVS)
    r = verify(bad, "tiny-llama", samples=0, model=tiny)
    assert r["bad_samples"] == [1, 4] and {(1, "input_ids"), (4, "input_ids"), (1, "aux")} <= \
        _bad(r), r
    assert main(["verify", str(bad), "--target", "tiny-llama", "--samples", "0",
                 "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert "samples [1, 4] disagree in" in out and "input_ids" in out
    assert json.loads((tmp_path / "r.json").read_text())["bad_samples"] == [1, 4]


def test_dataset_of_another_target_fails(tmp_path, tokens_dir, tiny, clean):
    """Another random tiny Llama of the same shape: the fingerprint differs, and so do the
    values even when the manifest is edited to claim the right target."""
    other = build_random_target("tiny-llama", seed=1)
    other.save_pretrained(tmp_path / "other")
    load_tokenizer("tiny-llama").save_pretrained(tmp_path / "other")
    extract(tokens_dir, str(tmp_path / "other"), tmp_path / "hid", model=other, teacher="both",
            topk=4, shard_tokens=80)
    r = verify(tmp_path / "hid", "tiny-llama", samples=2, model=tiny)
    ident = {it["check"]: it["ok"] for it in r["identity"]}
    assert not r["ok"] and ident["fingerprint"] is False and ident["name"] is None, r
    assert len(r["bad_samples"]) == 2 and "aux" in r["bad_fields"]
    m = json.loads((tmp_path / "hid" / "manifest.json").read_text())
    m.update({k: json.loads((clean / "manifest.json").read_text())[k]
              for k in ("target", "target_fingerprint", "target_config")})
    (tmp_path / "hid" / "manifest.json").write_text(json.dumps(m))
    r = verify(tmp_path / "hid", "tiny-llama", samples=2, model=tiny)
    assert all(it["ok"] is not False for it in r["identity"])
    assert not r["ok"] and len(r["bad_samples"]) == 2 and "aux" in r["bad_fields"]


def test_fp8_dataset_passes_within_its_bound(tmp_path, tokens_dir, tiny, clean):
    extract(tokens_dir, "tiny-llama", tmp_path / "fp8", model=tiny, aux_format="fp8",
            teacher="both", topk=4, shard_tokens=80)
    r = verify(tmp_path / "fp8", "tiny-llama", samples=0, model=tiny, compute_tol=0)
    assert r["ok"] and r["aux_format"] == "fp8", r
    aux = [row for row in r["rows"] if row["field"] == "aux"]
    assert all(row["max_abs_err"] > 0 for row in aux)          # the bound is needed ...
    fp8, exact = open_dataset(tmp_path / "fp8")[0]["aux"], open_dataset(clean)[0]["aux"]
    assert not state_check("aux", fp8, exact, "bf16", 0)["ok"]  # ... and bf16's is too tight
    assert state_check("aux", fp8, exact, "fp8", 0)["ok"]


def test_usage_errors_exit_2(tokens_dir, capsys):
    assert main(["verify", str(tokens_dir), "--target", "tiny-llama"]) == 2
    assert "no hidden states to verify" in capsys.readouterr().err



def test_padded_batches_and_rounding_level_differences_pass_within_the_compute_tolerance(
        tmp_path, tokens_dir, tiny, clean):
    """A padded forward (pad_batches) may round differently from the unpadded re-run: errors on
    the scale of the row's rms, beyond bf16's relative bound on small entries. The padded
    extraction passes with the default compute tolerance; so do aux states shifted by 2^-7 of
    their row's rms, which the storage bound alone (compute_tol=0) rejects."""
    extract(tokens_dir, "tiny-llama", tmp_path / "pad", model=tiny, teacher="both", topk=4,
            pad_batches=True, shard_tokens=1000)
    assert verify(tmp_path / "pad", "tiny-llama", samples=0, model=tiny)["ok"]
    shards = _by_shard(open_dataset(clean))
    for sample in (s for shard in shards for s in shard):
        aux = sample["aux"].float()
        shift = 2 ** -7 * aux.pow(2).mean(-1, keepdim=True).sqrt()
        sample["aux"] = (aux + shift).to(sample["aux"].dtype)
    shifted = _rewrite(clean, tmp_path / "shifted", shards)
    r = verify(shifted, "tiny-llama", samples=0, model=tiny)
    assert r["ok"] and all(row["max_abs_err"] > 0 for row in r["rows"] if row["field"] == "aux")
    assert _bad(verify(shifted, "tiny-llama", samples=0, model=tiny, compute_tol=0)) == {
        (i, "aux") for i in range(len(CONVS))}
