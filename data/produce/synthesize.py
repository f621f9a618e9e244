"""Prompts written by the target itself: the chat template up to the start of a user turn,
sampled until the end-of-turn token (`eyas synthesize`).

A chat model that was trained on conversations has learnt what its users ask. Rendering an
empty conversation up to the user's turn (system prompt included, as the template writes it)
and letting the model continue yields user requests from that distribution, as many as
needed and all different: the prompts a drafter's training set lacks when only a few hundred
hand-written ones exist. Their answers are then generated as usual (data.produce.generate).

Two optional ways steer the style towards a few hundred hand-written example prompts, where the
template alone yields whatever the model's users asked most:
- openers: each candidate's user turn starts with the first few words of a random example
  ("Why do", "Can you explain", "Write a"), and the model writes the rest;
- example lists: each candidate continues a numbered list of a few random examples, one per
  line under a short header, as its next item (plain text, no chat template; the item ends at
  the line break). The model then imitates the examples' length and register, not only their
  first words. With openers too, the new item starts with an opener.

Every candidate is kept or dropped for a counted, logged reason:
- ``length``: the turn never ended within `max_new_tokens` (a cut-off request);
- ``empty``: nothing but whitespace (or nothing after the opener);
- ``duplicate``: the same text (case and spacing folded) as an earlier prompt, an example of
  the lists, or one in `exclude` (e.g. the held-out evaluation prompts, which must stay unseen).
Sampling continues in batches until `n` prompts are kept or `max_rounds` batches in a row
added nothing new.

Output: JSONL, ``{"id": "<prefix>-000000", "messages": [{"role": "user", "content": ...}]}``,
written atomically (nothing appears until all `n` are there).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from eyas.data.produce.generate import _generate_batch, _stop_ids
from eyas.data.common.log import PROGRESS
from eyas.data.produce.records import read_conversations
from eyas.data.common.options import option, shared
from eyas.data.common.settings import (DTYPE_CHOICES, SeedSettings, SynthesisSettings,
                                       TargetSettings)
from eyas.data.common.utils import LogEvery, atomic_write_bytes, progress

log = logging.getLogger(__name__)

_SENTINEL = "\x00eyas-user-turn\x00"


def user_turn_prefix(tokenizer, chat_template: str | None = None) -> str:
    """The rendered chat text that precedes the content of a first user message."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}],
                                         chat_template=chat_template, tokenize=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not render the user message's content "
                         "verbatim; cannot find where a user turn starts")
    return text[:text.index(_SENTINEL)]


def _fold(text: str) -> str:
    return " ".join(text.lower().split())


def prompt_texts(path: str | Path) -> list[str]:
    """The user messages of a prompts or conversations JSONL (for `exclude` and openers), read
    as data.produce.records reads them (OpenAI or ShareGPT). Every record must parse: a malformed one
    is a `PrepareError` naming file:line (a prompt left out of `exclude` could be repeated)."""
    return [m["content"] for _, conv in read_conversations(path) for m in conv.messages
            if m["role"] == "user" and m["content"]]


def prompt_openers(texts: Iterable[str], words: int) -> list[str]:
    """The first `words` words of each text that has more than `words` words (repeats kept, so
    common openers are drawn more often)."""
    if words < 1:
        raise ValueError(f"opener words must be >= 1, got {words}")
    out = [" ".join(t.split()[:words]) for t in texts if len(t.split()) > words]
    if not out:
        raise ValueError(f"no example prompt has more than {words} words to take an opener from")
    return out


#: the line a list of example prompts starts with (`synthesize_prompts(examples=...)`)
LIST_HEADER = "Questions and requests that people send to an AI assistant:\n\n"


def example_list(examples: list[str], shots: int, rng: random.Random) -> str:
    """`LIST_HEADER`, then `shots` distinct random examples numbered one per line (inner
    whitespace folded to single spaces), then the number of the item the model writes next."""
    picked = rng.sample(examples, shots)
    items = "".join(f"{i}. {' '.join(t.split())}\n" for i, t in enumerate(picked, 1))
    return f"{LIST_HEADER}{items}{shots + 1}."


def line_break_ids(tokenizer) -> list[int]:
    """Ids of the tokens whose text holds a line break (where a list item ends): bare line
    breaks and, in tokenizers that merge them, tokens like "?\\n" (the text before the break
    is kept, `_end_of_line`)."""
    out = [i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])]
    if not out:
        raise ValueError("the tokenizer has no line-break token; list items could not end")
    return out


def _bos_text(tokenizer) -> str:
    """The beginning-of-text token as text when the tokenizer's own encoding starts with it
    (plain text then reads as the model saw documents), else ""."""
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer("a")["input_ids"][:1] == [bos]:
        return tokenizer.bos_token
    return ""


def _end_of_line(rows: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """A list item's rows: the text up to the first line break, which counts as its end."""
    return [(written.partition("\n")[0], "stop" if "\n" in written else reason, ntok)
            for written, reason, ntok in rows]


def _keep(starts: list[str], rows: list[tuple[str, str, int]], n: int, *, kept: list[str],
          seen: set[str], counts: Counter[str]) -> None:
    """Add a batch's candidates to `kept` (up to n): drop those cut off at the token limit,
    empty ones and duplicates (of `seen`, folded), counting each reason."""
    for start, (written, reason, ntok) in zip(starts, rows):
        counts["tokens"] += ntok
        text = (start + written).strip()
        key = _fold(text)
        why = ("length" if reason == "length" else "empty" if not written.strip()
               else "duplicate" if key in seen else None)
        if why:
            counts[why] += 1
            continue
        seen.add(key)
        if len(kept) < n:
            kept.append(text)


def _write_prompts(out_path: str | Path, kept: list[str], id_prefix: str) -> None:
    """The prompts as user-turn records `<id_prefix>-<6 digits>`, one JSONL file written
    atomically."""
    lines = [json.dumps({"id": f"{id_prefix}-{i:06d}", "messages": [
        {"role": "user", "content": t}]}, ensure_ascii=False) for i, t in enumerate(kept)]
    atomic_write_bytes(out_path, "".join(x + "\n" for x in lines).encode("utf-8"))


def _check_args(n: int, batch_size: int, max_new_tokens: int, temperature: float) -> None:
    """Raise ValueError for a count below one or a temperature that would not sample."""
    if n < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"n, batch_size and max_new_tokens must be >= 1; got {n}, {batch_size}, "
                         f"{max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample prompts, got {temperature}")


class _Candidates:
    """The texts batch b of candidates starts from: the chat template up to a user turn, or
    with `examples` a numbered list of `shots` of them; with `openers`, one opener each."""

    def __init__(self, tokenizer, openers: Iterable[str], examples: Iterable[str], shots: int,
                 chat_template: str | None):
        self.openers, self.examples, self.shots = list(openers), list(examples), shots
        if self.examples and not 1 <= shots <= len(self.examples):
            raise ValueError(f"a list of {shots} examples needs 1 <= shots <= the number of "
                             f"distinct example prompts ({len(self.examples)})")
        self.prefix = _bos_text(tokenizer) if self.examples \
            else user_turn_prefix(tokenizer, chat_template)
        self.breaks = frozenset(line_break_ids(tokenizer) if self.examples else ())

    def batch(self, b: int, size: int, seed: int) -> tuple[list[str], list[str]]:
        """(the opener of each candidate, "" without openers; the full text each continues)."""
        rng = random.Random(seed + b)
        starts = rng.choices(self.openers, k=size) if self.openers else [""] * size
        if not self.examples:
            return starts, [self.prefix + o for o in starts]
        return starts, [self.prefix + example_list(self.examples, self.shots, rng)
                        + (" " + o if o else "") for o in starts]


@torch.no_grad()
def synthesize_prompts(model, tokenizer, n: int, out_path: str | Path, *,
                       temperature: float = SynthesisSettings.synthetic_temperature,
                       top_p: float = 1.0, max_new_tokens: int = 128, batch_size: int = 256,
                       seed: int = SeedSettings.seed, exclude: Iterable[str] = (),
                       id_prefix: str = "synth", chat_template: str | None = None,
                       max_rounds: int = 8, openers: Iterable[str] = (),
                       examples: Iterable[str] = (), shots: int = 4) -> Path:
    """Sample `n` distinct user prompts from the target; write them to `out_path` (JSONL).

    Args:
        model, tokenizer: the loaded target (transformers).
        n: prompts to keep.
        temperature, top_p: sampling of the user turn (temperature > 0).
        max_new_tokens: longest prompt; longer candidates are dropped, not cut.
        batch_size: candidates per generate() call.
        seed: batch b samples with torch seed `seed + b` (reproducible on one device).
        exclude: texts no kept prompt may equal (after folding case and spacing).
        id_prefix: record ids are `<id_prefix>-<6 digits>`.
        max_rounds: stop after this many consecutive batches that kept nothing.
        openers: if given, every candidate starts with one of them, drawn at random (seeded by
            `seed + b` too); see `prompt_openers`.
        examples, shots: if examples are given, every candidate is the next item of a numbered
            list of `shots` distinct random ones (`example_list`, seeded by `seed + b`) and
            ends at its line break; no kept prompt equals an example.

    Raises RuntimeError when fewer than `n` distinct prompts could be sampled.
    """
    _check_args(n, batch_size, max_new_tokens, temperature)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    examples = list(dict.fromkeys(examples))
    source = _Candidates(tokenizer, openers, examples, shots, chat_template)
    stop = _stop_ids(model, tokenizer) + sorted(source.breaks)
    seen = {_fold(t) for t in [*exclude, *examples]}
    kept: list[str] = []
    counts: Counter[str] = Counter()
    b, barren = 0, 0
    bar, every = progress(None, total=n, desc="synthesize", unit="prompt"), LogEvery()
    while len(kept) < n:
        starts, texts = source.batch(b, batch_size, seed)
        torch.manual_seed(seed + b)
        b += 1
        before = len(kept)
        rows = _generate_batch(model, tokenizer, texts, stop, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_p=top_p, keep=source.breaks)
        _keep(starts, _end_of_line(rows) if examples else rows, n, kept=kept, seen=seen,
              counts=counts)
        bar.update(len(kept) - before)
        if every.due():
            log.info("synthesize: %d/%d prompts kept after %d batches in %.0f s (%d tokens "
                     "sampled)", len(kept), n, b, every.elapsed, counts["tokens"],
                     extra={PROGRESS: True})
        barren = 0 if len(kept) > before else barren + 1
        if barren >= max_rounds:
            raise RuntimeError(f"synthesize: {max_rounds} batches in a row gave no new prompt "
                               f"({len(kept)} of {n} kept; dropped {dict(counts)}); raise "
                               f"temperature or max_new_tokens, or ask for fewer")
    bar.close()
    _write_prompts(out_path, kept, id_prefix)
    log.info("synthesized %d prompts in %.1f s (%d batches, %d tokens sampled; dropped: %d cut "
             "off at %d tokens, %d empty, %d duplicates) into %s", n,
             time.perf_counter() - every.t0, b, counts["tokens"], counts["length"],
             max_new_tokens, counts["empty"], counts["duplicate"], out_path)
    return Path(out_path)


