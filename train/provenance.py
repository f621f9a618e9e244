"""The run record every checkpoint and export carries: how this drafter was made.

    run_record(t, step, eval_record) -> dict   # written as <checkpoint>/eyas_provenance.json

The export builds its model card and `eyas_provenance.json` from this record
(models/serving/card.py), so the run's final export and `eyas export` of a checkpoint render
the same card. It holds the resolved config, the datasets with their manifests' SHA-256 and
lineage (data/common/provenance.py), the capture contract of the training set, the software, the
steps and tokens trained, the eval record of `step` and which checkpoint the export is.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from eyas.data.common.provenance import capture_contract, dataset_record, software_record
from eyas.data.produce.vocab import count_tokens
from eyas.train.config import to_plain


def vocab_coverage(dataset, t2d: torch.Tensor, count: str = "auto") -> float | None:
    """The fraction of the dataset's counted tokens (the ones the draft vocabulary was chosen
    from, data.vocab.count_tokens, which reads a dataset once per process) that the draft
    vocabulary holds."""
    t2d = t2d.detach().to("cpu", torch.bool)
    counts = count_tokens(dataset, int(t2d.numel()), count)
    total = int(counts.sum())
    return int(counts[t2d.numpy()].sum()) / total if total else None


def _training(t, step: int) -> dict[str, Any]:
    loader, accum = t.data.train, int(t.cfg.optim.grad_accum)
    lengths = loader.dataset.sample_lengths
    per_epoch_tokens = int(lengths[loader.indices].sum()) if len(loader.indices) else 0
    per_epoch_steps = math.ceil(len(loader) / accum) if len(loader) else 0
    epochs = step / per_epoch_steps if per_epoch_steps else None
    return {"steps": int(step), "total_steps": int(t.total_steps),
            "world_size": int(t.accelerator.num_processes),
            "steps_per_epoch": per_epoch_steps, "epochs": epochs,
            "tokens_per_epoch": per_epoch_tokens,
            "tokens_seen": None if epochs is None else round(epochs * per_epoch_tokens)}


def run_record(t, step: int, eval_record: Mapping[str, Any] | None) -> dict[str, Any]:
    """The provenance of trainer `t` at optimizer step `step` (`eval_record`: its eval)."""
    train_ds = t.data.train.dataset
    eval_ds = None if t.data.eval is None else t.data.eval.dataset
    datasets = [dataset_record(train_ds.root, "train") if not getattr(train_ds, "streamed", False)
                else {**dataset_record(train_ds.tokens.root, "tokens"), "role": "train",
                      "streamed": {"into": str(train_ds.root), "keep": train_ds.keep}}]
    if eval_ds is not None and eval_ds is not train_ds:
        datasets.append(dataset_record(eval_ds.root, "eval"))
    manifest = train_ds.manifest
    tcfg = t.data.target_config or {}
    return {"format": "eyas-provenance", "version": 1,
            "target": {"name": str(t.cfg.target.name),
                       "fingerprint": manifest.get("target_fingerprint"),
                       "model_type": tcfg.get("model_type"),
                       "architectures": tcfg.get("architectures")},
            "drafter": {"vocab_coverage": vocab_coverage(train_ds, t.model.t2d,
                                                         t.cfg.data.vocab_count)},
            "datasets": datasets, "capture": capture_contract(manifest),
            "training": _training(t, step), "eval": dict(eval_record or {}) or None,
            # this step's own weights; the run's final export replaces it with what
            # export.select chose and why (train.run_export)
            "selected": {"step": int(step), "by": "checkpoint"},
            "config": to_plain(t.cfg), "software": software_record()}
