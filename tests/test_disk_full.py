"""A full disk or a file-size limit (data/common/space.py): one line naming the directory, the
bytes needed (where known) and free, and the fix; exit status 2; nothing left that looks
complete (checkpoints: tests/train/test_checkpoint_disk_full.py). Real filesystems: a small
tmpfs each test mounts (skipped where mounting is not allowed), or the file-size limit
`ulimit -f` sets (RLIMIT_FSIZE, for any user)."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from eyas.data.common.log import run_command
from eyas.data.common.space import DiskFullError
from eyas.data.common.utils import atomic_write_bytes, atomic_write_dir
from eyas.models.serving.export import export_checkpoint
from safetensors.torch import load_file, save_file

EYAS = str(Path(sys.executable).parent / "eyas")
FIX = "free space there or write to another directory"


def _fsize_limit(nbytes: int):
    """preexec_fn: the child's files may not grow past `nbytes` (writes fail with EFBIG)."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


def _free(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def _h(n: int) -> str:
    from eyas.data.common.space import human_bytes
    return f"{human_bytes(n)} ({n:,} bytes)"


def _run(args, cwd, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("EYAS_DEBUG", None)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False, **kw)


def _one_line(r: subprocess.CompletedProcess, prog: str) -> str:
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: "), r.stderr[-3000:]
    return last


# ---------------------------------------------------------------------------------------------
# atomic writes and the `eyas` command's exit status
# ---------------------------------------------------------------------------------------------

def test_an_atomic_write_onto_a_full_disk_names_the_directory_and_leaves_nothing(small_fs):
    fs = small_fs(256)
    with pytest.raises(DiskFullError) as e:
        atomic_write_bytes(fs / "big.bin", bytes(512 * 1024))
    assert str(e.value) == (f"writing big.bin in {fs} failed: no space left on the device (it "
                            f"needs more than the 0 bytes free there); {FIX}")
    assert type(e.value).exit_status == 2
    assert list(fs.iterdir()) == []       # the temporary file is gone: the space is free again


def test_a_directory_that_does_not_fit_is_refused_before_it_is_built(small_fs):
    fs = small_fs(256)
    built = []
    with pytest.raises(DiskFullError) as e:
        atomic_write_dir(fs / "out", built.append, need_bytes=300 * 1024)
    assert str(e.value) == (f"not enough space for out in {fs}: needs {_h(300 * 1024)}, "
                            f"{_h(256 * 1024)} free there; {FIX}")
    assert built == [] and list(fs.iterdir()) == []


def test_a_file_of_a_directory_write_is_named_where_it_would_be(small_fs):
    fs = small_fs(256)
    with pytest.raises(DiskFullError) as e:
        atomic_write_dir(fs / "out", lambda d: atomic_write_bytes(d / "big.bin", bytes(512 << 10)))
    assert str(e.value) == (f"writing big.bin in {fs / 'out'} failed: no space left on the "
                            f"device (it needs more than the 0 bytes free there); {FIX}")
    assert list(fs.iterdir()) == []


_TORCH_SAVE = """
import sys, torch
from eyas.data.common.log import run_command
from eyas.data.common.utils import atomic_path
def main(argv):
    with atomic_path(sys.argv[1]) as tmp:
        torch.save({"w": torch.zeros(256, 1024)}, tmp)
raise SystemExit(run_command("eyas x", main, None))
"""


def test_torch_save_onto_a_full_disk_says_so(small_fs, tmp_path):
    """torch.save's C++ stream drops the errno (`unexpected pos … vs …`): the free space says."""
    fs = small_fs(256)
    r = _run([sys.executable, "-c", _TORCH_SAVE, str(fs / "w.pt")], tmp_path)
    assert _one_line(r, "eyas x") == (f"eyas x: writing w.pt in {fs} failed: no space left on "
                                      f"the device (it needs more than the 0 bytes free there); "
                                      f"{FIX}")
    assert list(fs.iterdir()) == []


def test_torch_save_past_the_file_size_limit_says_so(tmp_path):
    r = _run([sys.executable, "-c", _TORCH_SAVE, str(tmp_path / "w.pt")], tmp_path,
             preexec_fn=_fsize_limit(200 * 1024))
    assert _one_line(r, "eyas x") == (
        f"eyas x: writing w.pt in {tmp_path} failed: a file passed this process's file-size "
        f"limit of {_h(200 * 1024)} (`ulimit -f` 200 KiB); raise it (`ulimit -f unlimited`) and "
        f"run again")
    assert list(tmp_path.iterdir()) == []

def test_a_full_disk_no_writer_named_is_still_one_line_and_exit_2(small_fs, capsys):
    fs = small_fs(64)

    def write(argv):
        with open(fs / "f.bin", "wb") as f:
            f.write(bytes(128 * 1024))

    assert run_command("eyas x", write, []) == 2
    assert capsys.readouterr().err == ("eyas x: [Errno 28] No space left on device; free space "
                                       "on that disk, or write to another one\n")


# ---------------------------------------------------------------------------------------------
# eyas export
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A trainer-style checkpoint directory of a tiny-llama drafter (model.safetensors +
    eyas.json) and the bytes of its exported tensors."""
    from eyas.data.common.targets import load_target_config
    from eyas.models.config import Eagle3Config
    from eyas.models.drafter import Eagle3Drafter
    tcfg = load_target_config("tiny-llama")
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=tcfg["vocab_size"], ttt_steps=2)
    sd = {k: v.contiguous() for k, v in Eagle3Drafter(cfg, attention="eager").state_dict().items()}
    ck = tmp_path_factory.mktemp("ck")
    save_file(sd, ck / "model.safetensors")
    (ck / "eyas.json").write_text(json.dumps({"drafter": cfg.to_dict()}))
    out = export_checkpoint(ck, tmp_path_factory.mktemp("export") / "out")
    return ck, sum(t.nbytes for t in load_file(out / "model.safetensors").values())


def test_export_under_a_file_size_limit_is_one_line_naming_the_limit(checkpoint, tmp_path):
    ck, _ = checkpoint
    r = _run([EYAS, "export", str(ck), str(tmp_path / "out"), "--target-config", "tiny-llama"],
             tmp_path, preexec_fn=_fsize_limit(200 * 1024))
    assert _one_line(r, "eyas export") == (
        f"eyas export: writing out in {tmp_path} failed: a file passed this process's "
        f"file-size limit of {_h(200 * 1024)} (`ulimit -f` 200 KiB); raise it "
        f"(`ulimit -f unlimited`) and run again")
    assert sorted(p.name for p in tmp_path.iterdir()) == []     # no out, no .tmp-out.*


def test_export_onto_a_disk_too_small_is_refused_before_writing(checkpoint, small_fs):
    ck, nbytes = checkpoint
    fs = small_fs(1024)
    r = _run([EYAS, "export", str(ck), str(fs / "out"), "--target-config", "tiny-llama"], fs)
    line = _one_line(r, "eyas export")
    m = re.fullmatch(rf"eyas export: not enough space for out in {re.escape(str(fs))}: needs "
                     rf"{re.escape(_h(nbytes))}, .* \(([\d,]+) bytes\) free there; {FIX}", line)
    assert m, line
    assert 1000 * 1024 <= int(m.group(1).replace(",", "")) <= 1024 * 1024
    assert [p.name for p in fs.iterdir() if not p.name.endswith(".lock")] == []


# ---------------------------------------------------------------------------------------------
# eyas extract
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory):
    from eyas.data.produce.prepare import prepare
    from eyas.data.common.targets import load_tokenizer
    root = tmp_path_factory.mktemp("tokens")
    convs = [("Name a fruit.", "Apple."), ("Hi", "Hello! How can I help?"), ("What is 2+2?", "4.")]
    (root / "conv.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": u},
                                 {"role": "assistant", "content": a}]}) + "\n" for u, a in convs))
    prepare(root / "conv.jsonl", "smollm2", root / "ds", tokenizer=load_tokenizer("smollm2"),
            shard_samples=2)
    return root / "ds"


def _extract(tokens_dir, out, cwd, **kw) -> subprocess.CompletedProcess:
    return _run([EYAS, "extract", "--tokens", str(tokens_dir), "--target", "tiny-llama",
                 "--out", str(out), "--device", "cpu", "--shard-tokens", "20"], cwd, **kw)


@pytest.fixture(scope="module")
def extracted(tokens_dir, tmp_path_factory):
    """A real `eyas extract` of the token dataset (no limits): its output directory."""
    out = tmp_path_factory.mktemp("extracted") / "out"
    r = _extract(tokens_dir, out, out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_the_plan_knows_each_files_exact_size(extracted):
    from eyas.data.store.shards import shard_name
    plan = json.loads((extracted / "extract_plan.json").read_text())
    sizes = plan["file_bytes"]
    assert len(sizes["shards"]) == len(plan["shards"]) > 1
    assert sizes["shards"] == [(extracted / shard_name(j)).stat().st_size
                               for j in range(len(plan["shards"]))]
    assert sizes["index"] == (extracted / "index.safetensors").stat().st_size


def test_extract_onto_a_disk_too_small_is_refused_before_it_starts(tokens_dir, extracted,
                                                                    small_fs, tmp_path):
    from eyas.data.produce.extract_plan import (
        SMALL_FILES_BYTES,
        SMALL_FILES_BYTES_PER_SHARD,
    )
    shards = sorted(extracted.glob("shard-*.safetensors"))
    need = (sum(p.stat().st_size for p in shards) + (extracted / "index.safetensors").stat().st_size
            + SMALL_FILES_BYTES + SMALL_FILES_BYTES_PER_SHARD * len(shards))
    fs = small_fs(48)                   # less than the shards alone
    assert sum(p.stat().st_size for p in shards) > 48 * 1024
    r = _extract(tokens_dir, fs / "out", tmp_path)
    line = _one_line(r, "eyas extract")
    m = re.fullmatch(rf"eyas extract: not enough space for the hidden-state dataset "
                     rf"\({len(shards)} shard\(s\) to write\) in {re.escape(str(fs / 'out'))}: "
                     rf"needs {re.escape(_h(need))}, .* \(([\d,]+) bytes\) free there; free space "
                     rf"there or choose another --out \(`eyas extract --estimate` lists the size "
                     rf"of each storage mode; --aux-format fp8 halves aux\)", line)
    assert m, line
    assert 40 * 1024 <= int(m.group(1).replace(",", "")) <= 48 * 1024
    assert not list((fs / "out").glob("*.safetensors"))
    assert not (fs / "out" / "extract_plan.json").exists()


def test_extract_whose_shard_passes_the_file_size_limit_is_refused_before_it_starts(
        tokens_dir, tmp_path):
    r = _extract(tokens_dir, tmp_path / "out", tmp_path, preexec_fn=_fsize_limit(16 * 1024))
    line = _one_line(r, "eyas extract")
    assert re.fullmatch(
        rf"eyas extract: the hidden-state dataset \(\d+ shard\(s\) to write\) in "
        rf"{re.escape(str(tmp_path / 'out'))} writes a file of .* \([\d,]+ bytes\), over this "
        rf"process's file-size limit of {re.escape(_h(16 * 1024))} \(`ulimit -f` 16 KiB\); "
        rf"raise it \(`ulimit -f unlimited`\) and run again", line), line
    assert not list((tmp_path / "out").glob("*.safetensors"))

