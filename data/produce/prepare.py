"""Conversations -> token dataset: input ids and the assistant loss mask, in the target's template.

Input: JSONL, one conversation per line, read once from start to end (a file, a FIFO,
``<(zcat x.jsonl.gz)`` or ``-`` for standard input; gzip, bz2 and xz are decompressed:
`records.InputFile`), in either of two shapes:
- OpenAI: ``{"id": ..., "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...,
  "reasoning_content"?: str, "tool_calls"?: [...]}, ...], "tools"?: [...]}``
- ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|"system"|"tool"|...,
  "value": ...}]}``

Each conversation is rendered with the target tokenizer's chat template (or a shipped/explicit
one) and tokenised once; `data.common.templates.TemplateRenderer` finds the assistant spans (module doc
there). The loss mask is 1 exactly on what the model generates in assistant turns: reasoning,
content, tool calls and the end-of-turn marker; 0 on system/user/tool turns, on the assistant
header (the generation prompt) and on anything a template writes after the end-of-turn marker.
Templates that re-render earlier turns differently (Qwen3 drops earlier reasoning) turn one
conversation into one sample per assistant turn (``on_nonprefix="split"``, the default) or fail
(``"raise"``). An assistant message before any user turn is context, not trained.

Malformed records are never dropped silently: ``on_error="raise"`` stops at the first one with
``file:line: reason: detail``; ``"skip"`` counts them per reason, logs the counts and stores them in
the summary and the manifest. Reasons: bad_encoding (a line that is not UTF-8), bad_json,
not_an_object, no_messages, bad_message, missing_role, unknown_role, bad_content, bad_field (a
key of the wrong type: reasoning_content, tool_calls, tool_call_id, name, tools, id), bad_weight,
empty_assistant, no_assistant, template_error (incl. a template that drops tool calls),
no_end_of_turn, non_prefix_render, too_long. Reasoning a template does not render is counted
(``reasoning_not_rendered``) and logged.

An assistant message with ``"weight": 0`` is rendered as context and not trained on (loss mask
0 on all of it); ``"weight": 1`` or no weight trains it; any other value is a `bad_weight` error.
Such turns are counted (``untrained_turns``). data/store/FORMAT.md lists every key read.

Output (via data.store.shards): a dataset of kind "tokens"; each sample holds ``input_ids [T]`` and
``loss_mask [T]``; the manifest records the tokenizer identity (name, chat-template sha256,
vocabulary size), the input file, and the counts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.data.produce.encoding import auto_workers, encode_file
from eyas.data.common.lock import writes_directory
from eyas.data.produce.records import ERROR_MODES, InputFile, PrepareError, resolve_template
from eyas.data.common.options import option, shared
from eyas.data.common.settings import (DTYPE_CHOICES, GenerationSettings, SeedSettings,
                                       TargetSettings, TokenizeSettings)
from eyas.data.common.templates import EOT_STRINGS, TemplateRenderer, tokenizer_identity

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The pipeline


def _generation_card(source: Path) -> dict[str, Any] | None:
    """The `eyas generate` data card beside `source`; a run's unfinished file is refused."""
    from eyas.data.produce.served import PARTIAL_SUFFIX, read_card
    if source.name.endswith(PARTIAL_SUFFIX):
        raise PrepareError(f"{source}: an unfinished `eyas generate` output; re-run that command "
                           f"until it writes {source.name[:-len(PARTIAL_SUFFIX)]} and its card, "
                           f"then prepare that file")
    return read_card(source)


def _clear_stale_shards(out: Path) -> None:
    """Remove the shards of prepare's own unfinished earlier run; refuse any other data
    (data/produce/outdir.py)."""
    from eyas.data.store.format import SHARD_GLOB
    from eyas.data.produce.outdir import check_prepare_out
    check_prepare_out(out)
    stale = sorted(out.glob(SHARD_GLOB))
    if stale:
        log.info("removing %d shard(s) of an unfinished earlier run in %s", len(stale), out)
        for p in stale:
            p.unlink()


def _write_samples(source: InputFile, out: Path, renderer: TemplateRenderer, *,
                   max_length: int, on_error: str, shard_samples: int, workers: int
                   ) -> tuple[list[dict], Counter, Counter, Counter]:
    """Tokenise every record of `source` (read once) into shards of `shard_samples` samples
    under `out` (data.produce.encoding: `workers` processes). Returns (shard metas, counts, skipped
    records by reason, answers by (temperature, top_p))."""
    from eyas.data.store.shards import write_shard
    from eyas.data.common.utils import LogEvery, progress
    skipped: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    sampling: Counter[tuple] = Counter()
    metas: list[dict] = []
    pending: list[dict] = []
    clock, bar = LogEvery(), progress(None, desc="prepare", unit="rec")
    with contextlib.closing(encode_file(source, renderer, max_length=max_length,
                                        workers=workers)) as chunks:
        for chunk in chunks:
            for rec in chunk.records:
                if rec.error is not None and on_error == "raise":
                    raise PrepareError(f"{source.path}:{rec.lineno}: {rec.error[0]}: "
                                       f"{rec.error[1]}. (on_error='skip' counts such records "
                                       f"instead of stopping)")
                if rec.error is not None:
                    skipped[rec.error[0]] += 1
                for ids, mask in rec.samples:
                    pending.append({"input_ids": torch.from_numpy(ids),
                                    "loss_mask": torch.from_numpy(mask)})
                    if len(pending) >= shard_samples:
                        metas.append(write_shard(out, len(metas), pending))
                        pending.clear()
            stats.update(chunk.stats)
            stats["records"] += len(chunk.records)
            sampling.update(chunk.sampling)
            bar.update(len(chunk.records))
            if clock.due():
                log.info("prepare: %d records (%d samples, %d tokens) in %.0f s",
                         stats["records"], stats["samples"], stats["tokens"], clock.elapsed)
    bar.close()
    if pending:
        metas.append(write_shard(out, len(metas), pending))
    return metas, stats, skipped, sampling


