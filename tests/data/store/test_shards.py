"""Shard writer/reader: round trips, zero-copy views, fp8 bound, atomicity."""

import json
import re

import numpy as np
import pytest
import safetensors.torch
import torch

from eyas import data
from eyas.data.store import shards
from eyas.data.store.format import MANIFEST_NAME
from eyas.data.store.shards import (DatasetError, open_dataset, read_shard_meta, shard_name, write_manifest,
                         write_shard)

TH = 16  # target hidden size (real: 4096 for Llama-3.1-8B)


def make_sample(T, gen, *, tH=TH, k=4, teacher=("last", "topk"), extra=False):
    s = {"input_ids": torch.randint(0, 49152, (T,), generator=gen),
         "loss_mask": torch.rand(T, generator=gen) > 0.4,
         "aux": (torch.randn(T, 3, tH, generator=gen) * 3).bfloat16(),
         "target_argmax": torch.randint(0, 49152, (T,), generator=gen)}
    if "last" in teacher:
        s["last"] = torch.randn(T, tH, generator=gen).bfloat16()
    if "topk" in teacher:
        s["topk_ids"] = torch.randint(0, 49152, (T, k), generator=gen)
        s["topk_logits"] = torch.randn(T, k, generator=gen)
    if extra:
        s["weights"] = torch.rand(T, 2, generator=gen, dtype=torch.float64)
    return s