@dataclass(kw_only=True)
class SynthesizeOptions:
    """Prompts written by the target itself: the chat template up to the start of a user turn,
    sampled until the end-of-turn token (`eyas synthesize`).

    Answer them afterwards with `eyas prepare --generate --input OUT ...`."""

    target: str = option(help="model directory, hub id (org/name[@revision]) or preset name")
    n: int = option(help="prompts to write")
    out: str = option(help="output JSONL")
    temperature: float = shared(SynthesisSettings, "synthetic_temperature",
                                "data.synthetic_temperature")
    top_p: float = option(1.0, "nucleus (top-p) cutoff")
    max_new_tokens: int = option(128, "longest prompt (longer ones are dropped)")
    batch_size: int = option(256, "candidate prompts per generate() call")
    seed: int = shared(SeedSettings, "seed", "train.seed")
    id_prefix: str = option(
        "synth", "record ids are PREFIX-000000, ... (keep them unique across files)")
    exclude: list[str] = option(
        [], "prompts file whose user messages must not be repeated (repeatable); the shipped "
        "held-out prompts are always excluded", metavar="PROMPTS.jsonl", action="append")
    openers_from: list[str] = option(
        [], "start every prompt with the first --opener-words words of a random user message from "
        "these files (repeatable), to write prompts in their style", metavar="PROMPTS.jsonl",
        action="append")
    opener_words: int = option(2, "words per opener with --openers-from (default 2)")
    examples_from: list[str] = option(
        [], "write every prompt as the next item of a numbered list of --examples random user "
        "messages from these files (repeatable; plain text, no chat template), to write prompts "
        "of their length and register", metavar="PROMPTS.jsonl", action="append")
    examples: int = option(4, "examples per list with --examples-from (default 4)", metavar="N")
    device: str | None = option(None, "default: cuda if available, else cpu")
    dtype: str = shared(TargetSettings, "dtype", "target.dtype", choices=DTYPE_CHOICES)


def main(args: SynthesizeOptions) -> int:
    starts = prompt_openers([t for f in args.openers_from for t in prompt_texts(f)],
                            args.opener_words) if args.openers_from else []
    examples = [t for f in args.examples_from for t in prompt_texts(f)]
    if args.examples_from and not examples:
        raise ValueError(f"--examples-from {' '.join(args.examples_from)}: no user message to "
                         f"list as an example")

    from eyas.data.produce.prompts import prompts_path
    from eyas.data.common.targets import default_device, load_target, target_dtype
    device = args.device or default_device()
    dtype = target_dtype(args.dtype, device)
    model, tokenizer = load_target(args.target, dtype=dtype, device=device)
    exclude = prompt_texts(prompts_path("heldout"))
    for f in args.exclude:
        exclude += prompt_texts(f)
    synthesize_prompts(model, tokenizer, args.n, args.out, temperature=args.temperature,
                       top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size, seed=args.seed, exclude=exclude,
                       id_prefix=args.id_prefix, openers=starts, examples=examples,
                       shots=args.examples)
    return 0