def _check_args(on_error: str, max_length: int, shard_samples: int,
                workers: int | None) -> None:
    if on_error not in ERROR_MODES:
        raise ValueError(f"on_error must be one of {ERROR_MODES}, got {on_error!r}")
    if max_length < 2 or shard_samples < 1:
        raise ValueError(f"max_length must be >= 2 and shard_samples >= 1; got {max_length}, "
                         f"{shard_samples}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1 (1: this process alone) or None (one per "
                         f"core, at most 16, for an input of 16 MiB or more); got {workers}")


def _summary(source: InputFile, stats: Counter, skipped: Counter, sampling: Counter,
             renderer: TemplateRenderer, max_length: int, shards: int, out: Path
             ) -> dict[str, Any]:
    """The run's summary, stored in the manifest under "prepare". `input_sha256`: of the
    input's bytes as read (a compressed file's as stored; `input_compression` names it)."""
    return {"input": source.path, "input_sha256": source.sha256(),
            **({"input_compression": source.compression} if source.compression else {}),
            **{k: int(stats[k]) for k in ("records", "conversations", "samples", "tokens",
                                           "loss_tokens", "split_records",
                                           "boundary_splits", "untrained_turns")},
            "reasoning_not_rendered": renderer.reasoning_dropped,
            "skipped": dict(sorted(skipped.items())), "max_length": max_length,
            "shards": shards, "out_dir": str(out),
            # how the answers were sampled, where the records say (the offline estimate of
            # acceptance at temperature T needs answers sampled at T)
            "answer_sampling": [{"temperature": t, "top_p": tp, "records": n}
                                for (t, tp), n in sorted(sampling.items(), key=str)]}


def _attach_card(summary: dict[str, Any], card: dict[str, Any] | None, source: Path) -> None:
    """`eyas generate` wrote the input: its data card travels along, marked whether the input
    is still what the card describes."""
    if card is None:
        return
    summary["generation_card"] = dict(card, matches_input=card["sha256"] ==
                                      summary["input_sha256"])
    if not summary["generation_card"]["matches_input"]:
        log.warning("%s changed after `eyas generate` wrote it (its sha256 is not the data "
                    "card's); the card is kept in the manifest with matches_input=false",
                    source)


