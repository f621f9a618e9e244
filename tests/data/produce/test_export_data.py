"""`eyas export-data --format speculators`: a real tiny extraction (tiny-llama with a random
final norm weight) exported and read back, once with safetensors / torch.load / numpy against
the eyas samples, once with speculators' own `ArrowDataset` (speculators/train/data.py at the
pinned commit c05b95b3).

Where speculators comes from: `$EYAS_SPECULATORS_SRC` (a folder holding the `speculators` and
`hs_connectors` packages), else `.peers/sp` of the checkout, else `sp/` of
`../shared/peers/peers.tgz`, extracted into a temporary folder. Its trainer reads the rows with
`datasets.load_from_disk`, so that test (and the rows part of the others) needs the `datasets`
package; without it the exporter's rows writer is replaced and everything else is checked.
"""

import json
import os
import shutil
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.data.produce import export_data
from eyas.data.produce.export_data import export_speculators
from eyas.data.produce.extract import extract
from eyas.data.produce.outdir import WrongDirectory
from eyas.data.produce.prepare import prepare
from eyas.data.produce.vocab import build_vocab, save_vocab
from eyas.data.common.deps import MissingDependency
from eyas.data.common.log import run_command
from eyas.data.common.targets import load_target_config, load_tokenizer, resolve_target
from eyas.data.store.format import DatasetError
from eyas.data.store.shards import open_dataset, write_manifest, write_shard
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "export-data")

ROOT = Path(__file__).resolve().parents[3]
TH = 64                       # tiny-llama's hidden size
CONVS = [
    [("Name a fruit.", "Apple.")],
    [("What is 2+2?", "4."), ("And 3+3?", "6.")],
    [("Hi", "Hello! How can I help?")],
    [("Say something short.", "Short.")],
    [("Count to three.", "One, two, three.")],
]

pytestmark = pytest.mark.usefixtures("one_thread")