def write_dataset(root, shard_lengths, *, aux_format="bf16", seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    samples, metas = [], []
    for i, lengths in enumerate(shard_lengths):
        ss = [make_sample(T, gen, **kw) for T in lengths]
        metas.append(write_shard(root, i, ss, aux_format=aux_format))
        samples += ss
    write_manifest(root, {"kind": "hidden", "target": "tiny-llama",
                          "aux_layer_ids": [2, 4, 5], "convention": "hf_hidden_states"}, metas)
    return samples, metas


def test_round_trip_every_field_bf16(tmp_path):
    samples, _ = write_dataset(tmp_path, [[5, 9, 1], [7], [3, 4]], extra=True)
    ds = open_dataset(tmp_path, verify="checksum")
    assert len(ds) == 6 and ds.num_shards == 3
    assert ds.sample_lengths.tolist() == [5, 9, 1, 7, 3, 4]
    assert ds.num_tokens == 29 and ds.manifest["n_tokens"] == 29
    want_dtypes = {"input_ids": torch.int64, "loss_mask": torch.bool, "aux": torch.bfloat16,
                   "last": torch.bfloat16, "target_argmax": torch.int64,
                   "topk_ids": torch.int64, "topk_logits": torch.float32, "weights": torch.float64}
    for i, ref in enumerate(samples):
        got = ds[i]
        assert set(got) == set(ref)
        for name, t in ref.items():
            assert got[name].dtype == want_dtypes[name], name
            assert torch.equal(got[name], t.to(want_dtypes[name])), (i, name)
    assert torch.equal(ds[-1]["aux"], samples[-1]["aux"])
    with pytest.raises(IndexError):
        ds[6]


def test_tokens_dataset(tmp_path):
    gen = torch.Generator().manual_seed(1)
    ss = [{"input_ids": torch.randint(0, 100, (n,), generator=gen),
           "loss_mask": torch.randint(0, 2, (n,), generator=gen)} for n in (4, 6)]
    meta = write_shard(tmp_path, 0, ss)
    assert meta["fields"]["input_ids"]["stored_dtype"] == "int32"
    assert meta["aux_format"] is None
    write_manifest(tmp_path, {"kind": "tokens"}, [meta])
    ds = open_dataset(tmp_path)
    assert ds.kind == "tokens" and set(ds[1]) == {"input_ids", "loss_mask"}
    assert torch.equal(ds[1]["loss_mask"], ss[1]["loss_mask"].bool())
    with pytest.raises(DatasetError, match="kind 'hidden' needs an 'aux' field"):
        write_manifest(tmp_path, {"kind": "hidden"}, [meta])


def test_fp8_round_trip_within_bound(tmp_path):
    samples, metas = write_dataset(tmp_path / "fp8", [[6, 11]], aux_format="fp8")
    _, metas16 = write_dataset(tmp_path / "bf16", [[6, 11]])
    assert metas[0]["fields"]["aux"]["stored_dtype"] == "float8_e4m3fn"
    # aux payload halves: 3*tH bytes per token fewer, plus a 12-byte fp32 scale per token
    from eyas.data.store.format import parse_header
    payload = {fmt: {n: e.nbytes for n, e in parse_header(tmp_path / fmt / shard_name(0))
                     .tensors.items()} for fmt in ("fp8", "bf16")}
    T = 17
    assert payload["bf16"]["aux"] == 6 * TH * T and payload["fp8"]["aux"] == 3 * TH * T
    assert payload["fp8"]["aux_scale"] == 12 * T
    ds = open_dataset(tmp_path / "fp8", verify="checksum")
    for i, ref in enumerate(samples):
        got = ds[i]["aux"]
        assert got.dtype == torch.bfloat16 and got.shape == ref["aux"].shape
        x = ref["aux"].float()
        scale = x.abs().amax(-1, keepdim=True) / 448
        # documented bound (FORMAT.md): e4m3 rounding + final bf16 rounding
        bound = x.abs() * (2**-4 + 2**-8 + 2**-12) + scale * 2**-10 * (1 + 2**-8)
        err = (got.float() - x).abs()
        assert (err <= bound).all(), float((err - bound).max())
        assert err.max() > 0   # it really is quantised
        assert torch.equal(ds[i]["last"], ref["last"])  # only aux is fp8


def test_zero_copy_views(tmp_path):
    write_dataset(tmp_path, [[5, 8]])
    ds = open_dataset(tmp_path)
    s = ds[1]
    base = ds.shard(0).base
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
    for name in ("aux", "last", "loss_mask", "topk_logits"):
        t = s[name]
        assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi, name
        assert t.untyped_storage().data_ptr() == lo  # a view of the mapping, not a copy
    assert s["aux"].shape == (8, 3, TH)
    # the mapping is copy-on-write: writing a view never changes the file
    before = (tmp_path / shard_name(0)).read_bytes()
    s["aux"].fill_(7)
    assert (tmp_path / shard_name(0)).read_bytes() == before
    # views outlive the shard cache entry
    ds._cache.clear()
    import gc
    gc.collect()
    assert bool((s["aux"] == 7).all())


def test_shard_meta_from_file_alone(tmp_path):
    _, metas = write_dataset(tmp_path, [[3, 4], [5]])
    for m in metas:
        assert read_shard_meta(tmp_path / m["file"]) == m
    assert metas[0]["sample_lengths"] == [3, 4] and metas[1]["n_tokens"] == 5
    # write_manifest can rebuild the metas from the files
    (tmp_path / MANIFEST_NAME).unlink()
    man = write_manifest(tmp_path, {"kind": "hidden"})
    assert [s["checksum"] for s in man["shards"]] == [m["checksum"] for m in metas]


def test_open_reads_no_shard(tmp_path):
    write_dataset(tmp_path, [[2]] * 20)
    (tmp_path / shard_name(7)).write_bytes(b"garbage")  # unread until accessed
    ds = open_dataset(tmp_path)
    assert len(ds) == 20 and ds.sample_lengths.sum() == 40 and not ds._cache
    ds[0]
    assert list(ds._cache) == [0]
    with pytest.raises(DatasetError, match=shard_name(7)):
        ds[7]


def test_load_sample_cached(tmp_path):
    samples, _ = write_dataset(tmp_path, [[3, 4]])
    got = data.load_sample(tmp_path, 1)
    assert torch.equal(got["aux"], samples[1]["aux"])
    assert data.open_cached(tmp_path) is data.open_cached(str(tmp_path))


# ---- errors on real corrupted files --------------------------------------------------------

def test_truncated_shard(tmp_path):
    write_dataset(tmp_path, [[4, 4]])
    p = tmp_path / shard_name(0)
    p.write_bytes(p.read_bytes()[:-10])
    ds = open_dataset(tmp_path)
    with pytest.raises(DatasetError, match="truncated") as e:
        ds[0]
    assert e.value.path == p
    with pytest.raises(DatasetError, match="truncated"):
        read_shard_meta(p)
    p.write_bytes(b"\x01\x02")
    with pytest.raises(DatasetError, match="too short"):
        read_shard_meta(p)


def test_garbled_header(tmp_path):
    write_dataset(tmp_path, [[4]])
    p = tmp_path / shard_name(0)
    raw = bytearray(p.read_bytes())
    raw[12:20] = b"\x00{{{{]]]"
    p.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match="garbled") as e:
        open_dataset(tmp_path, verify="header")
    assert str(p) in str(e.value)
    raw[0:8] = (10**12).to_bytes(8, "little")
    p.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match="header length"):
        read_shard_meta(p)


