"""The installed distribution: one top-level import name, `eyas`, holding every package of the tree.

The wheel is built from a copy of the package folders (a stale `build/` in the checkout cannot
leak into it), then installed into a scratch directory and imported from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("conf", "data", "kernels", "models", "train")
DATA_SUFFIXES = {".yaml", ".json", ".jsonl", ".jinja", ".md"}


def _tree_files(folder: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:   # not a git checkout: every file on disk
        return [p.relative_to(ROOT) for p in (ROOT / folder).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts]
    return [Path(line) for line in out.stdout.splitlines() if (ROOT / line).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGES:
        for rel in _tree_files(folder):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, src / rel)
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "--no-index", "-w", str(dist), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = dist.glob("eyas-*.whl")
    return whl


def test_wheel_has_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"eyas"}, sorted(top)
    assert not [n for n in names if n.startswith("eyas/") and n.count("/") == 1
                and n.endswith(".py")], "eyas is a namespace: nothing but the packages under it"


def test_wheel_holds_every_package_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in PACKAGES:
        for rel in _tree_files(folder):
            if rel.suffix == ".py" or rel.suffix in DATA_SUFFIXES:
                assert f"eyas/{rel.as_posix()}" in names, (
                    f"{rel} is missing from the wheel: add its package to [tool.setuptools] "
                    f"packages in pyproject.toml (or its suffix to package-data)")


def test_wheel_declares_its_license(wheel):
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
        licenses = [n for n in z.namelist() if ".dist-info/licenses/" in n]
        assert "License-Expression: Apache-2.0" in text
        assert [n.rsplit("/", 1)[1] for n in licenses] == ["LICENSE"]
        assert "Apache License" in z.read(licenses[0]).decode()


def test_build_requirement_reads_spdx_license():
    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77.0.3" in pyproject["build-system"]["requires"]
    torch = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    assert torch == ["torch>=2.7"]   # torch 2.6 pins triton==3.2.0, below the triton>=3.3 floor


def test_wheel_entry_point(wheel):
    with zipfile.ZipFile(wheel) as z:
        (ep,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(ep).decode()
    assert "eyas = eyas.train.cli:main" in text


def test_installed_wheel_imports_and_runs(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--target", str(target), str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    installed = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert installed - {"bin"} == {"eyas"}, sorted(installed)   # bin/: the `eyas` script
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import eyas.train.cli, eyas.data, eyas.conf, pathlib, sys;"
            "print(eyas.train.cli.__file__);"
            "print((pathlib.Path(eyas.conf.__file__).parent / 'config.yaml').is_file())")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    where, has_conf = r.stdout.split()
    assert Path(where).is_relative_to(target), where
    assert has_conf == "True"
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: eyas" in r.stdout, r.stderr[-3000:]
