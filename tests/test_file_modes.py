"""Files eyas writes follow the user's umask (atomic writes must not leave mkstemp's 0600 or
mkdtemp's 0700): a vLLM container running as another user, or a teammate, can read them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from eyas.data.store.shards import write_manifest, write_shard
from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.export import export_drafter


@pytest.fixture
def umask():
    """Set the process umask for one test; the previous one comes back afterwards."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _modes(root: Path) -> tuple[set[int], set[int]]:
    """(modes of the files, modes of the directories) under `root`, `root` included."""
    files, dirs = set(), {stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        (dirs if p.is_dir() else files).add(stat.S_IMODE(p.stat().st_mode))
    return files, dirs


def _export(out: Path) -> Path:
    tcfg = load_target_config("tiny-llama")
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=tcfg["vocab_size"], ttt_steps=2)
    drafter = Eagle3Drafter(cfg, attention="eager")
    d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    t2d = torch.ones(cfg.vocab_size, dtype=torch.bool)
    return export_drafter(drafter.state_dict(), cfg, d2t, t2d, out, target_config=tcfg,
                          ttt_steps=2)


def _dataset(out: Path) -> Path:
    T = 5
    sample = {"input_ids": torch.arange(T), "loss_mask": torch.ones(T, dtype=torch.bool),
              "aux": torch.zeros(T, 3, 4, dtype=torch.bfloat16),
              "last": torch.zeros(T, 4, dtype=torch.bfloat16),
              "target_argmax": torch.arange(T)}
    write_manifest(out, {"kind": "hidden"}, [write_shard(out, 0, [sample])])
    return out


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755),
                                                      (0o077, 0o600, 0o700)])
@pytest.mark.parametrize("write", [_export, _dataset], ids=["export", "dataset"])
def test_written_files_follow_the_umask(tmp_path, umask, write, mask, file_mode, dir_mode):
    umask(mask)
    out = write(tmp_path / "out")
    files, dirs = _modes(out)
    assert files and files == {file_mode}, sorted(map(oct, files))
    assert dirs == {dir_mode}, sorted(map(oct, dirs))
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("mask,file_mode", [(0o022, 0o644), (0o077, 0o600)])
def test_checkpoint_files_follow_the_umask(tmp_path, umask, mask, file_mode):
    """accelerate's save_state writes model.safetensors 0600 whatever the umask: a checkpoint
    gives every file, its own and accelerate's, the umask's mode."""
    from accelerate import Accelerator

    from eyas.train import checkpoint as ckpt
    umask(mask)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    saved = ckpt.save(acc, tmp_path / "checkpoints", 1, {"step": 1}, keep_last=1)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in saved.iterdir()}
    assert {"model.safetensors", "optimizer.bin", ckpt.STATE_FILE, "SHA256SUMS"} <= set(modes)
    assert set(modes.values()) == {file_mode}, {k: oct(v) for k, v in modes.items()}