def test_flipped_byte_fails_checksum_naming_sample(tmp_path):
    samples, metas = write_dataset(tmp_path, [[4, 6, 5]])
    open_dataset(tmp_path, verify="checksum")  # clean
    p = tmp_path / shard_name(0)
    ds = open_dataset(tmp_path)
    aux_entry = ds.shard(0).header.tensors["aux"]
    row = aux_entry.nbytes // 15
    raw = bytearray(p.read_bytes())
    raw[aux_entry.begin + 7 * row + 3] ^= 0x40      # token 7 lies in sample 1 (tokens 4..9)
    p.write_bytes(bytes(raw))
    ds = open_dataset(tmp_path, verify="header")     # header checks cannot see it
    with pytest.raises(DatasetError, match="checksum mismatch") as e:
        open_dataset(tmp_path, verify="checksum")
    assert e.value.sample == 1 and e.value.path == p and "sample 1" in str(e.value)
    assert len(ds) == 3


def test_manifest_dtype_and_shape_mismatch(tmp_path):
    write_dataset(tmp_path, [[4]])
    mpath = tmp_path / MANIFEST_NAME
    good = json.loads(mpath.read_text())
    for mutate, pattern in [
        (lambda m: m["fields"]["aux"].update(stored_dtype="float16"), "fields"),
        (lambda m: m["fields"]["last"].update(shape=[TH + 1]), "fields"),
        (lambda m: m["shards"][0].update(n_tokens=5), "n_tokens"),
    ]:
        m = json.loads(json.dumps(good))
        mutate(m)
        mpath.write_text(json.dumps(m))
        with pytest.raises(DatasetError, match=pattern) as e:
            open_dataset(tmp_path, verify="header")
        assert shard_name(0) in str(e.value)


def test_header_tensor_disagrees_with_own_meta(tmp_path):
    # a file whose tensors were rewritten with another dtype than its metadata claims
    write_dataset(tmp_path, [[4]])
    p = tmp_path / shard_name(0)
    tensors = safetensors.torch.load_file(str(p))
    meta = safetensors.safe_open(str(p), "pt").metadata()
    tensors["last"] = tensors["last"].float()
    safetensors.torch.save_file(tensors, str(p), metadata=meta)
    with pytest.raises(DatasetError, match="'last' is torch.float32"):
        read_shard_meta(p)


def test_stale_shard_replaced(tmp_path):
    write_dataset(tmp_path, [[4], [3]])
    gen = torch.Generator().manual_seed(9)
    write_shard(tmp_path, 1, [make_sample(3, gen)])      # same shape, other content
    with pytest.raises(DatasetError, match="checksum=.*manifest"):
        open_dataset(tmp_path)[1]


def test_missing_manifest_and_gaps(tmp_path):
    gen = torch.Generator().manual_seed(0)
    m0 = write_shard(tmp_path, 0, [make_sample(3, gen)])
    m2 = write_shard(tmp_path, 2, [make_sample(3, gen)])
    with pytest.raises(DatasetError, match="did not finish"):
        open_dataset(tmp_path)
    with pytest.raises(DatasetError, match=r"missing \[1\]"):
        write_manifest(tmp_path, {"kind": "hidden"}, [m0, m2])
    m1 = write_shard(tmp_path, 1, [make_sample(3, gen, teacher=("topk",))])
    with pytest.raises(DatasetError, match="must share fields"):
        write_manifest(tmp_path, {"kind": "hidden"}, [m0, m1, m2])


