"""Conversation records: JSONL lines -> normalised `Conversation`s (prepare, generate and
synthesize share them).

Two record shapes are accepted, OpenAI ``{"id", "messages": [{"role", "content", …}], "tools"?}``
and ShareGPT ``{"id", "conversations": [{"from", "value"}]}``; both become a `Conversation` with
OpenAI roles. The keys read, and their types, are listed in data/store/FORMAT.md ("Conversation
records"); other keys are ignored (record-level ones are kept in `Conversation.extra`). A message
with ``"weight": 0`` stays in the conversation as context and is not trained on (the normalised
message keeps ``weight: 0``; `templates.for_template` drops the key before rendering). A
malformed record raises (or, from `iter_jsonl`, yields) a `RecordError` whose `reason` is one of
the codes data.produce.prepare documents.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import hashlib
import io
import json
import logging
import lzma
import sys
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eyas.data.common.templates import Conversation, RecordError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT `from` values -> OpenAI roles
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant",
    "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "function_call": "assistant", "tool": "tool", "function": "tool",
    "observation": "tool", "function_response": "tool", "ipython": "tool",
}
ERROR_MODES = ("raise", "skip")


class PrepareError(ValueError):
    """A record failed in on_error="raise" mode; the message starts with file:line."""


# ---------------------------------------------------------------------------------------------
# Reading and normalising records


# magic bytes -> compression; the standard library reads the first three
_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bz2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
_OPENERS = {"gzip": gzip.open, "bz2": bz2.open, "xz": lzma.open}


class _Hashed(io.RawIOBase):
    """A binary stream read once: its bytes are hashed as they pass; `head` holds its first
    bytes, read ahead to tell a compressed stream by its magic bytes."""

    def __init__(self, f, head_bytes: int = max(map(len, _MAGIC))):
        self.f, self.sha = f, hashlib.sha256()
        self.head = b""
        while len(self.head) < head_bytes:
            more = self.f.read(head_bytes - len(self.head))
            if not more:
                break
            self.head += more
        self.sha.update(self.head)
        self._pending = self.head

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self._pending:
            n = min(len(b), len(self._pending))
            b[:n], self._pending = self._pending[:n], self._pending[n:]
            return n
        n = self.f.readinto(b) or 0
        self.sha.update(memoryview(b)[:n])
        return n


class InputFile:
    """A JSONL input read once, from start to end: a file, a FIFO or ``-`` (standard input).

    `lines` gives its raw lines (gzip, bz2 and xz decompressed, told by their magic bytes);
    `sha256()` is the hex digest of the bytes as read (a file's: what ``sha256sum`` prints),
    reading what the lines left. A stream is never opened a second time, so ``--input
    <(zcat x.jsonl.gz)`` and a FIFO work. Use it as a context manager."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._file = sys.stdin.buffer if self.path == "-" else open(path, "rb")
        self._raw = _Hashed(self._file)
        self.compression = next((c for m, c in _MAGIC.items() if self._raw.head.startswith(m)),
                                None)
        if self.compression == "zstd":
            self.close()
            raise PrepareError(f"{self.path}: zstd-compressed, which eyas does not read; "
                               f"decompress it into a stream: --input <(zstd -dc {self.path})")
        stream = io.BufferedReader(self._raw, 1 << 20)
        self._stream = _OPENERS[self.compression](stream) if self.compression else stream

    def lines(self) -> Iterator[bytes]:
        """The raw lines (bytes, with their newline); a corrupt compressed stream is a
        PrepareError naming the file."""
        try:
            yield from self._stream
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:
            if not self.compression:
                raise
            test = {"bz2": "bzip2"}.get(self.compression, self.compression)
            raise PrepareError(f"{self.path}: its {self.compression} stream is corrupt or cut "
                               f"short ({e}); check the file ({test} -t {self.path})") from None

    def sha256(self) -> str:
        while self._raw.read(1 << 20):
            pass
        return self._raw.sha.hexdigest()

    def close(self) -> None:
        if self._file is not sys.stdin.buffer:
            self._file.close()

    def __enter__(self) -> "InputFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict | RecordError]]:
    """(line number, parsed object or RecordError) for each non-blank line of a JSONL file.

    Lines are split on ``\\n`` and decoded one at a time, so a line that is not UTF-8 is a
    `bad_encoding` record error of its own (the lines around it still parse); a UTF-8 byte-order
    mark at the start of the file is dropped. The file is read once (`InputFile`: a FIFO or
    ``-`` works; gzip, bz2 and xz are decompressed)."""
    with InputFile(path) as f:
        for lineno, raw in enumerate(f.lines(), 1):
            rec = parse_line(lineno, raw)
            if rec is not None:
                yield lineno, rec


def read_conversations(path: str | Path) -> Iterator[tuple[dict, Conversation]]:
    """(record, its Conversation) of each record of a JSONL file (`iter_jsonl`), ids defaulting
    to ``<file name>:<line>``; a malformed record is a PrepareError naming file:line."""
    for lineno, rec in iter_jsonl(path):
        try:
            if isinstance(rec, RecordError):
                raise rec
            conv = normalise_record(rec, default_id=f"{Path(path).name}:{lineno}")
        except RecordError as e:
            raise PrepareError(f"{path}:{lineno}: {e}") from None
        yield rec, conv


def parse_line(lineno: int, raw: bytes) -> dict | RecordError | None:
    """One raw JSONL line (`iter_jsonl`): the object, a RecordError, or None for a blank line."""
    bom = len(codecs.BOM_UTF8) if lineno == 1 and raw.startswith(codecs.BOM_UTF8) else 0
    try:
        line = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = bom + e.start                     # offset in the raw line, byte-order mark included
        return RecordError("bad_encoding", f"not valid UTF-8 (byte 0x{raw[at]:02x} at "
                           f"byte {at + 1} of the line); re-encode the file as UTF-8")
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return RecordError("bad_json", f"not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict):
        return RecordError("not_an_object", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _content_text(content: Any, where: str) -> str | None:
    """Message content as a string: str as is, {"type": "text"} parts joined, None kept."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text"
                    and isinstance(p.get("text"), str)):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise RecordError("bad_content", f"{where}: content part of type {kind!r} is not "
                                  f"supported (text parts only)")
            parts.append(p["text"])
        return "".join(parts)
    raise RecordError("bad_content", f"{where}: content must be a string, a list of text parts "
                      f"or null, got {type(content).__name__}")


def _weight(m: dict[str, Any], where: str) -> int:
    """A message's ``weight``: 1 when absent or null, else 0 or 1 (nothing in between)."""
    w = m.get("weight")
    if w is None:
        return 1
    if isinstance(w, bool) or not isinstance(w, (int, float)) or w not in (0, 1):
        raise RecordError("bad_weight", f"{where} has weight={w!r}; expected 0 (kept as "
                          f"context, not trained on) or 1 (trained, the same as no weight)")
    return int(w)


def _check_types(m: dict[str, Any], where: str) -> None:
    """The optional OpenAI message fields eyas passes on, each of the type templates expect."""
    for key in ("reasoning_content", "tool_call_id", "name"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise RecordError("bad_field", f"{where}: {key} must be a string or null, got "
                              f"{type(m[key]).__name__}")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        raise RecordError("bad_field", f"{where}: tool_calls must be a list of objects or null, "
                          f"got {type(calls).__name__}")
    for c, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise RecordError("bad_field", f"{where}: tool call {c} must be an object with a "
                              f"non-empty string function name ({{\"function\": {{\"name\": "
                              f"..., \"arguments\": ...}}}})")


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
        _check_types(m, where)
        for key in ("reasoning_content", "tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                out[key] = m[key]
    if _weight(m, where) == 0:
        out["weight"] = 0
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
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise RecordError("bad_field", f"tools must be a list of objects or null, got "
                          f"{type(tools).__name__}")
    rid = rec.get("id")
    if isinstance(rid, (dict, list, bool)):
        raise RecordError("bad_field", f"id must be a string or a number, got "
                          f"{type(rid).__name__}")
    extra = {k: v for k, v in rec.items() if k not in ("id", "messages", "conversations", "tools")}
    return Conversation(default_id if rid is None else str(rid), messages, tools or None, extra)


def resolve_template(chat_template: str | None) -> tuple[str | None, str | None]:
    """(template text or None for the tokenizer's own, name recorded in the manifest)."""
    if chat_template is None:
        return None, None
    from eyas.data.common.templates import load_template
    return load_template(chat_template), str(chat_template)


# ---------------------------------------------------------------------------------------------
# Generated conversations (data.produce.generate, data.produce.served): pending turns and resuming


def pending_turns(messages: list[dict[str, Any]]) -> list[int]:
    """Indices i such that an assistant answer must be generated right after messages[i]."""
    return [i for i, m in enumerate(messages) if m["role"] in ("user", "tool")
            and (i + 1 == len(messages) or messages[i + 1]["role"] not in ("assistant", "tool"))]


def scan_written(out_path: str | Path) -> dict[str, dict[str, Any]]:
    """{id: its "generation" record} of the conversations already written to `out_path`, in file
    order; cuts off a partial last line left by a crash (logged). A corrupt line elsewhere is a
    ValueError naming it."""
    done: dict[str, dict[str, Any]] = {}
    out_path = Path(out_path)
    if not out_path.exists():
        return done
    good_end = 0
    with open(out_path, "rb+") as f:
        for lineno, line in enumerate(iter(f.readline, b""), 1):
            rec = None
            if line.endswith(b"\n"):
                try:
                    rec = json.loads(line)
                    rid = rec["id"]
                    if rid is None:
                        rec = None
                except (ValueError, KeyError, TypeError):
                    rec = None
            if rec is None:
                rest = f.read()
                if rest.strip():
                    raise ValueError(f"{out_path}:{lineno}: corrupt line in the middle of the "
                                     f"generated conversations; fix or delete that line to resume")
                log.warning("%s:%d: discarding a partial last line (%d bytes) left by an "
                            "interrupted run", out_path, lineno, len(line))
                f.truncate(good_end)
                break
            gen = rec.get("generation")
            done[str(rid)] = gen if isinstance(gen, dict) else {}
            good_end += len(line)
    return done


def read_prompts(prompts_path: Path, done: set[str],
                 on_error: str) -> tuple[list[Conversation], set[str]]:
    """(valid prompt records whose id is not in `done`, the ids of all valid records). A bad
    record raises PrepareError naming file:line (on_error="raise") or is counted and skipped."""
    todo: list[Conversation] = []
    skipped: Counter[str] = Counter()
    seen: set[str] = set()
    for lineno, rec in iter_jsonl(prompts_path):
        try:
            if isinstance(rec, RecordError):
                raise rec
            conv = normalise_record(rec, default_id=f"{prompts_path.name}:{lineno}")
            if conv.id in seen:
                raise RecordError("duplicate_id", f"id {conv.id!r} occurs twice; ids must be "
                                  f"unique for resuming")
            seen.add(conv.id)
            if not pending_turns(conv.messages):
                raise RecordError("nothing_to_generate", "no user turn without an answer")
        except RecordError as e:
            if on_error == "raise":
                raise PrepareError(f"{prompts_path}:{lineno}: {e}") from None
            skipped[e.reason] += 1
            continue
        if conv.id not in done:
            todo.append(conv)
    if skipped:
        log.warning("skipped %d prompt records of %s: %s", sum(skipped.values()), prompts_path,
                    dict(sorted(skipped.items())))
    return todo, seen
