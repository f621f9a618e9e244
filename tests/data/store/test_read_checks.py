"""First-read checks of the packed loader on real corrupted shard files: one flipped bit in the
stored aux states, NaN/inf rows (raise or skip), and a truncated shard in `eyas inspect`."""

import subprocess
import sys

import pytest
import torch

from eyas.data.store.format import DatasetError, parse_header
from eyas.data.store.loader import PackedLoader
from eyas.data.store.shards import open_dataset, shard_name, write_manifest, write_shard

from tests.data.store.test_loader import check_batch, make_dataset


def _flip_bit(path, tensor, row, byte=0, bit=0):
    """Flip one bit of `tensor`'s row `row` inside the shard file itself."""
    e = parse_header(path).tensors[tensor]
    off = e.begin + row * (e.nbytes // e.shape[0]) + byte
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)[0]
        f.seek(off)
        f.write(bytes([b ^ (1 << bit)]))


def _all_batches(ds, budget=64, workers=1):
    return [b for b in PackedLoader(ds, budget, 0, 1, seed=0, num_workers=workers)]


@pytest.mark.parametrize("aux_format", ["bf16", "fp8"])
def test_one_flipped_bit_in_aux_is_named_on_first_read(tmp_path, aux_format):
    make_dataset(tmp_path, [[5, 7, 6], [9, 4, 8]], aux_format=aux_format)
    # sample 4 = shard 1, local 1 (rows 9..12): one bit of one aux value
    _flip_bit(tmp_path / shard_name(1), "aux", 10, byte=3, bit=2)
    unchecked = open_dataset(tmp_path)
    assert len(_all_batches(unchecked)) > 0          # what training read before: no error
    ds = open_dataset(tmp_path)
    ds.enable_read_checks()
    with pytest.raises(DatasetError, match="checksum mismatch in shard-local sample 1") as e:
        _all_batches(ds)
    assert e.value.path.name == shard_name(1) and e.value.sample == 4
    # the same bit is caught by the full scan (the two checks agree)
    with pytest.raises(DatasetError, match="checksum mismatch") as e2:
        open_dataset(tmp_path, verify="checksum")
    assert e2.value.sample == 4


def test_checks_pass_clean_data_and_batches_are_exact(tmp_path):
    ds, _ = make_dataset(tmp_path, [[5, 7, 6], [9, 4, 80]])   # 80 > budget: truncated read
    ds.enable_read_checks()
    loader = PackedLoader(ds, 64, 0, 1, seed=0, num_workers=2)
    for epoch in range(2):                                    # second epoch: nothing re-checked
        plan, batches = loader.plan(epoch), list(loader)
        assert len(batches) == len(plan) > 1
        assert sorted(i for docs in plan for i in docs) == list(range(len(ds)))
        for docs, b in zip(plan, batches, strict=True):
            check_batch(b, docs, ds, 64)
    assert loader.epoch == 2
    assert ds.num_shards == 2 and sorted(ds.read_checks._done) == [0, 1]   # every shard checked
    assert all(d.all() for d in ds.read_checks._done.values())


def test_flipped_bit_in_crc_table_is_named(tmp_path):
    make_dataset(tmp_path, [[5, 7, 6]])
    _flip_bit(tmp_path / shard_name(0), "sample_crc32", 2, byte=1)
    ds = open_dataset(tmp_path)
    ds.enable_read_checks()
    with pytest.raises(DatasetError, match="checksum table") as e:
        _all_batches(ds)
    assert e.value.path.name == shard_name(0)


def _nan_shards(root):
    ds, samples = make_dataset(root, [[5, 7, 6, 4]])
    samples = [dict(s) for s in samples]
    samples[1]["aux"] = samples[1]["aux"].clone()
    samples[1]["aux"][3, 2, 1] = float("nan")
    samples[3]["last"] = samples[3]["last"].clone()
    samples[3]["last"][0, 0] = float("-inf")
    meta = write_shard(root, 0, samples, check_finite=False)
    write_manifest(root, {"kind": "hidden"}, [meta])
    return open_dataset(root)


def test_nonfinite_rows_raise_naming_file_sample_and_token(tmp_path):
    ds = _nan_shards(tmp_path)
    ds.enable_read_checks(checksum=True, nonfinite="error")
    with pytest.raises(DatasetError, match=r"'aux' has NaN/inf values \(shard-local sample 1, "
                                           r"token 3\).*data.nonfinite=skip") as e:
        [b for b in PackedLoader(ds, 64, 0, 1, seed=0, shuffle=False, num_workers=0)]
    assert e.value.path.name == shard_name(0) and e.value.sample == 1


def test_nonfinite_skip_leaves_the_samples_out_and_counts_them(tmp_path, caplog):
    ds = _nan_shards(tmp_path)
    checks = ds.enable_read_checks(nonfinite="skip")
    loader = PackedLoader(ds, 64, 0, 1, seed=0, shuffle=False, num_workers=0)
    with caplog.at_level("WARNING"):
        batches = [b for b in loader]
    assert [s["sample"] for s in checks.skipped] == [1, 3]
    assert sum(f"{shard_name(0)} (sample 1)" in r.getMessage() for r in caplog.records) == 1
    (b,) = batches
    assert b.num_tokens == 5 + 6 and torch.isfinite(b.aux.float()).all()
    (docs,) = loader.plan(0)
    kept = [i for i in docs if i not in (1, 3)]
    check_batch(b, kept, open_dataset(tmp_path), 64)    # the kept samples, packed back to back
    again = [b for b in loader]                                   # known bad: not read again
    assert len(checks.skipped) == 2 and torch.equal(again[0].aux, b.aux)


def test_inspect_reports_a_truncated_shard(tmp_path):
    make_dataset(tmp_path, [[5, 7], [6, 4]])
    path = tmp_path / shard_name(1)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 100])
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", "inspect", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert shard_name(1) in r.stderr and "truncated" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
