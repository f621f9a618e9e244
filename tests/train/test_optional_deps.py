"""wandb and deepspeed are imported only on the paths that use them (tracker=wandb, dist=zero*):
with either unimportable, DDP without a tracker still builds, and those paths fail in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.state import AcceleratorState, GradientState

from eyas.train.config import DistBackend
from eyas.train.dist import MissingDependency, build_accelerator

ROOT = Path(__file__).resolve().parents[2]
OPTIM = SimpleNamespace(grad_accum=1, clip_grad_norm=0.5)


@pytest.fixture
def broken(monkeypatch):
    """`import wandb` and `import deepspeed` raise ImportError, as for an absent package."""
    for name in ("wandb", "deepspeed"):
        monkeypatch.setitem(sys.modules, name, None)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_ddp_without_tracker_builds_without_wandb_and_deepspeed(broken, tmp_path):
    dist = SimpleNamespace(backend=DistBackend.ddp, zero_stage=0, deepspeed_config=None)
    acc = build_accelerator(dist, OPTIM, tmp_path, bf16=False, log_with=None)
    assert acc.distributed_type.value in ("NO", "MULTI_CPU") and acc.num_processes == 1


@pytest.mark.parametrize("backend,log_with,module,fix", [
    (DistBackend.deepspeed, None, "deepspeed", "dist=ddp"),
    (DistBackend.ddp, "wandb", "wandb", "tracker=none"),
])
def test_the_path_that_needs_it_fails_in_one_line(broken, tmp_path, backend, log_with, module,
                                                  fix):
    dist = SimpleNamespace(backend=backend, zero_stage=2 if module == "deepspeed" else 0,
                           deepspeed_config=None)
    with pytest.raises(MissingDependency) as e:
        build_accelerator(dist, OPTIM, tmp_path, bf16=False, log_with=log_with)
    msg = str(e.value)
    assert "\n" not in msg and f"needs {module}, which cannot be imported" in msg
    assert f"pip install {module}" in msg and fix in msg


def test_importing_the_stack_imports_neither(tmp_path):
    code = ("import sys; import eyas.train.main, eyas.train.trainer, eyas.train.cli, "
            "eyas.models.serving.importer, eyas.train.step; "
            "print(sorted(m for m in ('wandb', 'deepspeed') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_main_job_reports_a_missing_wandb_in_one_line(tmp_path):
    code = ("import runpy, sys; sys.modules['wandb'] = None; "
            f"sys.argv = ['main.py', 'tracker=wandb', 'tracker.mode=offline', 'train.dry_run=true', "
            f"'hydra.run.dir={tmp_path}/r']; "
            f"runpy.run_path({str(ROOT / 'train' / 'main.py')!r}, run_name='__main__')")
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "needs wandb" in line]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
