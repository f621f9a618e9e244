"""Draft-vocabulary coverage of a dataset's trained tokens, and how target-written the data is
(`eyas doctor`, models/serving/doctor.py)."""

from __future__ import annotations

import sys
from typing import Any

import torch


def _in_vocab(t2d: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """t2d[ids]; ids past the end of t2d (a dataset of a target with a larger vocabulary) are
    outside the draft vocabulary."""
    known = (ids >= 0) & (ids < t2d.numel())
    out = torch.zeros(ids.shape, dtype=torch.bool)
    out[known] = t2d[ids[known]]
    return out


def vocab_coverage(dataset: Any, t2d: torch.Tensor, max_samples: int = 2000) -> dict[str, Any]:
    """Draft-vocabulary coverage of the trained tokens, and how target-like the data is.

    For every trained token t (loss_mask[t]): is input_ids[t] in t2d (`token_coverage`); is the
    target's own choice for that position, target_argmax[t-1], in t2d (`argmax_coverage`); and
    does the text follow the target's choice, input_ids[t] == target_argmax[t-1]
    (`target_agreement`). Reads up to `max_samples` samples spread evenly over the dataset.
    """
    from tqdm import tqdm
    n = len(dataset)
    idx = sorted(set(int(i) for i in torch.linspace(0, n - 1, min(n, max_samples)).round()))
    has_argmax = "target_argmax" in getattr(dataset, "fields", {})
    fields = ("input_ids", "loss_mask") + (("target_argmax",) if has_argmax else ())
    tok_in = tok_all = arg_in = arg_all = agree = 0
    for i in tqdm(idx, desc="draft vocab coverage", disable=not sys.stderr.isatty()):
        s = dataset.sample(i, fields)
        mask = s["loss_mask"].bool()
        ids = s["input_ids"][mask]
        tok_in += int(_in_vocab(t2d, ids).sum())
        tok_all += int(ids.numel())
        if has_argmax:
            pred = s["target_argmax"][:-1][mask[1:]]   # the target's choice for each trained token
            arg_in += int(_in_vocab(t2d, pred).sum())
            arg_all += int(pred.numel())
            agree += int((pred == s["input_ids"][1:][mask[1:]]).sum())
    return {"samples": len(idx), "tokens": tok_all,
            "token_coverage": tok_in / tok_all if tok_all else None,
            "argmax_coverage": arg_in / arg_all if arg_all else None,
            "target_agreement": agree / arg_all if arg_all else None}
