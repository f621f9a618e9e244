"""Answers from a served target: prompts JSONL -> conversations JSONL over an OpenAI-compatible API.

A target too large for `transformers.generate` (data.produce.generate) is served by vLLM, SGLang or any
OpenAI-compatible server; `eyas generate --endpoint URL` asks it for the assistant turns.

Input: prompt records as data.produce.records reads them (OpenAI `messages` with system prompts,
multi-turn prefixes and `tools`, or ShareGPT). Every user (or tool) message not followed by an
assistant message is answered in order, one request each, conditioned on the earlier answers
(as data.produce.generate does). Each prompt is answered `samples_per_prompt` times; answer j of prompt
X has id ``X`` (j = 0) or ``X#s<j>``, as the main job's embedded dataset names its samples.

Output: one line per prompt x sample, the shape data.produce.generate writes (so `eyas prepare` reads it):
``{"id", "messages": [..., the assistant message as returned, keeping reasoning_content and
tool_calls], ..., "tools"?, "generation": {model, max_tokens, temperature, top_p, seed,
chat_template_kwargs, prompt_id, sample, finish_reason: [per generated turn], truncated,
empty_answers, usage: [per turn], seconds}}``. Answers that hit `max_tokens` (finish reason
"length") are kept with ``truncated: true``; empty answers are kept and counted.

Partial and complete: while a run is under way the lines are appended to ``OUT.partial`` (one
write, flush and fsync per record; one writer at a time, holding the lock of the hidden file
``.OUT.lock`` beside it). When every prompt x sample is in, the file is renamed to OUT and the
data card (`card_path`: ``conv.jsonl`` -> ``conv.card.json``) is written atomically: model,
sampling setup, counts, finish reasons, token totals, time and the output's sha256. `eyas
prepare` refuses a ``.partial`` file and carries the card into its manifest.

Resuming: the same command again skips the ids already written, after cutting off a torn last
line (kill -9 mid-write); a record written with another sampling setup (`SETUP_FIELDS`) makes it
refuse, naming the field. A request that keeps failing stops the run with its prompt id; what
was written stays in ``OUT.partial`` for the next run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.data.common.checksums import file_sha256
from eyas.data.common.lock import dir_lock, sibling_lock_path
from eyas.data.common.log import PROGRESS, setup_logging
from eyas.data.common.options import option, shared
from eyas.data.produce.records import (Conversation, PrepareError, pending_turns, read_prompts,
                                     scan_written)
from eyas.data.common.settings import EndpointSettings, GenerationSettings
from eyas.data.common.utils import LogEvery

log = logging.getLogger(__name__)

#: generation fields a resumed run must share with the records already written
SETUP_FIELDS = ("model", "max_tokens", "temperature", "top_p", "seed", "chat_template_kwargs")
PARTIAL_SUFFIX = ".partial"
CARD_KIND = "eyas.generate.card"


class SetupChanged(ValueError):
    """A resumed run asks for another sampling setup than the records already written."""


def card_path(out: str | Path) -> Path:
    """The data card beside conversations file `out`: ``conv.jsonl`` -> ``conv.card.json``."""
    out = Path(out)
    return out.with_name(f"{out.stem if out.suffix == '.jsonl' else out.name}.card.json")


def read_card(conversations: str | Path) -> dict[str, Any] | None:
    """The data card of a conversations file, or None when it has none."""
    path = card_path(conversations)
    if not path.is_file():
        return None
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it or re-run `eyas generate`") \
            from None
    if not (isinstance(card, dict) and card.get("kind") == CARD_KIND):
        raise ValueError(f"{path}: not an `eyas generate` data card (kind {CARD_KIND!r})")
    return card


# ---------------------------------------------------------------------------------------------
# Tasks: prompt x sample


@dataclass
class Task:
    id: str
    conv: Conversation
    sample: int


def load_tasks(prompts: Path, samples_per_prompt: int) -> list[Task]:
    """Every prompt record of `prompts` x sample; a bad record is an error naming file:line."""
    convs, _ = read_prompts(prompts, set(), "raise")
    tasks = [Task(conv.id if j == 0 else f"{conv.id}#s{j}", conv, j)
             for conv in convs for j in range(samples_per_prompt)]
    if not tasks:
        raise PrepareError(f"{prompts}: no prompt records")
    return tasks


def request_seed(seed: int, task_id: str, turn: int) -> int:
    """The seed sent with one request: `seed` mixed with the record id and the turn, so the
    samples of one prompt differ and a resumed run asks exactly what the first one would."""
    return (seed * 1_000_003 + zlib.crc32(f"{task_id}/{turn}".encode())) % (2 ** 31)


def _assistant_message(message: dict[str, Any]) -> dict[str, Any]:
    """The returned message with its null and empty fields dropped (vLLM sends tool_calls: [])."""
    return {"role": "assistant", "content": message.get("content"),
            **{key: value for key, value in message.items()
               if key not in ("role", "content") and value not in (None, [], {}, "")}}


def answer(client, task: Task, setup: dict[str, Any]) -> dict[str, Any]:
    """The output record of one task: its pending turns answered in order, one request each."""
    conv, msgs, nxt = task.conv, [], 0
    finish, usage, empty = [], [], 0
    t0 = time.perf_counter()
    for turn, p in enumerate(pending_turns(conv.messages)):
        msgs += conv.messages[nxt:p + 1]
        nxt = p + 1
        body: dict[str, Any] = {"model": setup["model"], "messages": msgs,
                                "max_tokens": setup["max_tokens"],
                                "temperature": setup["temperature"], "top_p": setup["top_p"],
                                "stream": False}
        if setup["seed"] is not None:
            body["seed"] = request_seed(setup["seed"], task.id, turn)
        if conv.tools:
            body["tools"] = conv.tools
        if setup["chat_template_kwargs"]:
            body["chat_template_kwargs"] = setup["chat_template_kwargs"]
        what = f"prompt {conv.id!r} (sample {task.sample}, turn {turn})"
        choice, used = client.chat(body, what)
        reply = _assistant_message(choice["message"])
        empty += not ((reply["content"] or "").strip() or reply.get("reasoning_content")
                      or reply.get("tool_calls"))
        msgs = msgs + [reply]
        finish.append(choice.get("finish_reason"))
        usage.append({k: used[k] for k in ("prompt_tokens", "completion_tokens") if k in used})
    rec = {"id": task.id, "messages": msgs + conv.messages[nxt:], **conv.extra}
    if conv.tools:
        rec["tools"] = conv.tools
    rec["generation"] = {**setup, "prompt_id": conv.id, "sample": task.sample,
                         "finish_reason": finish, "truncated": "length" in finish,
                         "empty_answers": empty,
                         "usage": usage, "seconds": round(time.perf_counter() - t0, 3)}
    return rec


# ---------------------------------------------------------------------------------------------
# Resuming and the card


def check_setup(path: Path, written: dict[str, dict[str, Any]], setup: dict[str, Any]) -> None:
    """Refuse to resume `path` when a record there was generated with another setup."""
    for rid, gen in written.items():
        for key in SETUP_FIELDS:
            if gen.get(key) != setup[key]:
                raise SetupChanged(
                    f"{path}: record {rid!r} was generated with {key}={gen.get(key)!r}, this run "
                    f"asks {key}={setup[key]!r}; resume with the same setting (--"
                    f"{key.replace('_', '-')}), or write to another --out")


def build_card(out: Path, setup: dict[str, Any], *, endpoint: str, prompts: Path,
               samples_per_prompt: int, wall_s: float) -> dict[str, Any]:
    """The data card of a finished conversations file (counted from the file itself)."""
    finish: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    n = truncated = empty = 0
    request_s = 0.0
    ids = set()
    with open(out, encoding="utf-8") as f:
        for line in f:
            gen = json.loads(line).get("generation", {})
            n += 1
            truncated += bool(gen.get("truncated"))
            empty += int(gen.get("empty_answers", 0))
            finish.update(str(r) for r in gen.get("finish_reason", []))
            for u in gen.get("usage", []):
                tokens.update({k: int(v) for k, v in u.items()})
            ids.add(gen.get("prompt_id"))
            request_s += float(gen.get("seconds", 0.0))
    return {"kind": CARD_KIND, "file": out.name, "sha256": file_sha256(out),
            "endpoint": endpoint, "model": setup["model"],
            "sampling": {k: setup[k] for k in SETUP_FIELDS if k != "model"},
            "prompts": str(prompts), "prompts_sha256": file_sha256(prompts),
            "samples_per_prompt": samples_per_prompt,
            "counts": {"records": n, "prompts": len(ids), "turns": sum(finish.values()),
                       "truncated_records": truncated, "empty_answers": empty},
            "finish_reasons": dict(sorted(finish.items())),
            "tokens": {"prompt": tokens["prompt_tokens"],
                       "completion": tokens["completion_tokens"]},
            "wall_time_s": round(wall_s, 3),
            "request_seconds": round(request_s, 3)}


# ---------------------------------------------------------------------------------------------
# The run


def _append(fd: int, rec: dict[str, Any]) -> None:
    """One record as one line: written whole (O_APPEND), then fsync'ed."""
    data = (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
    while data:
        data = data[os.write(fd, data):]
    os.fsync(fd)


class _Progress:
    """Records done, completion tokens/s and the time left, logged at most every
    PROGRESS_LOG_EVERY_S seconds (`LogEvery`: a run against a large served target takes hours)
    and once at the end."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.tokens, self.truncated = total, 0, 0, 0
        self.every = LogEvery()

    def add(self, rec: dict[str, Any]) -> None:
        gen = rec["generation"]
        self.done += 1
        self.tokens += sum(u.get("completion_tokens", 0) for u in gen["usage"])
        self.truncated += gen["truncated"]
        if self.every.due() or self.done == self.total:
            dt = time.perf_counter() - self.every.t0
            log.info("generate: %d/%d records, %d tokens in %.1f s (%.1f tokens/s), %d "
                     "truncated at max_tokens, about %.0f s left", self.done, self.total,
                     self.tokens, dt, self.tokens / max(dt, 1e-9), self.truncated,
                     dt / self.done * (self.total - self.done), extra={PROGRESS: True})


def _run(client, todo: list[Task], setup: dict[str, Any], partial: Path,
         concurrency: int) -> None:
    """Answer `todo` with `concurrency` requests in flight, appending to `partial`; the first
    request that keeps failing stops the run (the answers already under way are written)."""
    from concurrent.futures import CancelledError, ThreadPoolExecutor, as_completed

    from eyas.data.produce.endpoint import EndpointError, EndpointStopped
    fd = os.open(partial, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    failures: list[BaseException] = []
    progress = _Progress(len(todo))
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="eyas-generate")
    try:
        futures = [pool.submit(answer, client, t, setup) for t in todo]
        for fut in as_completed(futures):
            try:
                rec = fut.result()
            except CancelledError:
                continue
            except Exception as e:  # noqa: BLE001 - the first one is raised below
                if not failures:
                    client.stop()
                    for other in futures:
                        other.cancel()
                if not isinstance(e, EndpointStopped):
                    failures.append(e)
                continue
            _append(fd, rec)
            progress.add(rec)
        pool.shutdown()
    except BaseException:   # Ctrl-C and the like: stop at once, in-flight answers are lost
        client.stop()
        pool.shutdown(wait=False, cancel_futures=True)
        client.close()
        raise
    finally:
        os.close(fd)
    if failures:
        first = failures[0]
        if not isinstance(first, EndpointError):
            raise first
        raise type(first)(f"{first} [{len(failures)} record(s) failed, {progress.done} written "
                          f"this run to {partial}; the same command resumes]") from None


def _api_key(var: str | None) -> str | None:
    if var is None:
        return None
    value = os.environ.get(var)
    if not value:
        raise ValueError(f"--api-key-env {var}: the environment variable {var} is not set; "
                         f"export it or leave --api-key-env out")
    return value


def _check_options(*, max_tokens: int, concurrency: int, samples_per_prompt: int,
                   temperature: float, top_p: float) -> None:
    for name, value in (("max_tokens", max_tokens), ("concurrency", concurrency),
                        ("samples_per_prompt", samples_per_prompt)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"--temperature must be >= 0 and --top-p in (0, 1]; got {temperature}, "
                         f"{top_p}")
    if samples_per_prompt > 1 and temperature == 0:
        log.warning("--samples-per-prompt %d at --temperature 0: greedy answers repeat (set a "
                    "temperature > 0 for different samples)", samples_per_prompt)


def _todo(source: Path, tasks: list[Task], setup: dict[str, Any], prompts: Path,
          samples_per_prompt: int) -> list[Task]:
    """The tasks not yet in `source` (its torn last line cut, its setup checked)."""
    written = scan_written(source)
    check_setup(source, written, setup)
    todo = [t for t in tasks if t.id not in written]
    stray = len(set(written) - {t.id for t in tasks})
    if stray:
        log.warning("%s holds %d records whose ids are not among the prompts of %s (kept)",
                    source, stray, prompts)
    log.info("%d of %d records to generate (%d prompts x %d samples; %d already in %s)",
             len(todo), len(tasks), len(tasks) // samples_per_prompt, samples_per_prompt,
             len(tasks) - len(todo), source)
    return todo


def generate_from_endpoint(prompts: str | Path, endpoint: str, out: str | Path, *,
                           model: str | None = None, max_tokens: int = 512,
                           temperature: float = 0.0, top_p: float = 1.0,
                           seed: int | None = None, concurrency: int = 8,
                           samples_per_prompt: int = 1, api_key_env: str | None = None,
                           chat_template_kwargs: dict[str, Any] | None = None,
                           retries: int = 5, backoff: float = 1.0,
                           timeout: float = 600.0) -> dict[str, Any]:
    """Answer every prompt x sample of `prompts` through the server at `endpoint` into `out`
    (module doc: partial file, resuming, card). `model` None: the first of `GET /models`.
    Returns the data card (also written to `card_path(out)`)."""
    from eyas.data.produce.endpoint import EndpointClient
    from eyas.data.common.utils import atomic_write_json, fsync_dir
    _check_options(max_tokens=max_tokens, concurrency=concurrency,
                   samples_per_prompt=samples_per_prompt, temperature=temperature, top_p=top_p)
    prompts, out = Path(prompts), Path(out)
    tasks = load_tasks(prompts, samples_per_prompt)
    t0, api_key = time.perf_counter(), _api_key(api_key_env)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    # held until this function returns: one writer per output
    with dir_lock(out, what="`eyas generate` output", path=sibling_lock_path(out)):
        if out.exists() and partial.exists():
            raise FileExistsError(f"both {out} and {partial} exist; remove the one that is not "
                                  f"this run's output")
        client = EndpointClient(endpoint, connections=concurrency, api_key=api_key,
                                timeout=timeout, retries=retries, backoff=backoff)
        try:
            if model is None:
                model = client.models()[0]
                log.info("model: %s (the first that %s/models lists)", model, client.url)
            setup = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                     "top_p": top_p, "seed": seed,
                     "chat_template_kwargs": chat_template_kwargs or {}}
            source = partial if partial.exists() or not out.exists() else out
            todo = _todo(source, tasks, setup, prompts, samples_per_prompt)
            card = read_card(out) if source == out else None
            if not todo and card is not None and card.get("sha256") == file_sha256(out):
                return card
            if todo:
                if source == out:   # a finished file that gains prompts becomes partial again
                    card_path(out).unlink(missing_ok=True)
                    os.replace(out, partial)
                _run(client, todo, setup, partial, concurrency)
            if partial.exists():
                os.replace(partial, out)
                fsync_dir(out.parent)
        finally:
            client.close()
        card = build_card(out, setup, endpoint=client.url, prompts=prompts,
                          samples_per_prompt=samples_per_prompt, wall_s=time.perf_counter() - t0)
        atomic_write_json(card_path(out), card)
    if card["counts"]["empty_answers"]:
        log.warning("%s: %d answers are empty (kept; `eyas prepare` counts them as "
                    "empty_assistant)", out, card["counts"]["empty_answers"])
    log.info("%s: %d records (%s), %d completion tokens; card %s", out,
             card["counts"]["records"], card["finish_reasons"], card["tokens"]["completion"],
             card_path(out))
    return card


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as "
                                         f"'{{\"enable_thinking\": false}}', got {text!r}")
    return value


@dataclass(kw_only=True)
class GenerateOptions:
    """Answer prompts (OpenAI messages or ShareGPT JSONL) with a target served by an
    OpenAI-compatible server (vLLM, SGLang, transformers serve) into a conversations JSONL that
    `eyas prepare` reads. Written to OUT.partial until every prompt x sample is in, then renamed
    to OUT beside its data card (OUT's .card.json); re-running the same command resumes."""

    endpoint: str = option(help="the server's API root, e.g. http://localhost:8000/v1",
                           metavar="URL")
    prompts: str = option(help="prompts JSONL")
    out: str = option(help="conversations JSONL to write")
    model: str | None = option(
        None, "served model name (default: the first that GET /v1/models lists)")
    max_tokens: int = shared(GenerationSettings, "max_new_tokens")
    temperature: float = shared(GenerationSettings, "temperature")
    top_p: float = shared(GenerationSettings, "top_p")
    seed: int | None = option(
        None, "base seed; each request gets one derived from it, the record id and the turn "
        "(default: none sent, the server's own randomness)")
    concurrency: int = shared(EndpointSettings, "endpoint_concurrency",
                              "data.endpoint_concurrency")
    samples_per_prompt: int = option(1, "answers per prompt; answer j > 0 of prompt X has id X#sj")
    api_key_env: str | None = option(
        None, "environment variable holding the API key, sent as a bearer token (default: no "
        "key)", metavar="VAR")
    chat_template_kwargs: dict[str, Any] | None = option(
        None, "chat_template_kwargs sent with every request, e.g. "
        "'{\"enable_thinking\": false}' (default: none)", type=_json_object, metavar="JSON")
    retries: int = option(5, "retries of a request after a connection error, 429 or 5xx")
    retry_backoff: float = option(1.0, "first retry delay, doubled per retry (capped at 60 s)",
                                  metavar="SECONDS")
    timeout: float = option(600.0, "per-request timeout", metavar="SECONDS")
    log_file: str | None = option(
        None, "also append the log here (default: OUT's .log, e.g. conv.log)")


def main(args: GenerateOptions) -> int:
    """`eyas generate --endpoint URL --prompts P.jsonl --out C.jsonl [...]`."""
    out = Path(args.out)
    log_file = args.log_file or out.with_name(
        f"{out.stem if out.suffix == '.jsonl' else out.name}.log")
    setup_logging(file=log_file)
    card = generate_from_endpoint(
        args.prompts, args.endpoint, out, model=args.model, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        concurrency=args.concurrency, samples_per_prompt=args.samples_per_prompt,
        api_key_env=args.api_key_env, chat_template_kwargs=args.chat_template_kwargs,
        retries=args.retries, backoff=args.retry_backoff, timeout=args.timeout)
    print(json.dumps(card, indent=1))
    return 0