def _datasets():
    try:
        import datasets
    except Exception:
        return None
    return datasets


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """tiny-llama with a random final norm weight (all ones would hide a missing division)."""
    out = tmp_path_factory.mktemp("target") / "tiny-llama"
    shutil.copytree(resolve_target("tiny-llama"), out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    weights["model.norm.weight"] = (torch.rand(TH, generator=gen) + 0.5).bfloat16()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_conversations(path, convs=CONVS):
    """Conversations of (user, assistant) turns as OpenAI `messages` JSONL (what `eyas prepare
    --input` reads)."""
    with open(path, "w") as f:
        for turns in convs:
            msgs = [m for u, a in turns for m in ({"role": "user", "content": u},
                                                  {"role": "assistant", "content": a})]
            f.write(json.dumps({"messages": msgs}) + "\n")


@pytest.fixture(scope="module")
def hidden(tmp_path_factory, target_dir):
    """A real hidden-state dataset: prepare + extract (teacher both) on the target above."""
    root = tmp_path_factory.mktemp("export")
    write_conversations(root / "conv.jsonl")
    prepare(root / "conv.jsonl", str(target_dir), root / "tokens",
            tokenizer=load_tokenizer(target_dir), shard_samples=2)
    extract(root / "tokens", str(target_dir), root / "hidden", teacher="both", topk=4,
            shard_tokens=70)
    return root / "hidden"


@pytest.fixture
def rows(monkeypatch):
    """The `datasets` module, or None after replacing the rows writer (datasets absent)."""
    ds = _datasets()
    if ds is None:
        monkeypatch.setattr(export_data, "_require_datasets", lambda: None)
        monkeypatch.setattr(export_data, "write_rows", lambda tmp, root, n: None)
    return ds


def _norm(x, w, eps):
    """transformers' LlamaRMSNorm, which speculators' verifier_norm is (weight: model.norm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w.float() * h.to(x.dtype)


def _norm_weight(target_dir):
    eps = load_target_config(target_dir)["rms_norm_eps"]
    return load_file(target_dir / "model.safetensors")["model.norm.weight"], eps


def test_export_files_hold_the_dataset(hidden, target_dir, tmp_path, rows):
    ds = open_dataset(hidden)
    assert ds.num_shards > 1 and "last" in ds.fields
    d2t, t2d = build_vocab(ds, 40)
    save_vocab(tmp_path / "vocab.safetensors", d2t, t2d)
    out = tmp_path / "spec"
    r = export_speculators(hidden, out, vocab=tmp_path / "vocab.safetensors")
    assert (r["n_samples"], r["n_tokens"], r["draft_vocab_size"]) == (
        len(ds), ds.num_tokens, 40)
    assert json.loads((out / "eyas_export.json").read_text()) == r
    assert r["aux_layer_ids"] == [2, 4, 5] and r["target"] == str(target_dir)
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(len(ds)))
    w, eps = _norm_weight(target_dir)
    freq = Counter()
    for i in range(len(ds)):
        s = ds[i]
        f = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert sorted(f) == ["hidden_states", "token_ids"]
        T = len(s["input_ids"])
        assert f["token_ids"].dtype == torch.int64 and torch.equal(f["token_ids"], s["input_ids"])
        hs = f["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (T, 4, TH)
        assert torch.equal(hs[:, :3], s["aux"])          # HF hidden_states[2], [4], [5]
        assert torch.equal(hs[:, :-1].flatten(1)[:, TH:2 * TH], s["aux"][:, 1])
        assert torch.equal(hs[:, 3], (s["last"].float() / w.float()).bfloat16())
        torch.testing.assert_close(_norm(hs[:, 3], w, eps), s["last"].float(),
                                   rtol=2**-7, atol=2**-7 * float(s["last"].abs().max()))
        freq.update(s["input_ids"][s["loss_mask"]].tolist())
    assert torch.load(out / "token_freq.pt", weights_only=True) == dict(freq)
    d2t_np, t2d_np = np.load(out / "d2t.npy"), np.load(out / "t2d.npy")
    assert (d2t_np.dtype, t2d_np.dtype) == (np.int64, np.bool_)
    assert np.array_equal(d2t_np, d2t.numpy()) and np.array_equal(t2d_np, t2d.numpy())
    if rows is None:
        return
    data = rows.load_from_disk(str(out))
    assert len(data) == len(ds) and data.format["type"] == "torch"
    for i in range(len(ds)):
        s, row = ds[i], data[i]
        assert row["input_ids"].dtype == row["loss_mask"].dtype == torch.int64
        assert torch.equal(row["input_ids"], s["input_ids"])
        assert torch.equal(row["loss_mask"], s["loss_mask"].long())
        assert int(row["seq_len"]) == len(s["input_ids"])


def _peer_source(tmp_dir: Path) -> Path | None:
    """A folder holding speculators and hs_connectors at the pinned commit, or None."""
    for d in (os.environ.get("EYAS_SPECULATORS_SRC"), ROOT / ".peers" / "sp"):
        if d and (Path(d) / "speculators" / "train" / "data.py").is_file():
            return Path(d)
    archive = ROOT.parent / "shared" / "peers" / "peers.tgz"
    if not archive.is_file():
        return None
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["sp"]
                   and (m.isfile() or m.isdir())]
        try:
            tar.extractall(tmp_dir, members=members, filter="data")
        except TypeError:                   # a Python without extraction filters
            tar.extractall(tmp_dir, members=members)
    found = list(tmp_dir.glob("*/sp"))
    return found[0] if found else None


@pytest.fixture
def speculators(tmp_path_factory):
    """speculators.train.data and the eagle3 shift_batch, imported from the peer source (its
    stand-ins for `openai` and `datasets` come after the real packages on sys.path)."""
    if _datasets() is None:
        pytest.skip("speculators' ArrowDataset reads with datasets.load_from_disk: "
                    "pip install 'datasets>=4' to run this test")
    src = _peer_source(tmp_path_factory.mktemp("peers"))
    if src is None:
        pytest.skip("no speculators source: set EYAS_SPECULATORS_SRC, or extract "
                    "../shared/peers/peers.tgz into .peers")
    before, path = set(sys.modules), list(sys.path)
    sys.path.append(str(src))
    try:
        import speculators.train.data as data
        from speculators.models.eagle3.data import shift_batch
        assert Path(data.__file__).is_relative_to(src), data.__file__
        yield data, shift_batch
    finally:            # forget the peer's modules (and its stand-ins), keep the rest
        sys.path[:] = path
        for name in set(sys.modules) - before:
            f = getattr(sys.modules[name], "__file__", None)
            if f and Path(f).is_relative_to(src):
                del sys.modules[name]


def test_speculators_reads_the_export(hidden, target_dir, tmp_path, speculators):
    data, shift_batch = speculators
    out = tmp_path / "spec"
    export_speculators(hidden, out)
    ds, (w, eps) = open_dataset(hidden), _norm_weight(target_dir)
    loaded = data.ArrowDataset(max_len=512, datapath=str(out), on_missing="raise",
                               train_ratio=1.0)
    assert len(loaded) == len(ds) and loaded.approx_lengths == ds.sample_lengths.tolist()
    for i in range(len(ds)):
        s, b = ds[i], loaded[i]
        assert torch.equal(b["input_ids"], s["input_ids"])
        assert torch.equal(b["hidden_states"], s["aux"].flatten(1))    # [T, 3*tH], a < b < c
        assert torch.equal(b["loss_mask"].bool(), s["loss_mask"]) and b["loss_mask"].sum() > 0
        torch.testing.assert_close(_norm(b["verifier_last_hidden_states"], w, eps),
                                   s["last"].float(), rtol=2**-7,
                                   atol=2**-7 * float(s["last"].abs().max()))
    val = data.ArrowDataset(max_len=512, datapath=str(out), on_missing="raise",
                            train_ratio=0.6, split="val")           # rows 3, 4 -> hs_3, hs_4
    assert torch.equal(val[1]["hidden_states"], ds[4]["aux"].flatten(1))
    batch = data.CollateFn(512, TH, preprocess=shift_batch)([loaded[0], loaded[1]])
    n = len(ds[0]["input_ids"]) + len(ds[1]["input_ids"]) - 2
    assert batch["hidden_states"].shape == (1, 512, 3 * TH)
    assert torch.equal(batch["input_ids"][0, :n], torch.cat(
        [ds[0]["input_ids"][1:], ds[1]["input_ids"][1:]]))


def _synthetic(root, teacher, *, last=True, last_conv="post_norm"):
    gen = torch.Generator().manual_seed(7)
    samples = []
    for T in (4, 6):
        s = {"input_ids": torch.randint(0, 49152, (T,), generator=gen),
             "loss_mask": torch.tensor([0, 1] * (T // 2)).bool(),
             "aux": torch.randn(T, 3, TH, generator=gen).bfloat16()}
        if last:
            s["last"] = (torch.randn(T, TH, generator=gen) * 4).bfloat16()
        else:
            s["topk_ids"] = torch.randint(0, 49152, (T, 4), generator=gen)
            s["topk_logits"] = torch.randn(T, 4, generator=gen)
        samples.append(s)
    write_manifest(root, {"kind": "hidden", "target": "tiny-llama", "aux_layer_ids": [2, 4, 5],
                          "convention": "hf_hidden_states", "hidden_size": TH,
                          "teacher": {"kind": teacher, "last": last_conv if last else None}},
                   [write_shard(root, 0, samples)])
    return samples


def test_refuses_a_dataset_without_the_last_state(tmp_path, capsys):
    _synthetic(tmp_path / "topk", "topk", last=False)
    with pytest.raises(DatasetError, match=r"no 'last' field \(teacher 'topk'\).*Fix: re-extract "
                                           r"with `eyas extract --teacher last`"):
        export_speculators(tmp_path / "topk", tmp_path / "out")
    rc = run_command("eyas export-data", cli_main, [str(tmp_path / "topk"), str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"eyas export-data: {tmp_path / 'topk'}: no 'last' field")
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_pre_norm_last_is_copied_and_a_wrong_norm_refused(tmp_path, rows):
    ref = _synthetic(tmp_path / "pre", "last", last_conv="pre_norm")
    export_speculators(tmp_path / "pre", tmp_path / "out", num_samples=1)
    assert sorted(os.listdir(tmp_path / "out" / "hidden_states")) == ["hs_0.safetensors"]
    hs = load_file(tmp_path / "out" / "hidden_states" / "hs_0.safetensors")["hidden_states"]
    assert torch.equal(hs[:, 3], ref[0]["last"]) and torch.equal(hs[:, :3], ref[0]["aux"])
    _synthetic(tmp_path / "post", "last")     # random "last": no norm's output
    with pytest.raises(DatasetError, match=r"sample 0\): token 0: last / the final norm weight "
                                           r"of target 'tiny-llama' has RMS .*--target MODEL"):
        export_speculators(tmp_path / "post", tmp_path / "o2")
    assert not (tmp_path / "o2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_out_directory_rules(hidden, tmp_path, rows):
    out = tmp_path / "spec"
    out.mkdir()                                       # an empty OUT is fine
    export_speculators(hidden, out, num_samples=2)
    with pytest.raises(WrongDirectory, match=r"is not empty .* pass --overwrite"):
        export_speculators(hidden, out)
    r = export_speculators(hidden, out, overwrite=True, num_samples=3)
    assert r["n_samples"] == 3 and len(os.listdir(out / "hidden_states")) == 3
    (out / "notes.txt").write_text("mine")
    with pytest.raises(WrongDirectory, match=r"--overwrite would delete .*\(notes.txt\)"):
        export_speculators(hidden, out, overwrite=True)
    with pytest.raises(WrongDirectory, match="is \\(or holds\\) the dataset being exported"):
        export_speculators(hidden, hidden.parent, overwrite=True)
    with pytest.raises(ValueError, match="--num-samples must be >= 1"):
        export_speculators(hidden, tmp_path / "n0", num_samples=0)


def test_without_datasets_nothing_is_written(hidden, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)          # import datasets fails
    with pytest.raises(MissingDependency, match=r"^--format speculators needs the datasets "
                                                r"package.*Fix: pip install 'datasets>=4'$"):
        export_speculators(hidden, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == []
