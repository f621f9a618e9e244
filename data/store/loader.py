"""Packed, rank-sharded, resumable batches of an eyas dataset.

`PackedLoader` packs whole samples into micro-batches of exactly `token_budget` tokens (padding
at the end), following the deterministic plan of `data.store.packing` (read its docstring for the
packing order and the tail rule that gives every rank the same number of batches). Batches are
built on CPU by background threads that read each sample straight into the batch buffers
(`Dataset.read_into`: pread for bf16/bool fields, no intermediate tensors), optionally in pinned
memory.

    loader = PackedLoader(ds, token_budget=8192, rank=r, world_size=W, seed=0)
    for epoch in range(E):
        for batch in loader:              # Batch on CPU; epoch e uses the order of epoch e
            batch = batch.to("cuda")
    state = loader.state_dict()           # {"epoch", "cursor", ...}: exact resume point

The loader alone owns the epoch: iterating to the end of one advances it to the next (cursor 0),
so callers only iterate (`set_epoch` selects an epoch explicitly, e.g. in tests); a resumed
loader (`load_state_dict`) yields exactly the batches the original had not yet handed out.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from eyas.data.store.dataset import Dataset
from eyas.data.store.format import READ_DTYPES
from eyas.data.store.packing import PlanStats, build_plan, embedding_ids, split_indices
from eyas.data.store.read_checks import SkippedSample

__all__ = ["Batch", "PackedLoader", "split_indices"]

log = logging.getLogger(__name__)


def _use_count(t: torch.Tensor) -> int:
    """References to t's storage (tensors and views sharing it)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _BufferPool:
    """Recycles batch buffers on CPU: fresh memory costs a page fault per 4 KiB on first
    touch (on some VMs ~0.5 GB/s), so refilling a buffer that is already mapped is several
    times faster than allocating one.

    A slab (one set of batch tensors) is reused only when no tensor outside the pool still
    shares its storage: batches hand out views, so a Batch (or any view of it) the caller keeps
    holds the slab. When the pool is full, batches get fresh memory (correct, just slower).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.slabs: list[dict] = []
        self.lock = threading.Lock()

    def acquire(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict:
        with self.lock:
            for slab in self.slabs:
                if not slab["busy"] and all(_use_count(t) == slab["base"][k]
                                            for k, t in slab["tensors"].items()):
                    slab["busy"] = True
                    return slab
            tensors = {k: torch.empty(shape, dtype=dt) for k, (shape, dt) in specs.items()}
            T = next(iter(specs.values()))[0][0]
            # clean_from: rows [clean_from, T) of every tensor are known to be zero
            slab = {"tensors": tensors, "base": {k: _use_count(t) for k, t in tensors.items()},
                    "busy": True, "clean_from": T}
            if len(self.slabs) < self.limit:
                self.slabs.append(slab)
            return slab

    def release(self, slab: dict) -> None:
        with self.lock:
            slab["busy"] = False


@dataclass
class Batch:
    """One packed micro-batch of T = token_budget tokens (CPU tensors unless moved).

    Documents are laid out back to back from index 0; the tail after `num_tokens` is padding.
    A PackedLoader refills the memory of batches the caller has dropped: treat a Batch as
    read-only (copy it, e.g. `.to(device)`, before editing it in place).
    """

    input_ids: torch.Tensor                   # [T] int64, padding id 0
    loss_mask: torch.Tensor                   # [T] bool, False on padding
    doc_ids: torch.Tensor                     # [T] int32: 0, 1, 2, … per document, -1 = padding
    positions: torch.Tensor                   # [T] int64: position inside its document (pad: 0)
    aux: torch.Tensor | None = None           # [T, 3*tH] bf16 (None for a tokens dataset)
    last: torch.Tensor | None = None          # [T, tH] bf16 teacher (post-norm last state)
    topk_ids: torch.Tensor | None = None      # [T, k] int64 compact teacher
    topk_logits: torch.Tensor | None = None   # [T, k] float32
    target_argmax: torch.Tensor | None = None  # [T] int64 (pad: 0)
    embeds: torch.Tensor | None = None        # [T+K, H] embedding rows (`attach_embedding`)
    num_tokens: int = 0                       # real (non-padding) tokens

    def _map(self, fn) -> Batch:
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Batch:
        """A copy with every tensor on `device` (async from pinned memory)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """A copy with every tensor in page-locked memory (needs an accelerator)."""
        return self._map(lambda t: t.pin_memory())