@writes_directory("out_dir", what="token dataset")
def prepare(input_path: str | Path, target: str | Path, out_dir: str | Path, *,
            max_length: int = TokenizeSettings.max_length, on_error: str = "raise",
            generate: bool = False,
            chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
            eot_strings: list[str] | None = None, on_nonprefix: str = "split",
            shard_samples: int = 1024, tokenizer=None,
            generate_kwargs: dict[str, Any] | None = None,
            workers: int | None = None) -> dict[str, Any]:
    """Tokenise a conversations JSONL into a token dataset (kind "tokens") at `out_dir`.

    Args:
        input_path: conversations JSONL (OpenAI `messages` or ShareGPT `conversations`); with
            `generate=True`, prompts whose assistant turns the target writes first
            (data.produce.generate.generate_conversations, into ``out_dir/generated.jsonl``, resumable).
        target: preset name or model directory (data.common.targets); gives the tokenizer.
        max_length: longest sample in tokens; longer conversations are a `too_long` error.
        on_error: "raise" (stop at the first bad record, naming file:line) or "skip" (count
            per reason; the counts are logged and returned under "skipped").
        chat_template: None (the tokenizer's own), a shipped name (data.common.templates) or a path.
        template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).
        eot_strings: end-of-turn strings, replacing `EOT_STRINGS` (the tokenizer's eos is added).
        on_nonprefix: "split" or "raise" for templates that re-render earlier turns (module doc).
        shard_samples: samples per output shard.
        tokenizer: an already loaded tokenizer (skips loading it from `target`).
        generate_kwargs: keyword arguments for generate_conversations (max_new_tokens, ...).
        workers: processes that render and tokenise (data.produce.encoding; the shards are the same
            for any number); None: one per core (at most 16) for an input of 16 MiB or more,
            else 1.

    Returns a summary dict (also stored in the manifest under "prepare").
    """
    from eyas.data.store.shards import write_manifest

    _check_args(on_error, max_length, shard_samples, workers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_stale_shards(out)
    source = Path(input_path)
    if generate:
        from eyas.data.produce.generate import generate_conversations
        source = generate_conversations(input_path, target, out / "generated.jsonl",
                                        on_error=on_error, chat_template=chat_template,
                                        template_kwargs=template_kwargs,
                                        **(generate_kwargs or {}))
    card = _generation_card(source)
    if tokenizer is None:
        from eyas.data.common.targets import load_tokenizer
        tokenizer = load_tokenizer(target)
    template, template_name = resolve_template(chat_template)
    renderer = TemplateRenderer(tokenizer, template, dict(template_kwargs or {}),
                                tuple(eot_strings) if eot_strings else EOT_STRINGS, on_nonprefix)

    with InputFile(source) as stream:
        metas, stats, skipped, sampling = _write_samples(
            stream, out, renderer, max_length=max_length, on_error=on_error,
            shard_samples=shard_samples, workers=auto_workers(source, workers))
        if skipped:
            log.warning("skipped %d of %d records of %s: %s", sum(skipped.values()),
                        stats["records"], source, dict(sorted(skipped.items())))
        if not metas:
            raise PrepareError(f"no usable conversation in {source} ({stats['records']} "
                               f"records; skipped: {dict(skipped)})")
        summary = _summary(stream, stats, skipped, sampling, renderer, max_length, len(metas),
                           out)
    _attach_card(summary, card, source)
    write_manifest(out, {
        "kind": "tokens", "target": str(target),
        "tokenizer": tokenizer_identity(tokenizer, renderer.template_text, template_name),
        "template_kwargs": dict(template_kwargs or {}), "prepare": summary}, metas)
    log.info("prepared %d samples (%d tokens, %d trained) from %d records into %s",
             summary["samples"], summary["tokens"], summary["loss_tokens"], summary["records"], out)
    return summary


def _parse_kv(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


_GENERATION = "generation (--generate)"


@dataclass(kw_only=True)
class PrepareOptions:
    """Tokenise conversations (OpenAI messages or ShareGPT JSONL) with the target's chat template
    into a token dataset with assistant loss masks. With --generate, the target first writes the
    assistant turns for the given prompts."""

    input: str = option(help="conversations (or prompts) JSONL, read once: a file, a FIFO, "
                        "<(command) or - (standard input); gzip, bz2 and xz are read directly")
    target: str = option(help="model directory, hub id (org/name[@revision]) or preset name")
    out: str = option(help="output token dataset directory (locked while written; one holding "
                      "other data is refused)")
    max_length: int = shared(TokenizeSettings, "max_length", "data.max_length")
    on_error: str = option(
        "raise", "a malformed record: stop there (naming file:line) or skip and count it",
        choices=ERROR_MODES)
    chat_template: str | None = option(
        None, "shipped template name (llama-3.1, qwen3, deepseek-v3) or .jinja path (default: the "
        "target tokenizer's own)")
    template_arg: list[str] = option(
        [], "extra chat-template variable, e.g. enable_thinking=false", metavar="KEY=VALUE",
        action="append")
    on_nonprefix: str = option(
        "split", "a template that re-renders earlier turns: one sample per assistant turn, or "
        "fail", choices=("split", "raise"))
    shard_samples: int = option(1024, "samples per output shard")
    workers: int | None = option(
        None, "processes that render and tokenise (the output is the same for any number; "
        "default: one per core, at most 16, for an input file of 16 MiB or more, else 1)",
        type=_positive_int)
    generate: bool = option(False, "generate assistant turns first", group=_GENERATION)
    max_new_tokens: int = shared(GenerationSettings, "max_new_tokens", group=_GENERATION)
    batch_size: int = shared(GenerationSettings, "generation_batch_size",
                             "data.generation_batch_size", group=_GENERATION)
    temperature: float = shared(GenerationSettings, "temperature", group=_GENERATION)
    top_p: float = shared(GenerationSettings, "top_p", group=_GENERATION)
    cache: str = shared(GenerationSettings, "generation_cache", "data.generation_cache",
                        group=_GENERATION)
    seed: int = shared(SeedSettings, "seed", "train.seed", group=_GENERATION)
    device: str | None = option(None, "default: cuda if available, else cpu", group=_GENERATION)
    dtype: str = shared(TargetSettings, "dtype", "target.dtype", choices=DTYPE_CHOICES,
                        group=_GENERATION)


def main(args: PrepareOptions) -> int:
    """`eyas prepare --input FILE.jsonl --target MODEL --out DIR [--generate ...]`."""
    summary = prepare(args.input, args.target, args.out, max_length=args.max_length,
                      on_error=args.on_error, generate=args.generate,
                      chat_template=args.chat_template,
                      template_kwargs=_parse_kv(args.template_arg),
                      on_nonprefix=args.on_nonprefix, shard_samples=args.shard_samples,
                      workers=args.workers,
                      generate_kwargs=dict(max_new_tokens=args.max_new_tokens,
                                           batch_size=args.batch_size, cache=args.cache,
                                           temperature=args.temperature, top_p=args.top_p,
                                           seed=args.seed, device=args.device, dtype=args.dtype))
    print(json.dumps(summary, indent=1))
    return 0