def test_bad_samples_rejected_by_writer(tmp_path):
    gen = torch.Generator().manual_seed(0)
    s = make_sample(4, gen)
    with pytest.raises(DatasetError, match=r"'aux' has shape \[3, 3, 16\]"):
        write_shard(tmp_path, 0, [dict(s, aux=s["aux"][:3])])
    with pytest.raises(DatasetError, match=r"aux' must be \[T, 3, tH\]"):
        write_shard(tmp_path, 0, [dict(s, aux=s["aux"].reshape(4, 1, 3 * TH))])
    with pytest.raises(DatasetError, match="sample 1 has fields"):
        write_shard(tmp_path, 0, [s, {k: v for k, v in s.items() if k != "last"}])
    with pytest.raises(DatasetError, match="0/1"):
        write_shard(tmp_path, 0, [dict(s, loss_mask=torch.full((4,), 2))])
    with pytest.raises(DatasetError, match="reserved"):
        write_shard(tmp_path, 0, [dict(s, offsets=torch.zeros(4))])
    assert not list(tmp_path.iterdir())


def _nan_dataset(root):
    gen = torch.Generator().manual_seed(0)
    ss = [make_sample(4, gen) for _ in range(4)]
    ss[2]["aux"][1, 2, 3] = float("nan")
    ss[3]["last"][0, 0] = float("inf")
    with pytest.raises(DatasetError, match=r"NaN/inf values in 2 sample\(s\) \(first: sample 2"):
        write_shard(root, 0, ss)
    metas = [write_shard(root, 0, ss[:2]), write_shard(root, 1, ss[2:], check_finite=False)]
    write_manifest(root, {"kind": "hidden"}, metas)
    return ss


def test_nonfinite_error_mode(tmp_path):
    _nan_dataset(tmp_path)
    with pytest.raises(DatasetError, match="NaN/inf") as e:
        open_dataset(tmp_path, verify="checksum")
    assert e.value.sample == 2 and e.value.path.name == shard_name(1)
    ds = open_dataset(tmp_path, check_finite=True)
    ds[1]
    with pytest.raises(DatasetError, match="'aux' has NaN/inf") as e:
        ds[2]
    assert e.value.sample == 2


def test_nonfinite_skip_mode_counts_and_logs(tmp_path, caplog):
    ss = _nan_dataset(tmp_path)
    with caplog.at_level("WARNING"):
        ds = open_dataset(tmp_path, verify="checksum", nonfinite="skip")
    assert len(ds) == 2 and [s["sample"] for s in ds.skipped] == [2, 3]
    assert "skipped 2 of 4 samples" in caplog.text
    assert ds.sample_lengths.tolist() == [4, 4]
    assert torch.equal(ds[1]["aux"], ss[1]["aux"])


# ---- atomicity -------------------------------------------------------------------------------

def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x10" * 100)    # a partial file under the temporary name
        raise OSError("disk full")

    monkeypatch.setattr(shards, "save_file", crash)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(OSError, match="disk full"):
        write_shard(tmp_path, 0, [make_sample(3, gen)])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    meta = write_shard(tmp_path, 0, [make_sample(3, gen)])
    monkeypatch.setattr(shards, "save_file", crash)
    with pytest.raises(OSError):                   # the index write fails: no manifest appears
        write_manifest(tmp_path, {"kind": "hidden"}, [meta])
    assert sorted(p.name for p in tmp_path.iterdir()) == [shard_name(0)]


def test_atomic_write_helpers(tmp_path):
    from eyas.data.common.utils import atomic_write_dir, atomic_write_json
    p = atomic_write_json(tmp_path / "a" / "x.json", {"b": [1, 2]})
    assert json.loads(p.read_text()) == {"b": [1, 2]}
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "y.json", {"nan": float("nan")})
    assert not (tmp_path / "y.json").exists()

    def crash(d):
        (d / "f").write_text("1")
        raise RuntimeError

    with pytest.raises(RuntimeError):
        atomic_write_dir(tmp_path / "d", crash)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    atomic_write_dir(tmp_path / "d", lambda d: (d / "f").write_text("1"))
    assert (tmp_path / "d" / "f").read_text() == "1"


