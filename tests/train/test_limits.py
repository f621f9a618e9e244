"""The TTT unroll's memory estimate (train/limits.py): what it counts, and a run whose
ttt_steps cannot fit is refused with the estimate before its first step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.train.limits import ttt_activation_bytes, ttt_memory_error
from eyas.train.resolve import Resolved

ROOT = Path(__file__).resolve().parents[2]


def _config(K):
    return Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=256,
                                    ttt_steps=K)


def _resolved(attention="eager", loss="torch"):
    return Resolved(attention=attention, compile=False, loss_impl=loss, optim_impl="torch",
                    compact_masters=False, param_dtype=torch.float32, target_dtype=torch.float32, pin_memory=False)


def test_estimate_is_linear_in_k_and_quadratic_with_eager_attention():
    flex = [ttt_activation_bytes(_config(k), 512, 2, False, False) for k in (1, 2, 4)]
    assert flex[1] == 2 * flex[0] and flex[2] == 4 * flex[0]
    c = _config(4)
    eager = ttt_activation_bytes(c, 512, 2, True, False) - flex[2]
    assert eager == c.num_attention_heads * 512 * 512 * 4 * (1 + 2 + 3 + 4)
    loss = ttt_activation_bytes(c, 512, 2, False, True) - flex[2]
    assert loss == 4 * 2 * 512 * 256 * 4


def test_memory_error_names_key_estimate_and_fix():
    assert ttt_memory_error(_config(7), 256, _resolved(), "cpu") is None
    why = ttt_memory_error(_config(64), 1 << 20, _resolved(), "cpu")
    assert why.startswith("drafter.ttt_steps=64: the TTT unroll keeps about ")
    assert "GiB" in why and "this host has" in why and "lower drafter.ttt_steps" in why


@pytest.mark.slow
def test_a_run_whose_unroll_cannot_fit_exits_2_before_training(tmp_path, tiny_llama_dataset):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(
        [sys.executable, str(ROOT / "train" / "main.py"), "target=tiny_llama",
         f"data.dataset={tiny_llama_dataset}", f"hydra.run.dir={tmp_path}/r",
         "drafter.attention=eager", "drafter.ttt_steps=64", "drafter.draft_vocab_size=256",
         "data.token_budget=1048576", "data.num_workers=1", "data.eval_fraction=0.1",
         "train.max_steps=1", "eval.speculative=false", "eval.engines=false",
         "export.enabled=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-4000:]
    assert "Traceback" not in r.stderr
    assert "bad configuration: drafter.ttt_steps=64: the TTT unroll keeps about" in r.stderr
    assert not list((tmp_path / "r").glob("checkpoints/*")), "no step ran"
