"""Libraries' noise (DeepSpeed's CPU notice, torchao's kernels that cannot load on a CPU torch,
torch's pytree deprecation notices, transformers' weight-loading bars) stays off the console
and is kept in the run's train.log at debug level; eyas's lines and real warnings still show."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NOISE = ("Setting accelerator to CPU", "Failed to load", "_pytree", "Loading weights")
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")


def test_noise_before_the_log_file_is_known_goes_to_the_file_only(tmp_path):
    """The order of the trainer: logging set up, DeepSpeed imported (its notice on its own
    stdout handler), a real warning, then the run's file named."""
    script = textwrap.dedent(f"""
        import logging
        from eyas.data.common.log import setup_logging
        setup_logging(keep_early=True)
        from deepspeed.utils import logger
        logger.warning("a real DeepSpeed warning")
        setup_logging(rank=0, file={str(tmp_path / "train.log")!r})
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: no CUDA")
        logging.getLogger("eyas").info("eyas line")
    """)
    r = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    console = r.stdout + r.stderr
    assert not any(n in console for n in NOISE), console
    assert re.search(r" W DeepSpeed: a real DeepSpeed warning\n", r.stderr), console
    assert re.search(r" I eyas: eyas line\n", r.stderr), console
    log = (tmp_path / "train.log").read_text()
    cpu_notice = [] if torch.cuda.is_available() else [(   # DeepSpeed's notice without a GPU
        "D DeepSpeed: Setting accelerator to CPU. If you have GPU or other accelerator, we "
        "were unable to detect it.")]
    assert [line.split(" ", 2)[2] for line in log.splitlines()] == [
        *cpu_notice,
        "W DeepSpeed: a real DeepSpeed warning",
        "D torchao: Failed to load /x/_C_mxfp8.so: no CUDA",
        "I eyas: eyas line"], log


@pytest.mark.slow
def test_a_real_run_shows_no_library_noise(tmp_path, tiny_llama_dataset):
    """dist=zero2 imports DeepSpeed; the speculative check loads the target (transformers'
    weight bars; torchao and its pytree registrations on import)."""
    run_dir = tmp_path / "r"
    r = subprocess.run(
        [sys.executable, str(ROOT / "train" / "main.py"), "target=tiny_llama", "dist=zero2",
         f"data.dataset={tiny_llama_dataset}", f"hydra.run.dir={run_dir}",
         "drafter.attention=eager", "drafter.ttt_steps=2", "drafter.draft_vocab_size=24",
         "data.token_budget=256", "data.num_workers=0", "data.eval_fraction=0.25",
         "train.max_steps=2", "eval.speculative=true", "eval.num_prompts=1",
         "eval.max_new_tokens=4", "eval.engines=false", "eval.engine_serve=false"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    console = r.stdout + r.stderr
    assert not any(n in console for n in NOISE), console
    assert "I eyas.models.serving.export: exported drafter to" in r.stderr
    log = (run_dir / "train.log").read_text()
    if not torch.cuda.is_available():
        assert re.search(r"^\S+ \S+ D DeepSpeed: Setting accelerator to CPU", log, re.MULTILINE), log
    if torch.version.cuda is None:   # torchao's CUDA kernels cannot load on a CPU-only torch
        assert re.search(r"^\S+ \S+ D torchao: Failed to load ", log, re.MULTILINE), log
        assert re.search(r"^\S+ \S+ D torch\.utils\._pytree: ", log, re.MULTILINE), log
    assert "Loading weights" not in log
    assert "I eyas.models.serving.export: exported drafter to" in log
