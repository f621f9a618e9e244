"""Metrics out of the loop: the window accumulated on the device between two log lines, a
JSONL file always, wandb through accelerate when configured, on rank 0 a tqdm bar on a terminal
and a log line per window (train.log, and stderr off a terminal), and the FLOP count behind MFU.

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
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eyas.models.metrics import accept_counts, add_counts, summarize

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


class MetricsWindow:
    """Loss, counts, tokens and timings accumulated between two log lines. `steps` (optimizer
    steps, counted by the trainer) and `slots` (batch rows, padding included) give `step_ms`
    and the packing `fill`: tokens/s counts real tokens only."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.loss, self.step_loss, self.n = 0.0, 0.0, 0   # device tensors after the first add
        self.tokens, self.counts, self.wait = 0, None, 0.0
        self.slots, self.steps = 0, 0       # batch rows incl. padding; optimizer steps
        self.gnorm, self.t0 = None, time.perf_counter()
        self.lr = float("nan")              # the learning rate of the window's last step

    def add(self, res, batch, d2t):
        """Accumulate one micro-batch on the device (no host sync). A micro-batch with a NaN/inf
        loss adds only its tokens: its step is skipped and its metrics are meaningless."""
        loss = res.loss.detach().float()
        ok = torch.isfinite(loss)
        self.loss = self.loss + torch.where(ok, loss, 0.0)
        self.step_loss = self.step_loss + torch.where(ok, res.step_loss.detach().float(), 0.0)
        self.n = self.n + ok.to(torch.int64)
        self.tokens += batch.num_tokens
        self.slots += batch.input_ids.shape[0]
        counts = accept_counts(res.draft_argmax.detach(), d2t, batch.target_argmax,
                               res.metric_mask)
        counts.update(res.alpha)
        self.counts = add_counts(self.counts, {k: v * ok for k, v in counts.items()})

    def flush(self, accelerator, flops_per_token: float, peak: float | None) -> dict[str, float]:
        """The record of this window, summed over ranks; the host syncs happen here. Its `lr` is
        `self.lr`: the rate the window's last step trained at (read before the scheduler
        advanced)."""
        dt = time.perf_counter() - self.t0
        dev = accelerator.device
        n = accelerator.reduce(torch.as_tensor(self.n, dtype=torch.float32, device=dev), "sum")
        loss = accelerator.reduce(torch.as_tensor(self.loss, dtype=torch.float32, device=dev),
                                  "sum")
        tokens = accelerator.reduce(torch.tensor(float(self.tokens), device=dev), "sum")
        rec = {"loss": float(loss / n), "lr": self.lr,   # NaN if no micro-batch was finite
               "tokens_per_s": float(tokens) / dt, "data_wait": self.wait / dt,
               # wall time per optimizer step, padding included (and any eval, checkpoint
               # or export of the previous log step): compare with benchmarks/train_step.py
               "step_ms": 1e3 * dt / max(self.steps, 1),
               "fill": float(tokens) / max(self.slots * accelerator.num_processes, 1),
               "grad_norm": float(self.gnorm) if self.gnorm is not None else float("nan")}
        if self.counts is not None:
            per_step = accelerator.reduce(self.step_loss, "sum") / n             # [K]
            rec.update({f"loss_{k}": float(v) for k, v in enumerate(per_step)})
            counts = {k: accelerator.reduce(v, "sum") for k, v in self.counts.items()}
            rec.update(summarize(counts))
        else:
            rec["tau"] = float("nan")
        if peak:
            rec["mfu"] = flops_per_token * rec["tokens_per_s"] / (peak * accelerator.num_processes)
        if dev.type == "cuda":
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        self.reset()
        return rec


