"""Training on real damaged files: a flipped bit in a shard, stored NaN/inf rows, an eval set
of other aux layers, and checkpoints whose bytes changed (resume checks their SHA-256)."""

import json
import shutil
from pathlib import Path

import pytest

from eyas.data.store.format import parse_header
from eyas.data.common.checksums import CHECKSUMS_NAME
from eyas.data.store.shards import open_dataset, shard_name, write_manifest, write_shard
from eyas.models.serving.contract import ExportError
from eyas.models.serving.export import export_checkpoint
from eyas.train import checkpoint as ckpt

from tests.train.test_trainer import run


def _err(r) -> str:
    """The one-line error a failed run ends with (the last stderr line)."""
    return r.stderr.strip().splitlines()[-1]


def _flip(path: Path, offset: int, mask: int = 0x04) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


@pytest.mark.slow
def test_a_flipped_bit_in_a_shard_stops_training_naming_file_and_sample(tmp_path,
                                                                        tiny_llama_dataset):
    data = shutil.copytree(tiny_llama_dataset, tmp_path / "d")
    shard = data / shard_name(1)
    e = parse_header(shard).tensors["aux"]
    ds = open_dataset(data)
    lo = int(ds.shard(1).offsets[3])                         # shard 1, local sample 3 = 19
    _flip(shard, e.begin + (lo + 1) * (e.nbytes // e.shape[0]) + 5)
    r = run(tmp_path / "r", data, "target=tiny_llama", "train.max_steps=30", check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{shard} (sample 19): checksum mismatch in shard-local sample 3" in _err(r)
    run(tmp_path / "off", data, "target=tiny_llama", "train.max_steps=2", "data.verify=false")


@pytest.fixture(scope="module")
def some_nan_dataset(tmp_path_factory, tiny_llama_dataset):
    """The tiny dataset with NaN/inf aux states in samples 3, 10 and 17."""
    src = open_dataset(tiny_llama_dataset)
    out = tmp_path_factory.mktemp("hs") / "some-nan"
    samples = [{k: v.clone() for k, v in src[i].items()} for i in range(len(src))]
    samples[3]["aux"][2, 0, 5] = float("nan")
    samples[10]["aux"][0, 2, 1] = float("inf")
    samples[17]["last"][4, 3] = float("nan")
    metas = [write_shard(out, j, samples[j * 16:(j + 1) * 16], check_finite=False)
             for j in range(2)]
    write_manifest(out, dict(src.manifest), metas)
    return out


@pytest.mark.slow
def test_stored_nan_raises_naming_file_and_sample(tmp_path, some_nan_dataset):
    r = run(tmp_path / "r", some_nan_dataset, "target=tiny_llama", "train.max_steps=30",
            check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    line = _err(r)
    assert "has NaN/inf values (shard-local sample" in line and "data.nonfinite=skip" in line
    assert any(f"{some_nan_dataset / name} (sample {i})" in line
               for name, i in ((shard_name(0), 3), (shard_name(0), 10), (shard_name(1), 17)))
    assert "optimizer step(s) skipped" not in r.stderr


@pytest.mark.slow
def test_stored_nan_skip_leaves_the_samples_out_and_counts_them(tmp_path, some_nan_dataset):
    r = run(tmp_path / "r", some_nan_dataset, "target=tiny_llama", "train.max_steps=30",
            "data.nonfinite=skip")
    for name, i in ((shard_name(0), 3), (shard_name(0), 10), (shard_name(1), 17)):
        assert f"left out {some_nan_dataset / name} (sample {i})" in r.stderr
    assert "left out 3 sample(s)" in r.stderr
    assert "optimizer step(s) skipped" not in r.stderr
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["skipped_samples"] == 3


def test_eval_dataset_with_other_aux_layers_is_refused(tmp_path, tiny_llama_dataset):
    other = shutil.copytree(tiny_llama_dataset, tmp_path / "other")
    man = json.loads((other / "manifest.json").read_text())
    ids = man["aux_layer_ids"]
    man["aux_layer_ids"] = [ids[0], ids[1] - 1, ids[2]]
    (other / "manifest.json").write_text(json.dumps(man))
    r = run(tmp_path / "r", tiny_llama_dataset, "target=tiny_llama", "train.max_steps=2",
            f"data.eval_dataset={other}", check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    line = _err(r)
    assert f"data.eval_dataset={other} has aux_layer_ids={man['aux_layer_ids']}" in line
    assert f"data.dataset={tiny_llama_dataset} has {ids}" in line


@pytest.mark.slow
def test_resume_checks_the_checkpoints_sha256(tmp_path, tiny_llama_dataset):
    base = ("target=tiny_llama", "train.save_every=2", "train.keep_last=5")
    run(tmp_path / "r", tiny_llama_dataset, *base, "train.max_steps=4")
    ckpts = tmp_path / "r" / "checkpoints"
    step4 = ckpts / "step-000004"
    listed = (step4 / CHECKSUMS_NAME).read_text()
    assert "model.safetensors" in listed and "eyas.json" in listed and "eyas_state.json" in listed
    ckpt.verify(step4)
    state = json.loads((step4 / ckpt.STATE_FILE).read_text())
    assert state["schedule"]["last_epoch"] == 4               # the LR schedule, in eyas's state
    old = shutil.copytree(step4, tmp_path / "old")            # as an older eyas wrote it
    (old / CHECKSUMS_NAME).unlink()
    del state["schedule"]
    (old / ckpt.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ckpt.CheckpointError, match=f"{old}: its eyas_state.json has no "
                                                   f"learning-rate schedule"):
        ckpt.load(None, old, {})
    model = step4 / "model.safetensors"
    good = model.read_bytes()
    _flip(model, len(good) // 2)
    resume = (*base, "train.max_steps=6", "train.resume=latest")
    r = run(tmp_path / "r", tiny_llama_dataset, *resume, check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"refusing to resume from {step4}: {model}: SHA-256 differs" in _err(r)
    with pytest.raises(ExportError, match=f"{step4} is damaged: {model}: SHA-256 differs"):
        export_checkpoint(ckpts, tmp_path / "x")             # `eyas export` refuses it too
    model.write_bytes(good[:-1000])                          # truncated: also named
    with pytest.raises(ckpt.CheckpointError, match=f"{model}: SHA-256 differs"):
        ckpt.verify(step4)
    (step4 / CHECKSUMS_NAME).unlink()                         # older checkpoint, no SHA256SUMS
    r = run(tmp_path / "r", tiny_llama_dataset, *resume, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"refusing to resume from {step4}: its state does not load" in _err(r)
    assert not (ckpts / "step-000006").exists()
    shutil.rmtree(step4)                                     # latest names a missing checkpoint
    with pytest.raises(ckpt.CheckpointError, match="train.resume=latest: .*step-000004"):
        ckpt.resolve_resume("latest", ckpts)
