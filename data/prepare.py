"""Conversations -> token dataset: input ids and the assistant loss mask, in the target's template.

Input: JSONL, one conversation per line, in either of two shapes:
- OpenAI: ``{"id": ..., "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...,
  "reasoning_content"?: str, "tool_calls"?: [...]}, ...], "tools"?: [...]}``
- ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|"system"|"tool"|..., "value": ...}]}``

Each conversation is rendered with the target tokenizer's chat template (or a shipped/explicit
one, see data/templates) and tokenised once. The loss mask is 1 exactly on the characters the
model generates in assistant turns: reasoning, content, tool calls and the end-of-turn marker;
0 on system/user/tool turns, on the assistant header (the generation prompt) and on anything a
template writes after the end-of-turn marker (e.g. Qwen's newline).

How the assistant spans are found (works for any template, no `{% generation %}` tags needed):
for assistant message i, ``P = render(messages[:i], add_generation_prompt=True)`` and
``F = render(messages[:i+1])``; the span is ``F[len(P):]`` up to and including the last
end-of-turn string in it (`EOT_STRINGS` or `eot_strings=`). If P is not a prefix of F (a template
whose generation prompt differs from the header it writes for stored turns), the span starts at
the longest common prefix of P and F instead. Tokens are masked by their character offsets.

Templates that re-render earlier turns differently (Qwen3 drops the reasoning of earlier turns)
make ``F`` for an early turn not a prefix of the whole conversation. Then a conversation cannot be
one sample with every assistant turn masked: with ``on_nonprefix="split"`` (default) it becomes
one sample per assistant turn (that turn masked, its history rendered as the template renders it
at inference); with ``"raise"`` it is an error naming the turn.

Malformed records are never dropped silently: ``on_error="raise"`` stops at the first one with
``file:line: reason: detail``; ``"skip"`` counts them per reason, logs the counts and stores them in
the summary and the manifest. Reasons: bad_json, not_an_object, no_messages, bad_message,
missing_role, unknown_role, bad_content, empty_assistant, no_assistant, template_error,
no_end_of_turn, non_prefix_render, too_long.

Output (via data.shards): a dataset of kind "tokens"; each sample holds ``input_ids [T]`` and
``loss_mask [T]``; the manifest records the tokenizer identity (name, chat-template sha256,
vocabulary size), the input file, and the counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT `from` values -> OpenAI roles
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "function_call": "assistant", "tool": "tool", "function": "tool",
    "observation": "tool", "function_response": "tool", "ipython": "tool",
}
# End-of-turn markers of common templates; the generated span ends after the last one found.
EOT_STRINGS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<｜end▁of▁sentence｜>",
               "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>", "[EOS]", "</s>")
ERROR_MODES = ("raise", "skip")


class RecordError(ValueError):
    """A malformed or unusable record. `reason` is a short key used for the skip counts."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class PrepareError(ValueError):
    """A record failed in on_error="raise" mode; the message starts with file:line."""


@dataclass
class Conversation:
    """A normalised record: OpenAI-style messages plus optional tool definitions."""

    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Reading and normalising records


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict | RecordError]]:
    """(line number, parsed object or RecordError) for each non-blank line of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, RecordError("bad_json", f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                yield lineno, RecordError("not_an_object",
                                          f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield lineno, obj


def _content_text(content: Any, where: str) -> str | None:
    """Message content as a string: str as is, a list of {"type": "text"} parts joined, None kept."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise RecordError("bad_content", f"{where}: content part of type {kind!r} is not "
                                  f"supported (text parts only)")
            parts.append(p["text"])
        return "".join(parts)
    raise RecordError("bad_content", f"{where}: content must be a string, a list of text parts "
                      f"or null, got {type(content).__name__}")


