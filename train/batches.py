"""The trainer's batches on its device, copied one step ahead on a side CUDA stream.

    batches = DeviceBatches(loader, device, ttt_steps, skip_masked_rows, prefetch=True)
    batch, inputs = next(batches)     # on the device: TrainingModule(**inputs)
    batches.state_dict()              # the loader's resume point for the batches handed out
    batches.take_wait()               # seconds spent waiting for the loader since the last call

The loader (`data.store.loader.PackedLoader`) builds pinned host batches in its threads; moving one
to the GPU is ~170 MB at the Llama-8B shape and T = 4096 (aux, teacher state, embedding rows).
Copied in line, that transfer sits on the compute stream between two steps. With `prefetch`
(`data.device_prefetch`, on with CUDA) batch n+1 is copied on a side stream while step n
computes, and the compute stream waits for that copy only where it uses the batch; the cost is
one batch more on the device (the side stream's allocations form a pool of their own: with
gradient accumulation, two or three batches of reserved memory).

Prefetching means the loader has handed out one batch more than the trainer has used, so
`state_dict` returns the loader's position minus the batch held here: a checkpoint resumes at
the first batch the trainer has not trained on, as without prefetching. A sample that fails its
read checks (`data.verify`) stops the run one micro-batch earlier than without prefetching.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from eyas.data.store.loader import Batch, PackedLoader
from eyas.train.step import to_device


def micro_batches(loader: PackedLoader) -> Iterator[Batch]:
    """The training batches, one epoch after another (an optimizer step may span two)."""
    while True:
        yield from one_pass(loader)


def one_pass(loader: PackedLoader) -> Iterator[Batch]:
    """The rest of the loader's current epoch. The loader alone owns the epoch: it moves to the
    next one when a pass ends, so the trainer only iterates (and resume state stays exact)."""
    if len(loader.plan(loader.epoch)) == 0:
        raise ValueError("the training loader has no batches: the dataset is empty or smaller "
                         "than one rank's share")
    yield from loader


class DeviceBatches:
    """Endless (batch, TrainingModule inputs) pairs on `device` from `loader`'s epochs.

    ttt_steps and skip_masked_rows are `train.step.to_device`'s. prefetch: fetch the next batch
    when handing one out, its copy on a side stream on CUDA (elsewhere the batch is only held:
    no faster, but the same batches and resume points, which the CPU tests check)."""

    def __init__(self, loader: PackedLoader, device, ttt_steps: int, skip_masked_rows: bool,
                 *, prefetch: bool = True):
        self.loader = loader
        self.device = torch.device(device)
        self.ttt_steps, self.skip_masked_rows = int(ttt_steps), bool(skip_masked_rows)
        self._host = micro_batches(loader)
        self.prefetch = bool(prefetch)
        self._stream = (torch.cuda.Stream(self.device)
                        if self.prefetch and self.device.type == "cuda" else None)
        self._ahead: tuple[Batch, dict] | None = None
        self._wait = 0.0

    def __iter__(self) -> DeviceBatches:
        return self

    def __next__(self) -> tuple[Batch, dict]:
        if not self.prefetch:
            return self._fetch()
        if self._ahead is None:
            self._ahead = self._fetch()
        batch, inputs = self._ahead
        if self._stream is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self._stream)
            for t in _tensors(batch, inputs):
                t.record_stream(main)  # made on the side stream, freed after main has used it
        self._ahead = None
        self._ahead = self._fetch()    # the next copy overlaps this step's compute
        return batch, inputs

    def _fetch(self) -> tuple[Batch, dict]:
        t = time.perf_counter()
        host = next(self._host)
        self._wait += time.perf_counter() - t
        if self._stream is None:
            return to_device(host, self.device, self.ttt_steps, self.skip_masked_rows)
        with torch.cuda.stream(self._stream):
            return to_device(host, self.device, self.ttt_steps, self.skip_masked_rows)

    def take_wait(self) -> float:
        """Seconds spent waiting for the loader's next host batch since the last call."""
        wait, self._wait = self._wait, 0.0
        return wait

    def state_dict(self) -> dict[str, Any]:
        """The loader's resume point at the first batch not yet returned by `next`."""
        state = dict(self.loader.state_dict())
        if self._ahead is not None:      # fetched, not used: the resume must yield it again
            assert state["cursor"] >= 1, "a held batch comes from the loader's current epoch"
            state["cursor"] -= 1
        return state

    def close(self) -> None:
        """Stop the loader's threads (the generator's cleanup) and drop the held batch."""
        self._ahead = None
        self._host.close()


def _tensors(batch: Batch, inputs: dict) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in [*vars(batch).values(), *inputs.values()]:
        if isinstance(t, torch.Tensor):
            seen[id(t)] = t
    return list(seen.values())
