"""`eyas validate` on real damaged export files: SHA256SUMS, truncated weights, and weights
outside a plausible magnitude for their role (which the numeric check cannot see)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from eyas.data.common.checksums import CHECKSUMS_NAME, read_checksums, verify_checksums
from eyas.data.common.targets import load_target_config
from eyas.models.serving.contract import TensorDir
from eyas.models.serving.export import export_drafter
from eyas.models.serving.validate import validate

from tests.models.serving.test_validate import codes, make_drafter, rewrite


@pytest.fixture(scope="module")
def tcfg():
    return load_target_config("tiny-llama")


@pytest.fixture(scope="module")
def export(tmp_path_factory, tcfg):
    cfg, sd, d2t = make_drafter(tcfg)
    from eyas.data.store.vocab_map import VocabMap
    t2d = VocabMap.from_d2t(d2t, cfg.vocab_size).t2d
    return export_drafter(sd, cfg, d2t, t2d, tmp_path_factory.mktemp("x") / "e",
                          target_config=tcfg, speculators=True, verifier="org/tiny")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _poison_lm_head(path, count=128, value=b"\xd4\x46"):
    """Overwrite `count` consecutive lm_head values with bf16 27136 (0x46D4): 2*count bytes."""
    tdir = TensorDir(path)
    f = tdir._where["lm_head.weight"]
    from eyas.data.store.format import parse_header
    e = parse_header(f).tensors["lm_head.weight"]
    with open(f, "r+b") as fh:
        fh.seek(e.begin + 1000 * 2)
        fh.write(value * count)


def test_exports_carry_sha256sums_that_coreutils_accepts(export):
    for d in (export, export.with_name(export.name + "-speculators")):
        listed = read_checksums(d)
        assert {"config.json", "model.safetensors"} <= set(listed), listed
        assert verify_checksums(d) == []
        if shutil.which("sha256sum"):
            subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUMS_NAME], cwd=d, check=True)
    assert validate(export, load_target_config("tiny-llama")) == []


def test_flipped_lm_head_bytes_are_named_by_checksum_and_magnitude(export, tcfg, tmp_path):
    bad = _copy(export, tmp_path / "bad")
    _poison_lm_head(bad)
    assert float(load_file(bad / "model.safetensors")["lm_head.weight"].flatten()[1000]) == 27136
    found = validate(bad, tcfg, numeric=True)
    assert codes(found) == {"CHECKSUM_MISMATCH", "MAGNITUDE"}, found
    (c,) = [f for f in found if f.code == "CHECKSUM_MISMATCH"]
    assert str(bad / "model.safetensors") in c.message
    (m,) = [f for f in found if f.code == "MAGNITUDE"]
    H = int(load_file(bad / "model.safetensors")["lm_head.weight"].shape[1])
    assert f"lm_head.weight[{1000 // H}, {1000 % H}] = 27136" in m.message
    assert "128 value(s)" in m.message
    # a copy without checksums (another tool's, or SHA256SUMS lost): the magnitude rule alone
    (bad / CHECKSUMS_NAME).unlink()
    assert codes(validate(bad, tcfg, numeric=True)) == {"MAGNITUDE"}


@pytest.mark.parametrize("name,value", [("norm.weight", 1000.0),
                                        ("midlayer.self_attn.o_proj.weight", 40.0),
                                        ("fc.weight", 3.0)])      # RMS 3 > 1
def test_magnitude_bounds_per_role(export, tcfg, tmp_path, name, value):
    def poison(ts):
        t = ts[name].clone()
        if name == "fc.weight":
            t.fill_(value)
        else:
            t.view(-1)[7] = value
        ts[name] = t
    bad = rewrite(export, tmp_path / "b", tensors=poison)
    found = validate(bad, tcfg)
    assert codes(found) == {"MAGNITUDE"} and name in found[0].message, found


def test_every_norm_of_an_eagle31_drafter_has_the_norm_bound():
    from eyas.models.serving.validate_integrity import role
    assert [role(n) for n in ("fc_norm.0.weight", "fc_norm.2.weight", "input_norm.weight",
                              "midlayer.hidden_norm.weight", "norm.weight", "fc.weight",
                              "d2t")] == ["norm"] * 5 + ["projection", None]


def test_truncated_weights_are_one_named_finding(export, tcfg, tmp_path):
    bad = _copy(export, tmp_path / "t")
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4096])
    found = validate(bad, tcfg)
    assert codes(found) == {"CHECKSUM_MISMATCH", "WEIGHTS_UNREADABLE"}, found
    assert all(str(f) in x.message for x in found)
    (bad / CHECKSUMS_NAME).unlink()
    (w,) = validate(bad, tcfg)
    assert w.code == "WEIGHTS_UNREADABLE" and str(f) in w.message
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", "validate", str(bad),
                        "--target-config", "tiny-llama"], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "WEIGHTS_UNREADABLE" in r.stdout


def test_missing_and_added_files_are_named(export, tcfg, tmp_path):
    bad = _copy(export, tmp_path / "m")
    (bad / "eyas_export.json").unlink()
    torch.save({}, bad / "notes.pt")                          # unlisted, not loaded: fine
    shutil.copy(bad / "model.safetensors", bad / "extra.safetensors")
    found = validate(bad, tcfg)
    assert "CHECKSUM_MISSING_FILE" in codes(found) and "CHECKSUM_UNLISTED" in codes(found)
    (u,) = [f for f in found if f.code == "CHECKSUM_UNLISTED"]
    assert "extra.safetensors" in u.message and "notes.pt" not in u.message
