"""`eyas doctor --data`: the export's expected acceptance α per TTT position on the dataset.

The export is imported into the training module with the target's embedding, unrolled over up
to --alpha-samples samples of the dataset (spread over it), and scored against the teacher the
dataset stores (`models.alpha`): α_k = Σ min(p̂, q) averaged over the assistant positions, and
the τ of its chain, 1 + Σ_k Π_{j≤k} α_k. This needs the target's weights (embedding and
lm_head) and a dataset with a teacher (`last` or a top-k); without either the report says why
it did not check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

#: tokens per packed batch of the α check
TOKEN_BUDGET = 4096


def alpha_on_data(export_dir: Path, data: Path, target, k: int, samples: int,
                  device: str = "cpu") -> dict:
    """{alpha: [α_k], tau_alpha, samples, rows} of the export on `samples` of the dataset."""
    from eyas.data.common.targets import load_embedding_and_head
    from eyas.data.store.dataset import open_dataset
    from eyas.data.store.loader import PackedLoader
    from eyas.models.alpha import batch_alpha
    from eyas.models.metrics import add_counts, alpha_chain, alpha_rates
    from eyas.models.objective import metric_mask
    from eyas.models.serving.importer import load_training_drafter
    ds = open_dataset(data)
    teacher = ("last",) if "last" in ds.fields else ("topk_ids", "topk_logits")
    drafter = load_training_drafter(export_dir, target, device=device)
    _, head = load_embedding_and_head(target)
    rows = head[drafter.target_ids.cpu()].to(device, torch.float32)
    idx = np.unique(np.linspace(0, len(ds) - 1, min(samples, len(ds))).round().astype(int))
    loader = PackedLoader(ds, TOKEN_BUDGET, 0, 1, seed=0, shuffle=False, indices=idx,
                          load_fields=("aux", *teacher))
    counts = None
    with torch.no_grad():
        for batch in loader:
            batch = batch.to(device)
            out = drafter(batch.input_ids, batch.aux, batch.doc_ids, batch.positions, k)
            mask = metric_mask(out.valid, batch.loss_mask)
            counts = add_counts(counts, batch_alpha(drafter, out.hidden, mask, batch, rows))
    if counts is None:
        raise ValueError(f"{data}: no sample to score")
    rates = alpha_rates(counts)
    return {"alpha": rates, "tau_alpha": alpha_chain(rates)[-1], "samples": int(len(idx)),
            "rows": [int(x) for x in counts["alpha_rows"]]}


def check_alpha(report, export_dir: Path, data: Path, target, k: int | None,
                samples: int) -> None:
    """Add the export's α per position on `data` to the report (stats["alpha"] and a checked
    line), or a not-checked line saying what was missing."""
    from eyas.data.store.dataset import open_dataset
    if not ({"last", "topk_ids"} & set(open_dataset(data).fields)):
        report.not_checked.append(f"expected acceptance α per position: {data} stores no "
                                  f"teacher (extract with --teacher last or topk)")
        return
    k = int(k or 1)
    try:
        res = alpha_on_data(export_dir, data, target, k, samples)
    except (OSError, ValueError, KeyError) as e:
        report.not_checked.append(f"expected acceptance α per position: {e}")
        return
    report.stats["alpha"] = res
    rates = " ".join(f"{a:.3f}" for a in res["alpha"])
    report.checked.append(f"expected acceptance α per position on {res['samples']} samples "
                          f"of the data: {rates} (chain τ {res['tau_alpha']:.3f} at K {k})")