#: the optional `Batch` fields a dataset stores (aux, last, topk_ids, topk_logits, target_argmax)
_BATCH_FIELDS = tuple(f.name for f in fields(Batch) if f.default is None and f.name in READ_DTYPES)


class PackedLoader:
    """Iterate packed micro-batches of `dataset` for one rank; deterministic and resumable.

    Args:
        dataset: an opened `Dataset` (tokens or hidden).
        token_budget: tokens per micro-batch T; every Batch tensor has leading dim T. A sample
            longer than T is truncated to its first T tokens (counted in `stats`, logged).
        rank, world_size: this process's share; every rank gets the same number of batches,
            the ranks' batches are disjoint and together cover every sample (see data.store.packing).
        seed: with the epoch, fixes the order; equal on all ranks.
        shuffle: permute samples (and batches) per epoch; False packs in index order.
        drop_last: drop the tail bins instead of splitting them (see data.store.packing).
        num_workers: background threads building batches (0: build in the iterating thread).
        pin_memory: allocate batches in pinned memory (ignored, with a warning, without CUDA).
        indices: restrict to these dataset indices (e.g. from `split_indices`).
        prefetch: batches built ahead per worker.
        load_fields: which optional fields to load (default: all of aux, last, topk_ids,
            topk_logits, target_argmax that the dataset has).
        window: samples packed together (best-fit-decreasing) before bins are shuffled.
        reuse_buffers: refill the memory of batches the caller has dropped instead of
            allocating (CPU memory only; pinned batches come from the CUDA host cache).
    """

    def __init__(self, dataset: Dataset, token_budget: int, rank: int, world_size: int,
                 seed: int, *, shuffle: bool = True, drop_last: bool = False,
                 num_workers: int = 1, pin_memory: bool = False,
                 indices: Sequence[int] | np.ndarray | None = None, prefetch: int = 2,
                 load_fields: Sequence[str] | None = None, window: int = 1024,
                 reuse_buffers: bool = True):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, "
                             f"world_size={world_size}")
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.dataset = dataset
        self.token_budget = int(token_budget)
        self.rank, self.world_size, self.seed = int(rank), int(world_size), int(seed)
        self.shuffle, self.drop_last = shuffle, drop_last
        self.num_workers, self.prefetch, self.window = max(0, num_workers), max(1, prefetch), window
        self.pin_memory = pin_memory and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            log.warning("pin_memory=True ignored: no CUDA device in this process")
        n = len(dataset)
        self.indices = (np.arange(n, dtype=np.int64) if indices is None
                        else np.asarray(indices, dtype=np.int64))
        if self.indices.size and (self.indices.min() < 0 or self.indices.max() >= n):
            raise IndexError(f"indices must lie in [0, {n}) for this dataset")
        self._lengths = dataset.sample_lengths
        present = dataset.fields
        wanted = _BATCH_FIELDS if load_fields is None else tuple(load_fields)
        unknown = [f for f in wanted if f not in _BATCH_FIELDS]
        if unknown:
            raise ValueError(f"load_fields {unknown} unknown; choose from {_BATCH_FIELDS}")
        if load_fields is not None:
            missing = [f for f in wanted if f not in present]
            if missing:
                raise ValueError(f"dataset {dataset.root} has no field(s) {missing}; it has "
                                 f"{sorted(present)}")
        self._fields = [f for f in wanted if f in present]
        self._shapes = {f: tuple(present[f]["shape"]) for f in self._fields}
        self._pool = (_BufferPool(self.num_workers * self.prefetch + 4)
                      if reuse_buffers and not self.pin_memory else None)
        self._epoch, self._cursor = 0, 0
        self._plan_cache: tuple[int, list[list[int]], PlanStats] | None = None
        self._warned_epochs: set[int] = set()
        self._embedding: tuple[torch.Tensor, int] | None = None

    def attach_embedding(self, table: torch.Tensor, ttt_steps: int) -> None:
        """Also fill `Batch.embeds` [T+K, H]: the rows of `table` (a host [V, H] embedding) for
        `packing.embedding_ids(input_ids, ttt_steps)`, looked up in the worker threads
        while the GPU trains (`drafter.host_embedding`)."""
        if table.device.type != "cpu" or table.dim() != 2:
            raise ValueError(f"attach_embedding needs a [V, H] host tensor, got "
                             f"{tuple(table.shape)} on {table.device}")
        self._embedding = (table, int(ttt_steps))

    # ---- plan --------------------------------------------------------------------------
    def global_plan(self, epoch: int | None = None) -> tuple[list[list[int]], PlanStats]:
        """All ranks' bins for `epoch` (default: current) and the plan's counts."""
        e = self._epoch if epoch is None else epoch
        if self._plan_cache is None or self._plan_cache[0] != e:
            bins, stats = build_plan(self._lengths, self.indices, self.token_budget,
                                     self.world_size, self.seed, e, shuffle=self.shuffle,
                                     drop_last=self.drop_last, window=self.window)
            self._plan_cache = (e, bins, stats)
        return self._plan_cache[1], self._plan_cache[2]

    def plan(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches for `epoch`: lists of dataset indices, in iteration order."""
        bins, _ = self.global_plan(epoch)
        return bins[self.rank::self.world_size]

    @property
    def stats(self) -> PlanStats:
        """Counts (truncated, dropped, split, fill, …) of the current epoch's global plan."""
        return self.global_plan()[1]

    def __len__(self) -> int:
        """Batches this rank yields in a full pass of the current epoch."""
        return len(self.plan())

    # ---- epoch / resume ----------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (its order follows from seed and epoch); resets the cursor if the
        epoch changes."""
        if epoch != self._epoch:
            self._epoch, self._cursor = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        """Resume point: epoch and number of batches already handed out in it."""
        return {"epoch": self._epoch, "cursor": self._cursor, "seed": self.seed,
                "world_size": self.world_size, "rank": self.rank,
                "token_budget": self.token_budget, "num_indices": int(len(self.indices))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken. The plan settings must match."""
        for key, mine in (("seed", self.seed), ("world_size", self.world_size),
                          ("token_budget", self.token_budget),
                          ("num_indices", len(self.indices))):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"loader state has {key}={state[key]} but this loader has {mine}: the batch "
                    f"order would differ, so the resume would not be exact. Resume with the "
                    f"same {key}, or start a new epoch with a fresh loader")
        self._epoch, self._cursor = int(state["epoch"]), int(state["cursor"])
        if self._cursor > len(self):
            raise ValueError(f"loader state cursor {self._cursor} exceeds the {len(self)} "
                             f"batches of epoch {self._epoch}")

    # ---- batches -----------------------------------------------------------------------
    def _specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        T = self.token_budget
        specs = {"input_ids": ((T,), torch.int64), "loss_mask": ((T,), torch.bool),
                 "doc_ids": ((T,), torch.int32), "positions": ((T,), torch.int64)}
        for f in self._fields:
            shape = (T, int(np.prod(self._shapes[f]))) if f == "aux" else (T, *self._shapes[f])
            specs[f] = (shape, READ_DTYPES[f])
        if self._embedding is not None:
            table, K = self._embedding
            specs["embeds"] = ((T + K, table.shape[1]), table.dtype)
        return specs

    def build_batch(self, docs: Sequence[int]) -> Batch:
        """Read and pack the samples `docs` (dataset indices) into one Batch."""
        T = self.token_budget
        slab = None
        if self._pool is not None:
            slab = self._pool.acquire(self._specs())
            bufs = {k: t.view(t.shape) for k, t in slab["tensors"].items()}  # views hold the slab
        else:
            bufs = {k: torch.empty(shape, dtype=dt, pin_memory=self.pin_memory)
                    for k, (shape, dt) in self._specs().items()}
        try:
            batch = self._fill(bufs, docs, T, T if slab is None else slab["clean_from"])
            if slab is not None:
                slab["clean_from"] = batch.num_tokens
            return batch
        finally:
            if slab is not None:
                self._pool.release(slab)

    def _fill(self, bufs: dict[str, torch.Tensor], docs: Sequence[int], T: int,
              clean_from: int) -> Batch:
        """Pack `docs` into `bufs`; rows [clean_from, T) are already zero (recycled buffer)."""
        b = Batch(**bufs)
        pos = d = 0
        for i in docs:
            dst = {"input_ids": b.input_ids[pos:], "loss_mask": b.loss_mask[pos:]}
            for f in self._fields:
                t = getattr(b, f)[pos:]
                dst[f] = t.view(t.shape[0], *self._shapes[f]) if f == "aux" else t
            try:
                n = self.dataset.read_into(int(i), dst, T - pos)
            except SkippedSample as e:   # data.nonfinite=skip: left out, its rows cleared
                for t in dst.values():
                    t[:e.length].zero_()
                continue
            b.doc_ids[pos:pos + n] = d
            d += 1
            torch.arange(n, out=b.positions[pos:pos + n])
            pos += n
        # padding: zeros after the last document (doc id -1). The large aux/last rows of a
        # recycled buffer beyond its previous batch's end are still zero: not written again.
        for name in ("input_ids", "loss_mask", "positions", *self._fields):
            end = max(pos, clean_from) if name in ("aux", "last") else T
            getattr(b, name)[pos:end].zero_()
        b.doc_ids[pos:] = -1
        b.num_tokens = pos
        if self._embedding is not None:
            table, K = self._embedding
            # the ids followed by K padding ids, which the drafter slices
            torch.index_select(table, 0, embedding_ids(b.input_ids, K), out=b.embeds)
        return b

    def __iter__(self) -> Iterator[Batch]:
        epoch = self._epoch
        plan = self.plan(epoch)
        stats = self.stats
        if stats.truncated and epoch not in self._warned_epochs:
            self._warned_epochs.add(epoch)
            log.warning("epoch %d: %d sample(s) longer than token_budget=%d are truncated to it",
                        epoch, stats.truncated, self.token_budget)
        if stats.dropped and epoch not in self._warned_epochs:
            self._warned_epochs.add(epoch)
            log.info("epoch %d: drop_last skips %d sample(s) of the tail", epoch, stats.dropped)
        todo = plan[self._cursor:]
        if self.num_workers == 0:
            for docs in todo:
                batch = self.build_batch(docs)
                self._cursor += 1
                yield batch
        else:
            pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="eyas-loader")
            try:
                it = iter(todo)
                pending = collections.deque(pool.submit(self.build_batch, docs) for docs in
                                            itertools.islice(it, self.num_workers * self.prefetch))
                while pending:
                    batch = pending.popleft().result()
                    nxt = next(it, None)
                    if nxt is not None:
                        pending.append(pool.submit(self.build_batch, nxt))
                    self._cursor += 1
                    yield batch
            finally:   # the batches not started yet are cancelled
                pool.shutdown(wait=True, cancel_futures=True)
        if self._epoch == epoch and self._cursor >= len(plan):
            self._epoch, self._cursor = epoch + 1, 0
