"""Generate assistant turns with the target itself: prompts JSONL -> conversations JSONL.

EAGLE-3 drafters learn the target's own distribution best from text the target wrote, so the
usual pipeline answers a set of prompts with the target first (`eyas prepare --generate`).

Input: the same record shapes as data.produce.prepare (OpenAI `messages` or ShareGPT), without the
final assistant turn. Every user (or tool) message not already followed by an assistant message
gets one generated answer, in order: a record with several user turns is answered turn by turn,
each answer conditioned on the earlier generated ones. Messages are written back as read
(normalised); a ``"weight": 0`` turn keeps its weight, so it stays context in data.produce.prepare.

Output: JSONL, one finished conversation per line, ``{"id", "messages", ..., "generation":
{"finish_reason": [...], ...}}``; `finish_reason` is "stop" (end-of-turn token) or "length"
(max_new_tokens reached) per generated turn. Text before a ``</think>`` is stored as the turn's
`reasoning_content` (thinking models).

Batching: prompts are sorted by token length and run `batch_size` at a time with left padding
(greedy by default; `temperature > 0` samples with `top_p`, seeded per chunk).

Resumable: records are appended one line each, flushed and fsync'ed per chunk. On restart, ids
already in the output are skipped; a partial last line (a crash mid-write) is detected, logged
and cut off. A corrupt line elsewhere is an error naming it. Record ids must be unique (records
without an "id" get ``<file name>:<line>``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from eyas.data.common.log import PROGRESS
from eyas.data.produce.records import (ERROR_MODES, Conversation, pending_turns, read_prompts,
                                     resolve_template, scan_written)
from eyas.data.common.settings import GenerationSettings, KVCache, SeedSettings, TargetSettings
from eyas.data.common.templates import for_template
from eyas.data.common.utils import LogEvery

log = logging.getLogger(__name__)


def _split_reasoning(text: str) -> tuple[str | None, str]:
    """'<think>r</think>\\n\\nc' -> ('r', 'c'); text without '</think>' -> (None, text)."""
    if "</think>" not in text:
        return None, text
    head, _, tail = text.partition("</think>")
    return head.split("<think>")[-1].strip("\n"), tail.lstrip("\n")


def _stop_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the target defines no end-of-sequence token (generation_config."
                         "eos_token_id / tokenizer.eos_token); generation would never stop")
    return ids


class _Progress:
    """Logs turns answered of `total`, answer tokens, speed and time left (`LogEvery`);
    called after each `generate` call."""

    def __init__(self, total: int, counts: Counter[str]):
        self.total, self.counts, self.every = total, counts, LogEvery()

    def __call__(self) -> None:
        if not self.every.due():
            return
        dt, done = self.every.elapsed, self.counts["stop"] + self.counts["length"]
        dropped = self.counts["turns_dropped"]      # after an empty answer: never asked
        log.info("generate: %d/%d turns answered%s, %d tokens in %.0f s (%.0f tokens/s), about "
                 "%.0f s left", done, self.total, f" ({dropped} dropped)" if dropped else "",
                 self.counts["new_tokens"], dt, self.counts["new_tokens"] / dt,
                 dt / max(done, 1) * (self.total - done - dropped), extra={PROGRESS: True})


#: static cache: a batch's prompts are left padded to a multiple of this many tokens, so batches
#: of similar lengths share one compiled decoding step
STATIC_PROMPT_BUCKET = 64


@torch.no_grad()
def _generate_batch(model, tokenizer, prompts: list[str], stop: list[int], *, max_new_tokens: int,
                    temperature: float, top_p: float, keep: frozenset[int] = frozenset(),
                    cache: str = "dynamic", rows: int | None = None,
                    prompt_tokens: int | None = None) -> list[tuple[str, str, int]]:
    """[(text, finish_reason, n_new_tokens)] for prompts (already rendered, left padded here).
    A row's text ends before its stop token, or after it when that token is in `keep`.
    cache "static": transformers' static KV cache, the batch padded to `rows` rows (repeats of
    the last prompt, whose answers are dropped) and `prompt_tokens` tokens, so that calls of
    the same padded length reuse one compiled decoding step."""
    n = len(prompts)
    static = cache == "static"
    if static and rows is not None:
        if n > rows:
            raise ValueError(f"static cache: {n} prompts for a batch of {rows} rows")
        prompts = prompts + [prompts[-1]] * (rows - n)
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        if static and prompt_tokens is not None:
            enc = tokenizer(prompts, add_special_tokens=False, padding="max_length",
                            max_length=prompt_tokens)           # lists: a longer row stays longer
            longest = max(len(ids) for ids in enc["input_ids"])
            if longest > prompt_tokens:
                raise ValueError(f"static cache: a prompt of {longest} tokens does not fit the "
                                 f"batch's padded length of {prompt_tokens}")
            enc = {k: torch.tensor(v) for k, v in enc.items()}
        else:
            enc = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    enc = {k: v.to(model.device) for k, v in enc.items()}
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) \
        if temperature > 0 \
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=stop,
                         pad_token_id=tokenizer.pad_token_id,
                         **(dict(cache_implementation="static") if static else {}), **sampling)
    new = out[:n, enc["input_ids"].shape[1]:].tolist()     # [n, <= max_new_tokens]
    stops, results = set(stop), []
    for row in new:
        cut = next((j for j, t in enumerate(row) if t in stops), None)
        toks = row if cut is None else row[:cut + (row[cut] in keep)]
        results.append((tokenizer.decode(toks, skip_special_tokens=False),
                        "length" if cut is None else "stop", len(row) if cut is None else cut + 1))
    return results


def _check_args(on_error: str, max_new_tokens: int, batch_size: int, cache: str) -> None:
    """Raise ValueError for an unknown `on_error` or cache, or a token or batch count below one."""
    if on_error not in ERROR_MODES:
        raise ValueError(f"on_error must be one of {ERROR_MODES}, got {on_error!r}")
    if cache not in [c.value for c in KVCache]:
        raise ValueError(f"data.generation_cache={cache!r}; expected one of "
                         f"{[c.value for c in KVCache]}")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1; got {max_new_tokens}, "
                         f"{batch_size}")


def _setup_target(target: str | Path, device: str | torch.device | None, dtype: str,
                  chat_template: str | None, model,
                  tokenizer) -> tuple[Any, Any, str | None, list[int]]:
    """(model, tokenizer, chat template, stop ids); loads `target` unless both are given."""
    if model is None or tokenizer is None:
        from eyas.data.common.targets import default_device, load_target, target_dtype
        device = device or default_device()
        model, tokenizer = load_target(target, dtype=target_dtype(dtype, device), device=device)
    template, _ = resolve_template(chat_template)
    if template is None and not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template; pass chat_template=")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, template, _stop_ids(model, tokenizer)


def _render(tokenizer, template: str | None, template_kwargs: dict[str, Any] | None,
            cv: Conversation, msgs: list[dict]) -> str:
    """`msgs` of `cv` as prompt text for the target, ending in the assistant's turn opening."""
    return tokenizer.apply_chat_template(for_template(msgs), tools=cv.tools, chat_template=template,
                                         tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))


