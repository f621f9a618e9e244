"""Metrics out of the loop: a JSONL file always, wandb through accelerate when configured,
a tqdm bar on rank 0, and the FLOP count behind MFU.

FLOPs per trained token (`flops_per_token`), counting multiply-adds as 2 FLOPs:
    per TTT step (K of them): 6 · P_step        P_step = q,k,v (from the 2H input), o, gate, up,
                                                down and lm_head weights (forward 2, backward 4)
                              + 12 · ctx · nh · hd   attention scores and values (fwd 4, bwd 8),
                                                ctx = mean causal context (half the mean doc length)
                                                plus the k diagonal keys
    once: 4 · 3tH · H        fc (forward 2 + weight gradient 2; its input needs no gradient)
    once: 2 · tH · Vd        teacher logits over the draft vocabulary (target head rows)
MFU = FLOPs per token × tokens/s / peak; the peak is `train.peak_tflops` (null: 989 TFLOP/s,
the dense bf16 peak of an H100/H200, on CUDA; MFU is not reported on CPU).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def flops_per_token(config, ttt_steps: int, mean_doc_len: float) -> float:
    H, tH = config.hidden_size, config.target_hidden_size
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    I, Vd = config.intermediate_size, config.draft_vocab_size
    p_step = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I + H * Vd
    total = 0.0
    for k in range(ttt_steps):
        ctx = mean_doc_len / 2 + k
        total += 6 * p_step + 12 * ctx * nh * hd
    return total + 4 * 3 * tH * H + 2 * tH * Vd


def default_peak_flops(device) -> float | None:
    return 989e12 if getattr(device, "type", str(device)) == "cuda" else None


class MetricsLogger:
    """Rank 0 writes `metrics.jsonl`; trackers (wandb) get the same records."""

    def __init__(self, accelerator, out_dir: Path, *, use_trackers: bool):
        self.acc = accelerator
        self.use_trackers = use_trackers
        self.path = Path(out_dir) / "metrics.jsonl"
        self._fh = None
        if accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)

    def log(self, step: int, record: dict[str, Any], *, prefix: str = "train") -> None:
        if not self.acc.is_main_process:
            return
        clean = {f"{prefix}/{k}": (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        self._fh.write(json.dumps({"step": step, **clean}) + "\n")
        if self.use_trackers:
            self.acc.log({k: v for k, v in clean.items() if v is not None}, step=step)

    def close(self) -> None:
        if self._fh:
            self._fh.close()
            self._fh = None


def progress_bar(total: int, initial: int, enabled: bool):
    """tqdm over optimizer steps on rank 0, quiet when stderr is not a terminal."""
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                disable=not (enabled and sys.stderr.isatty()))