def _normalise_message(j: int, m: Any, sharegpt: bool) -> dict[str, Any]:
    where = f"message {j}"
    if not isinstance(m, dict):
        raise RecordError("bad_message", f"{where} is a {type(m).__name__}, expected an object")
    if sharegpt:
        src = m.get("from", m.get("role"))
        if src is None:
            raise RecordError("missing_role", f"{where} has no 'from' (ShareGPT) field")
        role = SHAREGPT_ROLES.get(str(src).lower())
        if role is None:
            raise RecordError("unknown_role", f"{where} has from={src!r}; known: "
                              f"{', '.join(sorted(SHAREGPT_ROLES))}")
        out: dict[str, Any] = {"role": role,
                               "content": _content_text(m.get("value", m.get("content")), where)}
    else:
        role = m.get("role")
        if role is None:
            raise RecordError("missing_role", f"{where} has no 'role' field")
        if role not in ROLES:
            raise RecordError("unknown_role", f"{where} has role={role!r}; expected one of {ROLES}")
        out = {"role": role, "content": _content_text(m.get("content"), where)}
        for key in ("reasoning_content", "tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                out[key] = m[key]
    if out["content"] is None and not out.get("tool_calls"):
        raise RecordError("bad_content", f"{where} (role {role}) has no content")
    if role == "assistant" and not ((out["content"] or "").strip() or out.get("reasoning_content")
                                    or out.get("tool_calls")):
        raise RecordError("empty_assistant", f"{where} is an assistant turn with empty content")
    return out


def normalise_record(rec: dict[str, Any], default_id: str) -> Conversation:
    """A JSON record (OpenAI `messages` or ShareGPT `conversations`) -> Conversation."""
    sharegpt = "messages" not in rec and "conversations" in rec
    msgs = rec.get("conversations") if sharegpt else rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RecordError("no_messages", "expected a non-empty list under 'messages' (OpenAI) or "
                          "'conversations' (ShareGPT)")
    messages = [_normalise_message(j, m, sharegpt) for j, m in enumerate(msgs)]
    tools = rec.get("tools")
    extra = {k: v for k, v in rec.items() if k not in ("id", "messages", "conversations", "tools")}
    return Conversation(str(rec.get("id", default_id)), messages, tools or None, extra)


# ---------------------------------------------------------------------------------------------
# Rendering and masking


@dataclass
class TemplateRenderer:
    """Renders conversations with one tokenizer + chat template and computes assistant masks."""

    tokenizer: Any
    chat_template: str | None = None          # None: the tokenizer's own
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    eot_strings: tuple[str, ...] = EOT_STRINGS
    on_nonprefix: str = "split"
    warned_lcp: bool = False
    reasoning_dropped: int = 0        # assistant turns whose reasoning the template omits

    def __post_init__(self):
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template= (a shipped "
                             "name such as 'llama-3.1' or a .jinja path)")
        if self.on_nonprefix not in ("split", "raise"):
            raise ValueError(f"on_nonprefix must be 'split' or 'raise', got {self.on_nonprefix!r}")
        eos = getattr(self.tokenizer, "eos_token", None)
        if eos and eos not in self.eot_strings:
            self.eot_strings = (*self.eot_strings, eos)

    @property
    def template_text(self) -> str:
        return self.chat_template or self.tokenizer.chat_template

    def render(self, conv: Conversation, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=conv.tools, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=generation_prompt, **self.template_kwargs)
        except Exception as e:  # jinja errors, raise_exception() in templates, type errors
            raise RecordError("template_error", f"rendering {len(messages)} message(s) failed: "
                              f"{type(e).__name__}: {e}") from None

    def _span(self, conv: Conversation, i: int) -> tuple[str, int, int]:
        """(F = render(messages[:i+1]), start, end) of assistant message i's generated text."""
        prompt = self.render(conv, conv.messages[:i], True)
        full = self.render(conv, conv.messages[:i + 1], False)
        if full.startswith(prompt):
            start = len(prompt)
        else:
            history = self.render(conv, conv.messages[:i], False)
            if not full.startswith(history):
                raise RecordError("non_prefix_render", f"assistant message {i}: the rendered "
                                  f"history before it is not a prefix of the rendered turn")
            start = len(history)
            while start < min(len(prompt), len(full)) and prompt[start] == full[start]:
                start += 1
            if not self.warned_lcp:
                log.warning("the template's generation prompt is not a prefix of how it renders a "
                            "stored assistant turn; assistant spans start at their longest common "
                            "prefix (first seen in record %s)", conv.id)
                self.warned_lcp = True
        tail = full[start:]
        end = max((tail.rfind(s) + len(s) for s in self.eot_strings if s in tail), default=-1)
        if end < 0:
            raise RecordError("no_end_of_turn", f"assistant message {i}: none of the end-of-turn "
                              f"strings {list(self.eot_strings)} occurs in its rendered text "
                              f"{tail[-80:]!r}; pass eot_strings=[...] for this template")
        self._check_rendered(conv, i, tail[:end])
        return full, start, start + end

    def _check_rendered(self, conv: Conversation, i: int, text: str) -> None:
        """Tool calls the template drops are an error; dropped reasoning is counted and logged."""
        m = conv.messages[i]
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            name = fn.get("name") if isinstance(fn, dict) else None
            if not name or name not in text:
                raise RecordError("template_error", f"assistant message {i} has a tool call "
                                  f"{name!r} that the chat template does not render; use a "
                                  f"template with tool-call support")
        reasoning = (m.get("reasoning_content") or "").strip()
        if reasoning and reasoning not in text:
            self.reasoning_dropped += 1
            if self.reasoning_dropped == 1:
                log.warning("the chat template does not render reasoning_content (first seen in "
                            "record %s); that reasoning is not trained on", conv.id)

    def samples(self, conv: Conversation) -> list[tuple[str, list[tuple[int, int]]]]:
        """[(rendered text, [(start, end) char spans to train on])]: one entry, or one per turn."""
        # an assistant message before any user/tool message answers nothing: context, not trained
        roles = [m["role"] for m in conv.messages]
        first = next((j for j, r in enumerate(roles) if r in ("user", "tool")), len(roles))
        turns = [i for i, r in enumerate(roles) if r == "assistant" and i > first]
        if not turns:
            raise RecordError("no_assistant", "the conversation has no assistant turn after a "
                              "user turn to train on")
        whole = self.render(conv, conv.messages, False)
        spans = [self._span(conv, i) for i in turns]
        bad = [i for i, (f, _, _) in zip(turns, spans) if not whole.startswith(f)]
        if not bad:
            return [(whole, [(s, e) for _, s, e in spans])]
        if self.on_nonprefix == "raise":
            raise RecordError("non_prefix_render", f"the template renders assistant message "
                              f"{bad[0]} differently once later turns follow (e.g. it drops earlier "
                              f"reasoning); use on_nonprefix='split' to train one sample per turn")
        return [(f, [(s, e)]) for f, s, e in spans]

    def tokenize(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool], int]:
        """(input ids, loss mask, number of forced splits) of one rendered text.

        The text is tokenised as a whole; a token is trained on iff its first character lies in
        a span. Where a token straddles a span boundary (e.g. a template's special marker that
        the tokenizer does not know merges with the next character), the text is cut at that
        boundary and the pieces are tokenised separately, so the mask stays exact.
        """
        ids, offsets = self._encode(text, 0, len(text))
        cuts = sorted({c for sp in spans for c in sp
                       if any(a < c < b for a, b in offsets)})
        if cuts:
            ids, offsets = [], []
            for a, b in zip([0, *cuts], [*cuts, len(text)]):
                piece_ids, piece_offsets = self._encode(text, a, b)
                ids += piece_ids
                offsets += piece_offsets
        mask = [any(s <= a < e for s, e in spans) for a, _ in offsets]
        return ids, mask, len(cuts)

    def _encode(self, text: str, a: int, b: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of text[a:b] and their absolute character offsets."""
        tok = self.tokenizer
        if not getattr(tok, "is_fast", False):
            raise ValueError("loss masks need character offsets: load the target's fast "
                             "tokenizer (tokenizer.json)")
        enc = tok(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [(a + s, a + e) for s, e in enc["offset_mapping"]]


def tokenizer_identity(tokenizer, template_text: str, template_name: str | None) -> dict[str, Any]:
    """What identifies the token stream: tokenizer name, vocabulary size, chat-template hash."""
    from data.templates import template_sha256
    return {"name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "vocab_size": len(tokenizer), "chat_template": template_name or "tokenizer",
            "chat_template_sha256": template_sha256(template_text)}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# The pipeline


def _resolve_template(chat_template: str | None) -> tuple[str | None, str | None]:
    """(template text or None for the tokenizer's own, name recorded in the manifest)."""
    if chat_template is None:
        return None, None
    from data.templates import load_template
    return load_template(chat_template), str(chat_template)


def _clear_stale_shards(out: Path) -> None:
    from data.format import MANIFEST_NAME, SHARD_GLOB
    if (out / MANIFEST_NAME).exists():
        raise FileExistsError(f"{out} already holds a complete dataset ({MANIFEST_NAME}); choose "
                              f"another --out or remove it")
    stale = sorted(out.glob(SHARD_GLOB))
    if stale:
        log.info("removing %d shard(s) of an unfinished earlier run in %s", len(stale), out)
        for p in stale:
            p.unlink()


def prepare(input_path: str | Path, target: str | Path, out_dir: str | Path, *,
            max_length: int = 2048, on_error: str = "raise", generate: bool = False,
            chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
            eot_strings: list[str] | None = None, on_nonprefix: str = "split",
            shard_samples: int = 1024, tokenizer=None,
            generate_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tokenise a conversations JSONL into a token dataset (kind "tokens") at `out_dir`.

    Args:
        input_path: conversations JSONL (OpenAI `messages` or ShareGPT `conversations`); with
            `generate=True`, prompts whose assistant turns the target writes first
            (data.generate.generate_conversations, into ``out_dir/generated.jsonl``, resumable).
        target: preset name or model directory (models.targets); gives the tokenizer.
        max_length: longest sample in tokens; longer conversations are a `too_long` error.
        on_error: "raise" (stop at the first bad record, naming file:line) or "skip" (count
            per reason; the counts are logged and returned under "skipped").
        chat_template: None (the tokenizer's own), a shipped name (data.templates) or a path.
        template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).
        eot_strings: end-of-turn strings, replacing `EOT_STRINGS` (the tokenizer's eos is added).
        on_nonprefix: "split" or "raise" for templates that re-render earlier turns (module doc).
        shard_samples: samples per output shard.
        tokenizer: an already loaded tokenizer (skips loading it from `target`).
        generate_kwargs: keyword arguments for generate_conversations (max_new_tokens, ...).

    Returns a summary dict (also stored in the manifest under "prepare").
    """
    from data.shards import write_manifest, write_shard
    from data.utils import progress

    if on_error not in ERROR_MODES:
        raise ValueError(f"on_error must be one of {ERROR_MODES}, got {on_error!r}")
    if max_length < 2 or shard_samples < 1:
        raise ValueError(f"max_length must be >= 2 and shard_samples >= 1; got {max_length}, "
                         f"{shard_samples}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_stale_shards(out)
    source = Path(input_path)
    if generate:
        from data.generate import generate_conversations
        source = generate_conversations(input_path, target, out / "generated.jsonl",
                                        on_error=on_error, chat_template=chat_template,
                                        template_kwargs=template_kwargs,
                                        **(generate_kwargs or {}))
    if tokenizer is None:
        from models.targets import load_tokenizer
        tokenizer = load_tokenizer(target)
    template, template_name = _resolve_template(chat_template)
    renderer = TemplateRenderer(tokenizer, template, dict(template_kwargs or {}),
                                tuple(eot_strings) if eot_strings else EOT_STRINGS, on_nonprefix)

    skipped: Counter[str] = Counter()
    stats = Counter()
    metas, pending = [], []

    def flush():
        metas.append(write_shard(out, len(metas), pending))
        pending.clear()

    for lineno, rec in progress(iter_jsonl(source), desc="prepare", unit="rec"):
        stats["records"] += 1
        try:
            if isinstance(rec, RecordError):
                raise rec
            conv = normalise_record(rec, default_id=f"{source.name}:{lineno}")
            texts = renderer.samples(conv)
            encoded = [renderer.tokenize(text, spans) for text, spans in texts]
            for ids, mask, _ in encoded:
                if len(ids) > max_length:
                    raise RecordError("too_long", f"{len(ids)} tokens > max_length={max_length}; "
                                      f"raise max_length or drop the record")
                if not any(mask):
                    raise RecordError("no_assistant", "no token falls inside an assistant span")
        except RecordError as e:
            if on_error == "raise":
                raise PrepareError(f"{source}:{lineno}: {e}. (on_error='skip' counts such "
                                   f"records instead of stopping)") from None
            skipped[e.reason] += 1
            continue
        stats["conversations"] += 1
        stats["split_records"] += len(encoded) > 1
        for ids, mask, straddle in encoded:
            pending.append({"input_ids": torch.tensor(ids, dtype=torch.int32),
                            "loss_mask": torch.tensor(mask, dtype=torch.bool)})
            stats["samples"] += 1
            stats["tokens"] += len(ids)
            stats["loss_tokens"] += sum(mask)
            stats["boundary_splits"] += straddle
            if len(pending) >= shard_samples:
                flush()
    if pending:
        flush()
    if skipped:
        log.warning("skipped %d of %d records of %s: %s", sum(skipped.values()),
                    stats["records"], source, dict(sorted(skipped.items())))
    if not metas:
        raise PrepareError(f"no usable conversation in {source} ({stats['records']} records; "
                           f"skipped: {dict(skipped)})")
    summary = {"input": str(source), "input_sha256": _file_sha256(source),
               **{k: int(stats[k]) for k in ("records", "conversations", "samples", "tokens",
                                              "loss_tokens", "split_records",
                                              "boundary_splits")},
               "reasoning_not_rendered": renderer.reasoning_dropped,
               "skipped": dict(sorted(skipped.items())), "max_length": max_length,
               "shards": len(metas), "out_dir": str(out)}
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


def cli_main(argv: list[str] | None = None) -> int:
    """`eyas prepare --input FILE.jsonl --target MODEL --out DIR [--generate ...]`."""
    p = argparse.ArgumentParser(
        prog="eyas prepare", description="Tokenise conversations (OpenAI messages or ShareGPT "
        "JSONL) with the target's chat template into a token dataset with assistant loss masks. "
        "With --generate, the target first writes the assistant turns for the given prompts.")
    p.add_argument("--input", required=True, help="conversations (or prompts) JSONL")
    p.add_argument("--target", required=True, help="model directory or preset name")
    p.add_argument("--out", required=True, help="output dataset directory")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--on-error", choices=ERROR_MODES, default="raise")
    p.add_argument("--chat-template", default=None,
                   help="shipped template name (llama-3.1, qwen3, deepseek-v3) or .jinja path")
    p.add_argument("--template-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra chat-template variable, e.g. enable_thinking=false")
    p.add_argument("--on-nonprefix", choices=("split", "raise"), default="split")
    p.add_argument("--shard-samples", type=int, default=1024)
    g = p.add_argument_group("generation (--generate)")
    g.add_argument("--generate", action="store_true", help="generate assistant turns first")
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="generation precision; auto = bf16 on GPU, fp32 on CPU")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    gen = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
               temperature=args.temperature, top_p=args.top_p, seed=args.seed, device=args.device,
               dtype=args.dtype)
    summary = prepare(args.input, args.target, args.out, max_length=args.max_length,
                      on_error=args.on_error, generate=args.generate,
                      chat_template=args.chat_template, template_kwargs=_parse_kv(args.template_arg),
                      on_nonprefix=args.on_nonprefix, shard_samples=args.shard_samples,
                      generate_kwargs=gen)
    print(json.dumps(summary, indent=1))
    return 0
