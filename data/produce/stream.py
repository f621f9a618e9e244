"""Capture and train at once (`data.stream`): the target's states go from a producer straight
to the trainer's loader, with the disk bounded (`keep=none`) or the dataset kept as it comes
(`keep=all`).

The loader's packing plan depends only on the samples' lengths and the seed, and the token
dataset gives the lengths before anything is captured. So a `StreamedDataset` stands where an
extracted dataset would: the same `PackedLoader` plans the same batches, and each read waits
until the producer has captured that sample. The producer (`Producer`, a thread of the rank it
feeds) captures through the capturer `eyas extract` uses (data/produce/capturers.py), in the
order the loader reads: this rank's held-out samples first (kept until the run ends), then
the training order from the loader's resume point, at most `ahead` samples before the loader.
Each captured sample is one file in the spool (a one-sample shard, aux in bf16 whatever the
storage mode: an fp8 dataset's reader quantises it as the shard would, so the trainer reads
the same values).

- ``keep=all``: once every sample of an extraction-plan shard is in the spool, that shard is
  written from them (the plan, shard files and manifest are what `eyas extract` of the same
  tokens writes, byte for byte) and its spool files go. After the first pass (and the samples
  no loader reads, split by rank) the manifest is written; later epochs, a resume and later
  runs read the dataset. Peak disk: about the dataset.
- ``keep=none``: a training sample's file goes once the loader has read it, so every epoch
  captures again; the spool never holds more than `spool_bytes` (checked free at the start).

Several ranks (one machine): each rank has its own producer and captures its own samples (the
loader's split, no sample twice); ``keep=all`` shard j is written by rank j mod world and the
manifest by rank 0 once every shard exists. With ``hf`` each rank's target sits on its own GPU,
which is why the producer is per rank; an ``endpoint`` serves every rank's requests.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from bisect import bisect_right
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eyas.data.common.capture import ExtractError
from eyas.data.store.dataset import ShardFile
from eyas.data.store.format import dequantize_fp8, quantize_fp8

log = logging.getLogger(__name__)

SPOOL = ".spool"
#: seconds a waiting reader sleeps between looks at the spool
POLL = 0.02


def spool_name(i: int) -> str:
    return f"sample-{i:09d}.safetensors"


class StreamClosed(RuntimeError):
    """A read after the stream was closed (the run is ending)."""


class StreamedDataset:
    """The loader's view of a dataset being captured (see the module docstring): length,
    sample lengths, fields and manifest of the dataset to be, and `read_into` / `sample` that
    wait for the producer."""

    streamed = True      # data/produce/vocab.py counts next tokens: no target_argmax yet

    def __init__(self, tokens, plan: dict[str, Any], out: Path, spool: Path, *, keep: str,
                 fields: dict[str, Any]):
        self.tokens, self.plan, self.root, self.spool, self.keep = tokens, plan, out, spool, keep
        self.manifest = dict(plan["manifest"], fields=fields, kind="hidden")
        self.fields = fields
        self.aux_format = plan["aux_format"]
        n = plan["manifest"]["tokens_dataset"]["n_samples"]
        self.sample_lengths = np.asarray(tokens.sample_lengths[:n])
        self._first = [a for a, _ in plan["shards"]]
        self._shards: dict[int, ShardFile] = {}
        self.pinned: set[int] = set()       # held-out samples: read at every eval, never dropped
        self.cond = threading.Condition()
        self.consumed = 0                   # training samples read so far
        self.reads: dict[int, int] = {}     # keep=none: reads still due of each spool file
        self.spool_bytes = 0                # bytes of spool files written and not yet removed
        self.error: BaseException | None = None
        self.read_checks = None             # the read checks of an extracted dataset: not here
        self.start = None                   # starts the producer at the first read (after resume)

    def __len__(self) -> int:
        return len(self.sample_lengths)

    def shard_of(self, i: int) -> tuple[int, int]:
        """(plan shard, index inside it) of sample i."""
        j = bisect_right(self._first, i) - 1
        return j, i - self._first[j]

    def available(self, i: int) -> bool:
        """Whether sample i can be read now (its shard or its spool file exists)."""
        from eyas.data.store.shards import shard_name
        if (self.spool / spool_name(i)).is_file():
            return True
        return self.keep == "all" and (self.root / shard_name(self.shard_of(i)[0])).is_file()

    def _open(self, i: int) -> tuple[ShardFile, int] | None:
        from eyas.data.store.shards import shard_name
        j, local = self.shard_of(i)
        if j in self._shards:
            return self._shards[j], local
        path = self.root / shard_name(j)
        if self.keep == "all" and path.is_file():
            self._shards[j] = ShardFile(path)
            return self._shards[j], local
        try:
            return ShardFile(self.spool / spool_name(i)), 0
        except FileNotFoundError:
            return None

    def _wait(self, i: int) -> tuple[ShardFile, int]:
        if self.start is not None:
            self.start()
        while True:
            found = self._open(i)
            if found is not None:
                return found
            if self.error is not None:
                raise self.error
            with self.cond:
                self.cond.wait(POLL)

    def read_into(self, i: int, out: dict[str, torch.Tensor], length: int | None = None) -> int:
        n = int(self.sample_lengths[i])
        n = n if length is None else min(n, int(length))
        shard, local = self._wait(i)
        shard.read_into(local, out, n)
        if self.aux_format == "fp8" and "aux" in out and shard.meta.get("aux_format") != "fp8":
            aux = out["aux"][:n]         # a bf16 spool file: the values its fp8 shard will hold
            dequantize_fp8(*quantize_fp8(aux), out=aux)
        self._consumed(i, shard)
        return n

    def sample(self, i: int, fields: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        if fields is not None and set(fields) <= {"input_ids", "loss_mask"}:
            return self.tokens.sample(i, fields)
        shard, local = self._wait(i)
        out = shard.sample(local, fields)
        if self.aux_format == "fp8" and "aux" in out and shard.meta.get("aux_format") != "fp8":
            out["aux"] = dequantize_fp8(*quantize_fp8(out["aux"]))
        return out

    def _consumed(self, i: int, shard: ShardFile) -> None:
        if i in self.pinned:
            return
        with self.cond:
            self.consumed += 1
            if self.keep == "none" and shard.path.parent == self.spool:
                left = self.reads.get(i, 0) - 1
                self.reads[i] = left
                if left <= 0:               # its last read in the producer's window
                    self.reads.pop(i)
                    size = shard.path.stat().st_size if shard.path.exists() else 0
                    shard.path.unlink(missing_ok=True)
                    self.spool_bytes -= size
            self.cond.notify_all()


class Producer(threading.Thread):
    """Captures this rank's samples into the spool in the loader's order (module docstring)."""

    def __init__(self, ds: StreamedDataset, capturer, *, train, held_out, rank: int,
                 world_size: int, ahead: int, spool_bytes: int, window: int = 64):
        super().__init__(name=f"eyas-capture[{rank}]", daemon=True)
        self.ds, self.capturer, self.train = ds, capturer, train
        # a held-out loader over another dataset has nothing to capture here
        self.held_out = held_out if held_out is not None and held_out.dataset is ds else None
        self.rank, self.world_size = rank, world_size
        self.ahead, self.budget, self.window = max(1, ahead), spool_bytes, max(1, window)
        self.stopping = threading.Event()
        self.captured = 0                   # samples this producer captured (for the log)
        self.issued = 0                     # training samples of the order passed so far
        self.finishing = False              # keep=all: everything captured, shards to write

    # ---- the order ---------------------------------------------------------------------
    def _epoch_order(self, epoch: int, start_batch: int) -> list[int]:
        return [i for docs in self.train.plan(epoch)[start_batch:] for i in docs]

    def _leftovers(self) -> list[int]:
        """Samples no loader reads (dropped tails), split by rank, so every shard completes."""
        read = {i for docs in self.train.global_plan(0)[0] for i in docs}
        if self.held_out is not None:
            read |= {i for docs in self.held_out.global_plan(0)[0] for i in docs}
        return [i for i in range(len(self.ds)) if i not in read and i % self.world_size
                == self.rank]

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        from eyas.data.produce.engine_capture import engine_stops
        try:
            with engine_stops(lambda: "the streamed training stops here: run the same command "
                              "with train.resume=latest to continue from its last checkpoint "
                              "(the capture continues with it)"):
                device = getattr(self.capturer, "device", None)
                if device is not None and device.type == "cuda":
                    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
                        self._run()     # its own stream: the target's kernels beside training's
                else:
                    self._run()
        except BaseException as e:          # noqa: BLE001 - handed to the reader, which raises
            self.ds.error = e
            with self.ds.cond:
                self.ds.cond.notify_all()
        log.info("stream: rank %d captured %d sample(s)", self.rank, self.captured)

    def _run(self) -> None:
        held = [] if self.held_out is None else [i for docs in self.held_out.plan(0) for i in docs]
        self.ds.pinned.update(held)
        self._capture(held, bounded=False)
        state = self.train.state_dict()
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if self.ds.keep == "all":
            self._capture(self._epoch_order(epoch, cursor) if epoch == 0 else [], bounded=True)
            self._capture(self._leftovers(), bounded=False)
            self._finish_shards()
            return
        while not self.stopping.is_set():
            self._capture(self._epoch_order(epoch, cursor), bounded=True)
            epoch, cursor = epoch + 1, 0

    def _capture(self, order: list[int], *, bounded: bool) -> None:
        pos = 0
        while pos < len(order) and not self.stopping.is_set():
            room = self.window
            if bounded:
                self._wait_for_room()
                room = self.ahead - (self.issued - self.ds.consumed)
            chunk = order[pos:pos + max(1, min(self.window, room))]
            due = Counter(chunk)            # a sample may come twice: the end of one epoch and
            with self.ds.cond:              # the start of the next
                todo = [i for i in due if not self.ds.available(i)]
                for i in set(due) - set(todo):
                    self.ds.reads[i] = self.ds.reads.get(i, 0) + due[i]
            if todo:
                self._write(self.capturer.capture(todo), due)
                if self.ds.keep == "all":
                    self._write_complete_shards(todo)
            pos += len(chunk)
            self.issued += len(chunk) if bounded else 0

    def _wait_for_room(self) -> None:
        with self.ds.cond:
            while not self.stopping.is_set() and (
                    self.issued - self.ds.consumed >= self.ahead
                    or (self.ds.keep == "none" and self.ds.spool_bytes >= self.budget)):
                self.ds.cond.wait(0.5)

    def _write(self, samples: dict[int, dict[str, torch.Tensor]], due: Counter) -> None:
        from eyas.data.store.shards import write_shard
        for i, fields in samples.items():
            with self.ds.cond:              # counted before the file appears
                self.ds.reads[i] = self.ds.reads.get(i, 0) + due[i]
            meta = write_shard(self.ds.spool, i, [fields], file_name=spool_name(i), fsync=False)
            self.captured += 1
            with self.ds.cond:
                self.ds.spool_bytes += meta["bytes"]
                self.ds.cond.notify_all()

    # ---- keep=all: the shards and the manifest ------------------------------------------
    def _mine(self, j: int) -> bool:
        return j % self.world_size == self.rank

    def _write_complete_shards(self, just: list[int]) -> None:
        for j in sorted({self.ds.shard_of(i)[0] for i in just}):
            if self._mine(j):
                self._try_shard(j)

    def _try_shard(self, j: int) -> bool:
        """Write plan shard j from the spool if every sample of it is there; True once the
        shard exists."""
        from eyas.data.store.shards import shard_name, write_shard
        path = self.ds.root / shard_name(j)
        a, b = self.ds.plan["shards"][j]
        files = [self.ds.spool / spool_name(i) for i in range(a, b)]
        if path.is_file():                  # (a killed run may have left its spool files)
            for f in files:
                f.unlink(missing_ok=True)
            return True
        if not all(f.is_file() for f in files):
            return False
        write_shard(self.ds.root, j, [ShardFile(f).sample(0) for f in files],
                    aux_format=self.ds.aux_format)
        for f in files:
            f.unlink(missing_ok=True)
        log.info("stream: shard %d (%d samples) written to %s", j, b - a, self.ds.root)
        return True

    def _finish_shards(self) -> None:
        """Write this rank's remaining shards as other ranks fill the spool; rank 0 then writes
        the manifest once every shard exists."""
        self.finishing = True
        from eyas.data.produce.extract_plan import finalize
        from eyas.data.store.shards import shard_name
        n = len(self.ds.plan["shards"])
        while not self.stopping.is_set():
            mine = [self._try_shard(j) for j in range(n) if self._mine(j)]
            done = all((self.ds.root / shard_name(j)).is_file() for j in range(n))
            if all(mine) and (self.rank != 0 or done):
                break
            time.sleep(0.2)
        if self.rank == 0 and not self.stopping.is_set():
            finalize(self.ds.root)
            log.info("stream: the dataset %s is complete (%d shards); later epochs read it",
                     self.ds.root, n)

    def stop(self) -> None:
        self.stopping.set()
        with self.ds.cond:
            self.ds.cond.notify_all()


class Stream:
    """One rank's streamed dataset, its producer and its capturer: `attach` the loaders (the
    producer starts at the first read, after a resume has set the loader), `close` at the end."""

    def __init__(self, dataset: StreamedDataset, capturer, *, rank: int, world_size: int,
                 ahead: int, spool_bytes: int):
        self.dataset, self.capturer, self.producer = dataset, capturer, None
        self.settings = dict(rank=rank, world_size=world_size, ahead=ahead,
                             spool_bytes=spool_bytes)
        self._lock = threading.Lock()
        self._closed = False

    def attach(self, train, held_out) -> None:
        self.producer = Producer(self.dataset, self.capturer, train=train, held_out=held_out,
                                 **self.settings)
        self.dataset.start = self._start

    def _start(self) -> None:
        with self._lock:
            if self.producer is not None and self.producer.ident is None:     # not started
                log.info("stream: capturing (%s, keep=%s) ahead of the loader into %s",
                         self.capturer.kind.value, self.dataset.keep, self.dataset.spool)
                self.producer.start()
            self.dataset.start = None

    def finish(self) -> None:
        """The run is over: a keep=none spool goes (a killed run's stays for its resume)."""
        self.close()
        if self.dataset.keep == "none":
            shutil.rmtree(self.dataset.spool, ignore_errors=True)

    def close(self, finish_s: float = 600.0) -> None:
        """Stop the producer; one that only has shards left to write (keep=all) finishes them
        first, waiting up to `finish_s` for the other ranks' samples."""
        if self._closed:
            return
        self._closed = True
        if self.dataset.error is None:       # a reader still waiting gives up
            self.dataset.error = StreamClosed("the stream was closed")
        p = self.producer
        if p is not None and p.ident is not None:
            if p.finishing:
                log.info("stream: writing the last shards of %s", self.dataset.root)
                p.join(finish_s)
            p.stop()
            p.join()
        self.capturer.__exit__(None, None, None)
        if self.dataset.keep == "all":
            with contextlib.suppress(OSError):
                self.dataset.spool.rmdir()      # empty once every shard is written


def open_stream(tokens_dir: str | Path, target, out: str | Path, *, capture, keep: str,
                ahead: int, spool_bytes: int, rank: int = 0, world_size: int = 1,
                layers=None, teacher: str = "last", topk: int = 32, aux_format: str = "bf16",
                dtype: str = "bfloat16", shard_tokens: int | None = None,
                shard_bytes: int = 1 << 30, endpoint=None,
                served_model=None, **hf: Any) -> Stream:
    """A streamed dataset of `tokens_dir` captured by `capture` (data/produce/capturers.py):
    keep=all keeps it in `out` (as `eyas extract --out OUT` would), keep=none spools into
    `out` only. hf: the transformers capturer's keywords (device, model, pad_batches, ...)."""
    from eyas.data.produce.capturers import open_capturer
    from eyas.data.produce.extract_plan import make_plan, open_tokens, write_plan
    from eyas.data.common.space import require_free
    if keep not in ("all", "none") or ahead < 1 or spool_bytes < 1:
        raise ExtractError(f"data.stream: keep={keep!r}, ahead={ahead}, spool_bytes={spool_bytes}:"
                           f" expected keep all or none, ahead and spool_bytes >= 1")
    out = Path(out)
    tokens = open_tokens(tokens_dir, target, out)
    topk = topk if teacher != "last" else 0
    spool = out / SPOOL if keep == "all" else out
    spool.mkdir(parents=True, exist_ok=True)
    capturer = open_capturer(capture, tokens, tokens_dir, target, storage=spool / f".engine-{rank}",
                             layers=layers, teacher=teacher, topk=topk, dtype=dtype,
                             endpoint=endpoint, served_model=served_model,
                             log_path=out / ("engine.log" if rank == 0 else f"engine-{rank}.log"),
                             **hf)
    try:
        plan = make_plan(tokens, tokens_dir, target, [int(x) for x in tokens.sample_lengths],
                         capturer.plan_fields(), shard_tokens=shard_tokens or None,
                         shard_bytes=shard_bytes, teacher=teacher, topk=topk,
                         aux_format=aux_format)
        if keep == "none":
            plan.pop("file_bytes")
            require_free(out, spool_bytes, what="the stream's spool (data.stream.spool_bytes)",
                         fix="free space there or lower data.stream.spool_bytes")
        if rank == 0:
            write_plan(out, plan)
        ds = StreamedDataset(tokens, plan, out, spool, keep=keep,
                             fields=_fields(capturer, tokens, spool))
    except BaseException:
        capturer.__exit__(None, None, None)
        raise
    return Stream(ds, capturer, rank=rank, world_size=world_size, ahead=ahead,
                  spool_bytes=spool_bytes)


def _fields(capturer, tokens, spool: Path) -> dict[str, Any]:
    """The stored fields (names, dtypes, per-token shapes) of a captured sample: sample 0
    captured into the spool (the first read takes it from there)."""
    from eyas.data.store.shards import read_shard_meta, shard_name, write_shard
    if (spool.parent / shard_name(0)).is_file() and spool.name == SPOOL:
        return read_shard_meta(spool.parent / shard_name(0))["fields"]    # kept, resumed
    path = spool / spool_name(0)
    if not path.is_file():
        write_shard(spool, 0, [capturer.capture([0])[0]], file_name=path.name, fsync=False)
    return read_shard_meta(path)["fields"]
