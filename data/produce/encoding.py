"""Records → token samples for `data.produce.prepare`, in chunks of lines, in this process or in a pool
of worker processes.

Rendering a conversation with its chat template and tokenising it costs ~1 ms of one core
(Jinja and the tokenizer's offsets): ~40 s for a file of 50 000 answers.
With `workers` > 1 the file is cut into chunks of `CHUNK_LINES` raw lines; worker processes
(forked where the platform can, `_context`) parse, render and tokenise them with copies of the
parent's `TemplateRenderer`, and the chunks come back in file order, at most `2 × workers` in
flight. The samples, counts and errors are the same as in one process, in
the same order: the shards a pool writes are byte-identical to a single process's.

What a worker logs comes back with its chunk and is logged here; the renderer's warnings that
one process gives once (a template whose generation prompt is not a prefix of the stored turn,
reasoning it does not render: marked ``extra={"once": True}``) are logged once for the whole
pool, and each worker's count of dropped reasoning is added to the parent's. On Linux the
workers end with the parent, however it ends (`_worker_init`), so none is left holding the
output's lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import multiprocessing
import os
import signal
import stat
import sys
import warnings
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from eyas.data.produce.records import InputFile, RecordError, normalise_record, parse_line
from eyas.data.common.templates import TemplateRenderer

#: raw lines per unit of work sent to a worker
CHUNK_LINES = 256
#: `workers=None` uses a pool only for an input at least this large
AUTO_POOL_BYTES = 16 << 20
#: at most this many workers are chosen automatically
AUTO_MAX_WORKERS = 16


@dataclass
class Record:
    """One non-blank line: its samples [(input ids int32, loss mask bool)], or why it failed."""
    lineno: int
    samples: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    error: tuple[str, str] | None = None          # (reason, detail) of a RecordError


@dataclass
class Chunk:
    """What one chunk of lines gave: its records in order, the counts of the usable ones, the
    answers by (temperature, top_p), reasoning the template dropped, and log events."""
    records: list[Record]
    stats: Counter = field(default_factory=Counter)
    sampling: Counter = field(default_factory=Counter)
    reasoning_dropped: int = 0
    events: list[tuple[str, int, str, str, bool]] = field(default_factory=list)


def encode_record(rec, default_id: str, renderer: TemplateRenderer, max_length: int):
    """(conversation, [(ids, loss mask, straddles a boundary)]) of one record; RecordError for
    a malformed record, a sample over max_length or one without assistant tokens."""
    if isinstance(rec, RecordError):
        raise rec
    conv = normalise_record(rec, default_id=default_id)
    encoded = [renderer.tokenize(text, spans) for text, spans in renderer.samples(conv)]
    for ids, mask, _ in encoded:
        if len(ids) > max_length:
            raise RecordError("too_long", f"{len(ids)} tokens > max_length={max_length}; "
                              f"raise max_length or drop the record")
        if not any(mask):
            raise RecordError("no_assistant", "no token falls inside an assistant span")
    return conv, encoded


def count_record(rec, conv, encoded, stats: Counter, sampling: Counter) -> None:
    """Add one usable record to the counts (and its answers' sampling settings, if recorded)."""
    stats["conversations"] += 1
    gen = rec.get("generation") if isinstance(rec, dict) else None
    if isinstance(gen, dict) and "temperature" in gen:
        sampling[(gen["temperature"], gen.get("top_p"))] += 1
    stats["untrained_turns"] += sum(m["role"] == "assistant" and m.get("weight") == 0
                                    for m in conv.messages)
    stats["split_records"] += len(encoded) > 1
    for ids, mask, straddle in encoded:
        stats["samples"] += 1
        stats["tokens"] += len(ids)
        stats["loss_tokens"] += sum(mask)
        stats["boundary_splits"] += straddle


def encode_chunk(lines: list[tuple[int, bytes]], source_name: str, renderer: TemplateRenderer,
                 max_length: int) -> Chunk:
    """Parse, render and tokenise raw (line number, bytes) lines; blank lines are left out."""
    chunk, before = Chunk(records=[]), renderer.reasoning_dropped
    for lineno, raw in lines:
        rec = parse_line(lineno, raw)
        if rec is None:
            continue
        try:
            conv, encoded = encode_record(rec, f"{source_name}:{lineno}", renderer, max_length)
        except RecordError as e:
            chunk.records.append(Record(lineno, error=(e.reason, e.detail)))
            continue
        count_record(rec, conv, encoded, chunk.stats, chunk.sampling)
        chunk.records.append(Record(lineno, [(np.asarray(ids, dtype=np.int32),
                                              np.asarray(mask, dtype=bool))
                                             for ids, mask, _ in encoded]))
    chunk.reasoning_dropped = renderer.reasoning_dropped - before
    return chunk


def auto_workers(source: Path, workers: int | None) -> int:
    """`workers` as given, or for None: one per usable core (at most AUTO_MAX_WORKERS) for an
    input file of AUTO_POOL_BYTES or more (as stored), else 1 (a stream or FIFO: 1)."""
    if workers is not None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (1: this process alone), got {workers}")
        return workers
    st = os.stat(source) if str(source) != "-" else None
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size < AUTO_POOL_BYTES:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(AUTO_MAX_WORKERS, cores or 1))


