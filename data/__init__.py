"""eyas data layer: token and hidden-state datasets, packed loading, draft vocabularies.

Formats and I/O only (no distributed code). The on-disk format is documented in data/store/FORMAT.md.
Submodules are imported lazily so `import eyas.data` stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from eyas.data.store.dataset import Dataset

__all__ = ["load_sample", "open_cached"]

_OPEN: dict[Path, tuple[int, Dataset]] = {}   # resolved path -> (manifest mtime, dataset)


def open_cached(dataset_dir: str | os.PathLike) -> "Dataset":
    """`open_dataset(dataset_dir)`, cached per resolved path and manifest modification time."""
    from eyas.data.store.dataset import open_dataset
    from eyas.data.store.format import MANIFEST_NAME

    root = Path(dataset_dir).resolve()
    try:
        stamp = (root / MANIFEST_NAME).stat().st_mtime_ns
    except OSError:
        stamp = -1
    hit = _OPEN.get(root)   # one dict read and one store: thread-safe without a lock
    if hit is None or hit[0] != stamp:
        hit = _OPEN[root] = (stamp, open_dataset(root))
    return hit[1]


def load_sample(dataset_dir: str | os.PathLike, index: int) -> "dict[str, torch.Tensor]":
    """Sample `index` of the dataset in `dataset_dir` as a dict of CPU tensors (zero-copy views
    where the stored dtype allows; see data/store/FORMAT.md). The opened dataset is cached."""
    return open_cached(dataset_dir)[index]