def mean_over_ranks(accelerator, values: list) -> float:
    """The mean of every rank's scalar device tensors `values` (NaN when there are none; a rank
    without any adds zeros, so the collective still matches)."""
    dev = accelerator.device
    total = torch.stack(values).sum() if values else torch.zeros((), device=dev)
    pair = torch.stack([total.to(dev, torch.float32),
                        torch.tensor(float(len(values)), device=dev)])
    pair = accelerator.reduce(pair, "sum")
    return float(pair[0] / pair[1]) if float(pair[1]) else float("nan")


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
        from eyas.data.common.utils import json_safe
        clean = {f"{prefix}/{k}": json_safe(v) for k, v in record.items()}
        self._fh.write(json.dumps({"step": step, **clean}) + "\n")
        if self.use_trackers:   # scalars only: tables (eval/by_context) stay in metrics.jsonl
            self.acc.log({k: v for k, v in clean.items()
                          if v is not None and not isinstance(v, (list, dict))}, step=step)

    def keep_through(self, step: int) -> int:
        """Drop the records after `step` (rank 0), before a run continues from it: they belong
        to a continuation it replaces (steps past a resumed checkpoint, a killed run's torn last
        line). Rewritten atomically; returns how many records were dropped."""
        if self._fh is None or not self.path.stat().st_size:
            return 0
        from eyas.data.common.utils import atomic_write_bytes
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                ok = int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                ok = False
            kept += [line] if ok else []
            dropped += not ok
        if dropped:
            self._fh.close()
            atomic_write_bytes(self.path, "".join(f"{x}\n" for x in kept).encode())
            self._fh = open(self.path, "a", buffering=1)
            log.info("metrics.jsonl: dropped %d record(s) after step %d", dropped, step)
        return dropped

    def close(self) -> None:
        if self._fh:
            self._fh.close()
            self._fh = None


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def alpha_text(rec: dict[str, float]) -> str:
    """`alpha 0.61 0.48 0.40 (tau_alpha 2.31)`: the expected acceptance per TTT step and the τ
    its chain implies (`models.metrics`), or "" for a record without them."""
    rates = [rec[f"alpha_{k}"] for k in range(len(rec)) if f"alpha_{k}" in rec]
    if not rates:
        return ""
    return f"alpha {' '.join(f'{a:.2f}' for a in rates)} (tau_alpha {rec['tau_alpha']:.3f})"


def progress_line(step: int, total: int, rec: dict[str, float], elapsed: float,
                  eta: float | None) -> str:
    """`step 20/100 (20%) | loss 5.123 | tau 1.52 | alpha 0.61 0.48 (tau_alpha 2.09) | tok/s
    1234 | lr 3.00e-04 | elapsed 0:01:02 | eta 0:04:08`: one window of training, a log line."""
    alpha = alpha_text(rec)
    return (f"step {step}/{total} ({100 * step / max(total, 1):.0f}%) | loss {rec['loss']:.4f}"
            f" | tau {rec['tau']:.3f}" + (f" | {alpha}" if alpha else "")
            + f" | tok/s {rec['tokens_per_s']:.0f} | lr {rec['lr']:.2e}"
            f" | elapsed {_clock(elapsed)} | eta {_clock(eta) if eta is not None else '?'}")


class Progress:
    """Training progress on rank 0: the tqdm bar on a terminal, and a log line per metrics
    window (`progress_line`) for everything else. The line is a progress record
    (data.common.log.PROGRESS): a terminal drops it (the bar shows the same), a redirected stderr
    (nohup, slurm) and the run's train.log keep it. The eta counts from the first window's end
    once there is one: that window holds the compile and the first batches' warm-up, which
    the rest of the run does not repeat."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm.auto import tqdm
        self.total, self.initial, self.enabled = total, initial, enabled
        self.t0 = time.perf_counter()
        self.first: tuple[float, int] | None = None   # (time, step) at the first report
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=not (enabled and sys.stderr.isatty()))

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def report(self, step: int, rec: dict[str, float]) -> None:
        """The window record `rec` (MetricsWindow.flush) at optimizer step `step`."""
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                             tau=f"{rec['tau']:.2f}")
        if not self.enabled:
            return
        from eyas.data.common.log import PROGRESS
        now = time.perf_counter()
        since, start = self.first or (self.t0, self.initial)
        done = step - start
        eta = (now - since) / done * (self.total - step) if done > 0 else None
        if self.first is None:
            self.first = (now, step)
        log.info("%s", progress_line(step, self.total, rec, now - self.t0, eta),
                 extra={PROGRESS: True})

    def close(self) -> None:
        self.bar.close()