def _raw_chunks(source: InputFile) -> Iterator[list[tuple[int, bytes]]]:
    lines = enumerate(source.lines(), 1)
    while chunk := list(itertools.islice(lines, CHUNK_LINES)):
        yield chunk


def encode_file(source: InputFile, renderer: TemplateRenderer, *, max_length: int,
                workers: int = 1) -> Iterator[Chunk]:
    """Every chunk of `source` (read once), encoded, in file order (module doc). Close the
    generator (`contextlib.closing`) to stop early: the chunks not started yet are cancelled."""
    name = Path(source.path).name
    if workers <= 1:
        for lines in _raw_chunks(source):
            yield encode_chunk(lines, name, renderer, max_length)
        return
    seen: set[tuple[str, str]] = set()
    pool = ProcessPoolExecutor(workers, mp_context=_context(), initializer=_worker_init,
                               initargs=(renderer, name, max_length, os.getpid()))
    try:
        pending: deque = deque()
        for i, lines in enumerate(_raw_chunks(source)):
            with _quiet_fork() if i == 0 else contextlib.nullcontext():
                pending.append(pool.submit(_worker_chunk, lines))
            if len(pending) >= 2 * workers:
                yield _replayed(pending.popleft().result(), renderer, seen)
        while pending:
            yield _replayed(pending.popleft().result(), renderer, seen)
    except BrokenProcessPool:
        raise WorkerDied(f"a worker process of the {workers} tokenising records ended "
                         f"abruptly (killed, e.g. out of memory); run again with fewer "
                         f"workers (--workers N, or 1 for this process alone)") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class WorkerDied(RuntimeError):
    """A worker of the pool was killed; the CLI exits with status 3 and this one line."""
    exit_status = 3


def _context():
    """Forked workers on Linux, spawned ones elsewhere (macOS and Windows, where forking a
    process with threads is unsafe or impossible).

    A forked worker starts at once and never re-imports the caller's main module (a spawned
    one does, so an unguarded script would start its own pool in every worker). It runs only
    Python, Jinja and the tokenizer, never the parent's CUDA context or its other threads'
    work, as PyTorch's DataLoader workers do."""
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


@contextlib.contextmanager
def _quiet_fork():
    """Around the first submit, which forks every worker: Python 3.12+ warns about forking a
    process that has threads (see `_context` for why it is safe here), and a child forked
    after the parent used the tokenizers library's thread pool must not use that pool (its
    threads are not in the child): TOKENIZERS_PARALLELISM=false for the forks keeps the
    children on one thread and stops the library's warning about it. The parent's environment
    is restored afterwards."""
    key = "TOKENIZERS_PARALLELISM"
    before = os.environ.get(key)
    os.environ[key] = "false"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*use of fork\\(\\) may lead to deadlocks",
                                    DeprecationWarning)
            yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _replayed(chunk: Chunk, renderer: TemplateRenderer, seen: set[tuple[str, str]]) -> Chunk:
    """A worker's chunk as if this process had encoded it: its dropped reasoning counted on
    `renderer`, its log events logged here (those marked once: once for the whole pool)."""
    renderer.reasoning_dropped += chunk.reasoning_dropped
    for name, level, template, message, once in chunk.events:
        if once and (name, template) in seen:
            continue
        seen.add((name, template))
        logging.getLogger(name).log(level, "%s", message)
    return chunk


# ---------------------------------------------------------------------------------------------
# The worker side

_WORKER: dict[str, Any] = {}


class _Collect(logging.Handler):
    """Keeps the records the worker's loggers emit, for the parent to log (`_replayed`)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, int, str, str, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append((record.name, record.levelno, str(record.msg), record.getMessage(),
                            bool(getattr(record, "once", False))))


def _worker_init(renderer: TemplateRenderer, source_name: str, max_length: int,
                 parent: int) -> None:
    if sys.platform.startswith("linux"):     # killed when the parent dies, however it dies
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:               # the parent was gone before that took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the parent's to handle
    collect = _Collect()
    root = logging.getLogger("eyas")
    root.handlers[:] = [collect]
    root.setLevel(logging.INFO)
    root.propagate = False
    _WORKER.update(renderer=renderer, source_name=source_name, max_length=max_length,
                   collect=collect)


def _worker_chunk(lines: list[tuple[int, bytes]]) -> Chunk:
    w = _WORKER
    chunk = encode_chunk(lines, w["source_name"], w["renderer"], w["max_length"])
    chunk.events, w["collect"].events = w["collect"].events, []
    return chunk