def test_atomic_write_dir_modes(tmp_path):
    import os

    from eyas.data.common.utils import atomic_write_dir
    old = os.umask(0o027)
    try:
        d = atomic_write_dir(tmp_path / "d", lambda t: (t / "f").write_text("1"))
    finally:
        os.umask(old)
    assert d.stat().st_mode & 0o777 == 0o750              # the umask's mode, not mkdtemp's 0700
    with pytest.raises(FileExistsError, match="already exists: pick another"):
        atomic_write_dir(d, lambda t: None, exists_hint="pick another")
    atomic_write_dir(d, lambda t: (t / "g").write_text("2"), if_exists="keep")
    assert sorted(p.name for p in d.iterdir()) == ["f"]   # the first writer's directory stays
    atomic_write_dir(d, lambda t: (t / "g").write_text("2"), if_exists="replace")
    assert sorted(p.name for p in d.iterdir()) == ["g"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary left behind


def test_read_into_matches_getitem(tmp_path):
    for fmt in ("bf16", "fp8"):
        write_dataset(tmp_path / fmt, [[5, 7]], aux_format=fmt)
        ds = open_dataset(tmp_path / fmt)
        ref = ds[1]
        out = {k: torch.zeros((10, *v.shape[1:]), dtype=v.dtype) for k, v in ref.items()}
        n = ds.read_into(1, out, length=6)
        assert n == 6
        for k, v in ref.items():
            assert torch.equal(out[k][:6], v[:6]), (fmt, k)
            assert not out[k][6:].any()
    assert np.array_equal(ds.sample_lengths, [5, 7])


def test_read_into_rejects_mismatched_buffers(tmp_path):
    samples, _ = write_dataset(tmp_path, [[3, 3]])
    ds = open_dataset(tmp_path)
    bad = {"last": (torch.zeros(3, TH), "is torch.float32 [3, 16] but the field needs "
                                         "torch.bfloat16 with >= 3 rows of [16]"),
           "aux": (torch.zeros(2, 3 * TH, dtype=torch.bfloat16),
                   "is torch.bfloat16 [2, 48] but the field needs torch.bfloat16 with >= 3 rows "
                   "of [3, 16]"),
           "topk_ids": (torch.zeros(3, 2, dtype=torch.int64),
                        "is torch.int64 [3, 2] but the field needs any dtype with >= 3 rows of [4]")}
    for name, (buf, msg) in bad.items():
        with pytest.raises(DatasetError, match=rf"field '{name}' {re.escape(msg)}; allocate it "):
            ds.read_into(0, {name: buf})
        assert not buf.any(), name                   # nothing was written
    out = {"last": torch.zeros(3, TH, dtype=torch.bfloat16),
           "input_ids": torch.zeros(3, dtype=torch.int32)}
    assert ds.read_into(0, out) == 3                     # converted fields take any dtype
    assert torch.equal(out["last"], samples[0]["last"])
    assert out["input_ids"].tolist() == samples[0]["input_ids"].tolist()


def test_dataset_pickles_without_open_shards(tmp_path):
    import pickle
    samples, _ = write_dataset(tmp_path, [[3], [4, 2]])
    ds = open_dataset(tmp_path)
    ds[2]
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone._cache and torch.equal(clone[2]["aux"], samples[2]["aux"])
    assert clone.locate(1) == (1, 0) and clone.locate(-1) == (1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_nonfinite_rows_match_an_elementwise_check(dtype):
    from eyas.data.store.format import nonfinite_tokens
    x = torch.randn(40, 3, 8, dtype=torch.float64) * 100
    x[0] = torch.finfo(dtype).max                     # the largest finite values stay finite
    x[1] = -torch.finfo(dtype).max
    for row, value in ((5, float("nan")), (11, float("inf")), (17, -float("inf"))):
        x[row, 2, 7] = value
    x = x.to(dtype)
    flat = x.reshape(40, -1).double()
    expected = (~torch.isfinite(flat)).any(dim=1)
    assert torch.equal(nonfinite_tokens(x), expected)
    # float8_e4m3fn has no inf: torch's cast saturates ±inf to ±448, leaving the NaN row
    rows = [5] if dtype == torch.float8_e4m3fn else [5, 11, 17]
    if dtype == torch.float8_e5m2:      # row 0/1 hold ±max: e5m2 keeps them finite as well
        rows = expected.nonzero().flatten().tolist()
    assert nonfinite_tokens(x).nonzero().flatten().tolist() == rows
    assert not nonfinite_tokens(torch.zeros(4, 0, dtype=dtype)).any()
