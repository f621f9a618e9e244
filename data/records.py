"""Conversation records: JSONL lines -> normalised `Conversation`s (prepare and generate share them).

Two record shapes are accepted, OpenAI ``{"id", "messages": [{"role", "content", …}], "tools"?}``
and ShareGPT ``{"id", "conversations": [{"from", "value"}]}``; both become a `Conversation` with
OpenAI roles. A malformed record raises (or, from `iter_jsonl`, yields) a `RecordError` whose
`reason` is one of the codes data.prepare documents.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eyas.data.templates import Conversation, RecordError

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


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict | RecordError]]:
    """(line number, parsed object or RecordError) for each non-blank line of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, RecordError("bad_json",
                                          f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                yield lineno, RecordError("not_an_object",
                                          f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield lineno, obj


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


def resolve_template(chat_template: str | None) -> tuple[str | None, str | None]:
    """(template text or None for the tokenizer's own, name recorded in the manifest)."""
    if chat_template is None:
        return None, None
    from eyas.data.templates import load_template
    return load_template(chat_template), str(chat_template)


# ---------------------------------------------------------------------------------------------
# Generated conversations (data.generate, data.served): pending turns and resuming


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
        lineno = 0
        for line in iter(f.readline, b""):
            lineno += 1
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