def _add_answer(s: dict, text: str, reason: str, n: int, counts: Counter[str]) -> None:
    """Append one generated turn to a record's state; an empty answer marks the record failed."""
    reasoning, content = _split_reasoning(text)
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    s["msgs"].append(msg)
    s["finish"].append(reason)
    s["pending"].pop(0)
    if not (content.strip() or reasoning):
        s["failed"] = True
        counts["turns_dropped"] += len(s["pending"])     # the record's later turns are not asked
    counts[reason] += 1
    counts["new_tokens"] += n


def _answer_chunk(chunk: list[Conversation], c: int, *, tokenizer, render: Callable,
                  generate: Callable, batch_size: int, seed: int,
                  counts: Counter[str], report: Callable[[], None]) -> list[dict]:
    """Per record state of chunk `c` after answering its pending turns, one turn a round."""
    # per record: messages so far, the remaining pending indices, finish reasons
    state = [{"conv": cv, "msgs": [], "next": 0, "pending": pending_turns(cv.messages),
              "finish": [], "failed": False} for cv in chunk]
    rnd = 0
    while True:
        active = [s for s in state if s["pending"] and not s["failed"]]
        if not active:
            break
        for s in active:   # copy the record up to (and including) its next pending turn
            p = s["pending"][0]
            s["msgs"] += s["conv"].messages[s["next"]:p + 1]
            s["next"] = p + 1
        texts = [render(s["conv"], s["msgs"]) for s in active]
        lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        order = sorted(range(len(active)), key=lambda j: lengths[j])
        torch.manual_seed(seed + 1_000_003 * c + rnd)
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            # the static cache's shape: this batch's longest prompt rounded up (dynamic: unused)
            bucket = -(-lengths[idx[-1]] // STATIC_PROMPT_BUCKET) * STATIC_PROMPT_BUCKET
            answers = generate([texts[j] for j in idx], rows=batch_size, prompt_tokens=bucket)
            for j, (text, reason, n) in zip(idx, answers):
                _add_answer(active[j], text, reason, n, counts)
            report()
        rnd += 1
    return state


def _write_chunk(fout, state: list[dict], settings: dict[str, Any], counts: Counter[str]) -> None:
    """Append the chunk's answered records to `fout` (flushed, fsync'ed); count the failed ones."""
    for s in state:
        cv = s["conv"]
        if s["failed"]:
            counts["empty_generation"] += 1
            continue
        rec = {"id": cv.id, "messages": s["msgs"] + cv.messages[s["next"]:], **cv.extra,
               "generation": dict(settings, finish_reason=s["finish"])}
        if cv.tools:
            rec["tools"] = cv.tools
        fout.write(json.dumps(rec, ensure_ascii=False) + "\n")
    fout.flush()
    os.fsync(fout.fileno())


def generate_conversations(prompts_path: str | Path, target: str | Path, out_path: str | Path, *,
                           max_new_tokens: int = GenerationSettings.max_new_tokens,
                           batch_size: int = GenerationSettings.generation_batch_size,
                           temperature: float = GenerationSettings.temperature,
                           top_p: float = GenerationSettings.top_p, seed: int = SeedSettings.seed,
                           cache: str = GenerationSettings.generation_cache.value,
                           device: str | torch.device | None = None,
                           dtype: str = TargetSettings.dtype,
                           chat_template: str | None = None,
                           template_kwargs: dict[str, Any] | None = None, on_error: str = "raise",
                           chunk_records: int | None = None, model=None,
                           tokenizer=None) -> Path:
    """Answer every pending user turn of the prompts with the target; append to `out_path`.

    Args:
        prompts_path: JSONL of prompts (OpenAI messages or ShareGPT, no final assistant turn).
        target: preset name or model directory (data.common.targets), also recorded per record.
        out_path: conversations JSONL; appended to, so an interrupted run resumes.
        max_new_tokens, temperature (0 = greedy), top_p, seed: decoding settings.
        cache: "dynamic" or "static" KV cache (`GenerationSettings.generation_cache`).
        batch_size: prompts per `generate` call (sorted by length, left padded).
        chat_template, template_kwargs: as in data.produce.prepare.prepare.
        on_error: "raise" or "skip" for malformed prompt records (counted and logged).
        chunk_records: records per resumable unit (default 4 x batch_size).
        device, dtype: where and in which precision the target generates (device None: the
            first GPU if there is one, else the CPU). dtype "auto": bfloat16
            on a GPU, float32 on a CPU (most CPUs emulate bf16 matmuls, ~4x slower); the text
            is what matters here, the features are extracted later in the extraction's dtype.
        model, tokenizer: already loaded ones (skip loading `target`).

    Returns `out_path`.
    """
    from eyas.data.common.utils import progress

    _check_args(on_error, max_new_tokens, batch_size, cache)
    prompts_path, out_path = Path(prompts_path), Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = set(scan_written(out_path))      # a partial last line left by a crash is cut off
    todo, seen = read_prompts(prompts_path, done, on_error)
    log.info("%d prompts to answer (%d already in %s)", len(todo), len(done & seen), out_path)
    if not todo:
        return out_path

    model, tokenizer, template, stop = _setup_target(target, device, dtype, chat_template, model,
                                                     tokenizer)
    settings = dict(target=str(target), max_new_tokens=max_new_tokens, temperature=temperature,
                    top_p=top_p, seed=seed)
    chunk_records = chunk_records or 4 * batch_size
    counts: Counter[str] = Counter()
    t0 = time.perf_counter()
    render = partial(_render, tokenizer, template, template_kwargs)
    generate = partial(_generate_batch, model, tokenizer, stop=stop, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, cache=cache)
    report = _Progress(sum(len(pending_turns(cv.messages)) for cv in todo), counts)
    bar = progress(range(0, len(todo), chunk_records), desc="generate", unit="chunk")
    with open(out_path, "a", encoding="utf-8") as fout:
        for c, start in enumerate(bar):
            state = _answer_chunk(todo[start:start + chunk_records], c, tokenizer=tokenizer,
                                  render=render, generate=generate, batch_size=batch_size,
                                  seed=seed, counts=counts, report=report)
            _write_chunk(fout, state, settings, counts)
    if counts["empty_generation"]:
        log.warning("%d records got an empty answer and were not written (a later run retries "
                    "them)", counts["empty_generation"])
    dt = time.perf_counter() - t0
    log.info("generated %d turns (%d stopped, %d hit max_new_tokens), %d tokens in %.1f s "
             "(%.0f tokens/s) into %s", counts["stop"] + counts["length"], counts["stop"],
             counts["length"], counts["new_tokens"], dt, counts["new_tokens"] / max(dt, 1e-9),
             out_path)
    return out_path
