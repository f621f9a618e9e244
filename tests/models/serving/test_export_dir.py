"""The export directory: one exporter at a time (its lock beside it), killed exports' leftovers
removed by the next export, and --overwrite never deleting files an export did not write."""

from pathlib import Path

from eyas.data.common.lock import sibling_lock_path
from eyas.train.cli import main


def _files(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def test_overwrite_refuses_a_directory_with_other_files(tmp_path, small_export, capsys):
    out = tmp_path / "out"
    assert main(["export", str(small_export), str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    (out / "runs").mkdir()
    before = _files(out)
    capsys.readouterr()
    assert main(["export", str(small_export), str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eyas export: --overwrite would delete"), err
    assert "(notes.txt, runs)" in err[0] and "Fix: move them out" in err[0]
    assert _files(out) == before and (out / "runs").is_dir()
    (out / "notes.txt").unlink()
    (out / "runs").rmdir()
    # an earlier export, its model card and provenance record included, is replaced
    assert main(["export", str(small_export), str(out), "--overwrite"]) == 0
    assert sorted(_files(out)) == ["README.md", "SHA256SUMS", "config.json", "eyas_export.json",
                                   "eyas_provenance.json", "model.safetensors"]
    assert not sibling_lock_path(out).exists()


def test_a_killed_exports_leftovers_are_removed_by_the_next(tmp_path, small_export, caplog):
    out = tmp_path / "out"
    # as a SIGKILL leaves them: the build directory (a truncated tensor file) and, from one
    # killed while replacing, the earlier export moved aside; and the stale lock file
    building = tmp_path / ".tmp-out.1a2b3c4d"
    building.mkdir()
    (building / "config.json").write_bytes((small_export / "config.json").read_bytes())
    (building / "model.safetensors").write_bytes((small_export / "model.safetensors").read_bytes()[:99])
    aside = tmp_path / ".tmp-out.old.4242"
    aside.mkdir()
    (aside / "model.safetensors").write_bytes(b"old")
    sibling_lock_path(out).write_text('{"pid": 4242, "host": "h", "command": "eyas export"}')
    others = tmp_path / ".tmp-out.v2.1a2b3c4d"  # another export's (out.v2): kept
    others.mkdir()
    with caplog.at_level("WARNING"):
        assert main(["export", str(small_export), str(out)]) == 0
    assert not building.exists() and not aside.exists() and others.is_dir()
    for p in (building, aside):
        assert f"removing {p}, left by an earlier write of {out}" in caplog.text
    assert "stale lock of pid 4242" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-out.v2.1a2b3c4d", "out"]


def test_a_second_exporter_fails_naming_the_first(tmp_path, small_export, lock_holder, capsys):
    out = tmp_path / "out"
    holder = lock_holder(out, sibling_lock_path(out))
    assert main(["export", str(small_export), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pid {holder.pid}" in err[0], err
    assert not out.exists()
