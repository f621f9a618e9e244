"""Real decoding in several processes (`eval.processes`, `eyas evaluate --processes N`).

    with DecodePool(job, processes=4) as pool:
        pairs = pool.decode(prompts, temperature=0.0, draft="argmax", seed=0)
        pairs_07 = pool.decode(prompts, temperature=0.7, draft="argmax", seed=0)

Each worker is a spawned process that loads the target and the drafter once (`job`: the
settings `load_pair` reads) and then decodes whatever parts of a prompt list it is handed, so
several temperatures load the models once per worker. Batch-1 decoding of a small target
leaves a GPU or a many-core CPU mostly idle; processes side by side fill it. Prompt i of a
list is decoded with seed + i whichever worker takes it (docs/acceptance.md, "Real decoding
without a server")."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing as mp
import os
from typing import Any

import torch

from eyas.data.common.targets import TARGET_DTYPES

log = logging.getLogger(__name__)

#: parts per worker: small parts keep every worker busy while one finishes loading late
PARTS_PER_WORKER = 4

# A worker's loaded target, engine drafter, its config, stop ids and job (`_decode_part`).
_LOADED: tuple | None = None


def decode_job(drafter_dir, target, *, dtype: str, cache_dir, device, k: int,
               max_new_tokens: int, temperature: float = 0.0, draft: str = "argmax") -> dict:
    """The settings a decoding process loads and decodes with (`load_pair`, `DecodePool`)."""
    return dict(drafter_dir=str(drafter_dir), target=str(target), dtype=dtype,
                cache_dir=cache_dir, device=str(device), k=k, max_new_tokens=max_new_tokens,
                temperature=temperature, draft=draft)


def load_pair(job: dict[str, Any], model=None, tokenizer=None):
    """(model, tokenizer, engine drafter, its config) for a `speculative_eval` or `DecodePool`
    job: the target is loaded unless given, the drafter beside it (the engine reference,
    `train.evaluate.specdec.load_engine_drafter`), and their hidden sizes must agree."""
    from eyas.train.evaluate.specdec import load_engine_drafter
    dtype = TARGET_DTYPES[job["dtype"]]
    if model is None or tokenizer is None:
        from eyas.data.common.targets import load_target
        model, tokenizer = load_target(job["target"], dtype=dtype, cache_dir=job["cache_dir"],
                                       device=job["device"])
    elif next(model.parameters()).dtype != dtype:
        raise ValueError(f"the model passed in is {next(model.parameters()).dtype}, but "
                         f"dtype={job['dtype']!r}: pass the matching dtype (or let it load the "
                         f"target)")
    tcfg = model.config.get_text_config()
    embed = model.get_input_embeddings().weight.detach()       # the drafter runs beside the target
    engine, cfg = load_engine_drafter(job["drafter_dir"], embed, dtype=dtype, device=embed.device)
    if int(cfg.get("target_hidden_size") or -1) != int(tcfg.hidden_size):
        raise ValueError(f"{job['drafter_dir']}/config.json target_hidden_size="
                         f"{cfg.get('target_hidden_size')} but target {job['target']} has hidden "
                         f"size {tcfg.hidden_size}: this drafter was trained for another target")
    return model, tokenizer, engine, cfg


def _decode_part(job: dict[str, Any], threads: int, prompts: list, names: list[str],
                 temperature: float, draft: str, seed: int) -> tuple[int, bool, list]:
    """(this worker's pid, whether it loaded the models for this part, `decode_prompts`' pairs
    of the part). A worker loads the target and the drafter at its first part and keeps them
    (loading here rather than in a pool initializer lets a loading error reach the caller as
    itself)."""
    global _LOADED
    from eyas.train.evaluate.specdec import decode_prompts, stop_token_ids
    loaded = _LOADED is None or _LOADED[-1] != job
    if loaded:
        torch.set_num_threads(threads)
        model, tokenizer, engine, cfg = load_pair(job)
        _LOADED = (model, engine, cfg, stop_token_ids(model, tokenizer), job)
    model, engine, cfg, stop_ids, _ = _LOADED
    return os.getpid(), loaded, decode_prompts(
        model, engine, cfg, prompts, k=job["k"], max_new_tokens=job["max_new_tokens"],
        stop_ids=stop_ids, names=names, progress=False, temperature=temperature, draft=draft,
        seed=seed)


def _exit_with_parent(parent: int) -> None:
    """Worker initializer: the worker ends itself within a second of the process that made the
    pool going away. A SIGTERM or SIGKILL to that process alone (`kill PID`, a launcher
    stopping its ranks) would otherwise leave its workers decoding, and holding the GPU, as
    orphans; the executor's own shutdown only runs when the owner exits normally."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="eyas-exit-with-parent", daemon=True).start()


class DecodePool:
    """`processes` spawned workers, each holding one copy of the target and the drafter."""

    def __init__(self, job: dict[str, Any], processes: int) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes = processes
        self.job = dict(job, temperature=None, draft=None)  # those two: per decode() call
        self._threads = max(1, torch.get_num_threads() // processes)   # an equal share each
        self._pool = cf.ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn"),
                                            initializer=_exit_with_parent,
                                            initargs=(os.getpid(),))
        self.worker_pids: set[int] = set()
        """the workers that decoded something: at most `processes`, however many calls"""
        self.loads = 0
        """how many times a worker loaded the target and the drafter: once per worker"""

    def check(self, job: dict[str, Any]) -> None:
        """Raise ValueError unless `job` (`decode_job`) decodes with this pool's models and
        settings (temperature and draft rule aside)."""
        differ = sorted(key for key in self.job if key not in ("temperature", "draft")
                        and self.job[key] != job.get(key))
        if differ:
            raise ValueError("this DecodePool was made for other settings: " + ", ".join(
                f"{key} {self.job[key]!r} (asked: {job.get(key)!r})" for key in differ))

    def decode(self, prompts: list[tuple[str, list[int]]], *, temperature: float, draft: str,
               seed: int) -> list:
        """`decode_prompts`' (name, target-only, speculative) pairs of `prompts`, in order; the
        part starting at prompt s is seeded seed + s, so prompt i draws from seed + i."""
        n = len(prompts)
        parts = min(n, self.processes * PARTS_PER_WORKER)
        bounds = [round(n * j / parts) for j in range(parts + 1)] if parts else [0]
        spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        futures = {self._pool.submit(_decode_part, self.job, self._threads,
                                     [p for _, p in prompts[a:b]],
                                     [m for m, _ in prompts[a:b]], temperature, draft,
                                     seed + a): i
                   for i, (a, b) in enumerate(spans)}
        out: list[list] = [[] for _ in spans]
        for done, fut in enumerate(cf.as_completed(futures), 1):
            pid, loaded, out[futures[fut]] = fut.result()
            self.worker_pids.add(pid)
            self.loads += loaded
            log.info("specdec: %d/%d parts decoded (%d of %d prompts)", done, len(futures),
                     sum(len(x) for x in out), n)
        return [pair for part in out for pair in part]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> DecodePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
