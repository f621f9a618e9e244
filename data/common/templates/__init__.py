"""Chat templates shipped with eyas, and the renderer that finds assistant spans with any template.

Shipped templates are the models' published `chat_template` strings (decoded: real newlines),
for targets whose tokenizer lacks one and for tests that apply several real templates to one
tokenizer. Each file ends with one newline that `load_template` removes, so the text (and its
sha256, the template's identity in manifests) equals the published string.

| name          | model family                        | end of an assistant turn        |
|---------------|-------------------------------------|---------------------------------|
| `llama-3.1`   | Llama-3.1-Instruct                  | `<|eot_id|>`                    |
| `qwen3`       | Qwen3 (thinking: `<think>` blocks)  | `<|im_end|>` then a newline     |
| `deepseek-v3` | DeepSeek-V3 (chat)                  | `<｜end▁of▁sentence｜>`          |

`TemplateRenderer` turns a conversation into text, the character spans the model generates, and
tokens with a loss mask; it needs no `{% generation %}` tags. For assistant message i,
``P = render(messages[:i], add_generation_prompt=True)`` and ``F = render(messages[:i+1])``; the
span is ``F[len(P):]`` up to and including the last end-of-turn string in it (`EOT_STRINGS`, the
tokenizer's eos, or your own). If P is not a prefix of F (a generation prompt that differs from
the header written for stored turns), the span starts at the longest common prefix of P and F.
If some F is not a prefix of the whole rendered conversation (the template re-renders earlier
turns differently once later turns follow, e.g. Qwen3 drops earlier reasoning), the
conversation becomes one sample per assistant turn ("split") or an error ("raise").
Tokens are trained on iff their first character lies in a span; a token straddling a span
boundary (a marker the tokenizer does not know merging with the next character) makes the text
be cut there and tokenised in pieces, so masks stay exact.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

TEMPLATE_DIR = Path(__file__).resolve().parent


def available_templates() -> list[str]:
    """Names of the shipped templates (file stems of ``data/common/templates/*.jinja``)."""
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


def load_template(name_or_path: str | Path) -> str:
    """The text of a shipped template (by name) or of a Jinja file (by path)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = TEMPLATE_DIR / f"{name_or_path}.jinja"
    if not path.is_file():
        raise FileNotFoundError(
            f"chat template {str(name_or_path)!r} is neither a file nor a shipped template "
            f"({', '.join(available_templates())})")
    text = path.read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


def template_sha256(text: str) -> str:
    """sha256 hex digest of a chat template's text (its identity in dataset manifests)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# End-of-turn markers of common templates; the generated span ends after the last one found.
EOT_STRINGS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<｜end▁of▁sentence｜>",
               "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>", "[EOS]", "</s>")


class RecordError(ValueError):
    """A malformed or unusable record. `reason` is a short key used for the skip counts."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template gets them: eyas's own ``weight`` key (data.produce.records) removed."""
    if not any("weight" in m for m in messages):
        return messages
    return [{k: v for k, v in m.items() if k != "weight"} for m in messages]


def trained(message: dict[str, Any]) -> bool:
    """False for a message marked ``"weight": 0`` (context only), else True."""
    return message.get("weight", 1) != 0


@dataclass
class Conversation:
    """A normalised record: OpenAI-style messages plus optional tool definitions."""

    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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
                for_template(messages), tools=conv.tools, chat_template=self.chat_template,
                tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs)
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
                            "prefix (first seen in record %s)", conv.id, extra={"once": True})
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
                            "record %s); that reasoning is not trained on", conv.id,
                            extra={"once": True})

    def samples(self, conv: Conversation) -> list[tuple[str, list[tuple[int, int]]]]:
        """[(rendered text, [(start, end) char spans to train on])]: one entry, or one per turn.

        Assistant turns marked ``"weight": 0`` are rendered (context) but get no span."""
        # an assistant message before any user/tool message answers nothing: context, not trained
        roles = [m["role"] for m in conv.messages]
        first = next((j for j, r in enumerate(roles) if r in ("user", "tool")), len(roles))
        answers = [i for i, r in enumerate(roles) if r == "assistant" and i > first]
        turns = [i for i in answers if trained(conv.messages[i])]
        if not turns:
            raise RecordError("no_assistant", "the conversation has no assistant turn after a "
                              "user turn to train on" + (
                                  f" (all {len(answers)} have weight 0)" if answers else ""))
        whole = self.render(conv, conv.messages, False)
        spans = [self._span(conv, i) for i in turns]
        bad = [i for i, (f, _, _) in zip(turns, spans) if not whole.startswith(f)]
        if not bad:
            return [(whole, [(s, e) for _, s, e in spans])]
        if self.on_nonprefix == "raise":
            raise RecordError("non_prefix_render", f"the template renders assistant message "
                              f"{bad[0]} differently once later turns follow (e.g. it drops "
                              f"earlier reasoning); use on_nonprefix='split' to train one sample "
                              f"per turn")
        return [(f, [(s, e)]) for f, s, e in spans]

    def tokenize(self, text: str, spans: list[tuple[int, int]]
                 ) -> tuple[list[int], list[bool], int]:
        """(input ids, loss mask, number of forced splits) of one rendered text.

        The text is tokenised as a whole; a token is trained on iff its first character lies in
        a span. Where a token straddles a span boundary (e.g. a template's special marker that
        the tokenizer does not know merges with the next character), the text is cut at that
        boundary and the pieces are tokenised separately, so the mask stays exact.
        """
        ids, offsets = self._encode(text, 0, len(text))
        first, last = _columns(offsets)
        cuts = sorted({c for sp in spans for c in sp if ((first < c) & (c < last)).any()})
        if cuts:
            ids, offsets = [], []
            for a, b in zip([0, *cuts], [*cuts, len(text)]):
                piece_ids, piece_offsets = self._encode(text, a, b)
                ids += piece_ids
                offsets += piece_offsets
            first, _ = _columns(offsets)
        mask = np.zeros(len(ids), dtype=bool)
        for s, e in spans:                     # a token is trained iff it starts inside a span
            mask |= (first >= s) & (first < e)
        return ids, mask.tolist(), len(cuts)

    def _encode(self, text: str, a: int, b: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of text[a:b] and their absolute character offsets."""
        tok = self.tokenizer
        if not getattr(tok, "is_fast", False):
            raise ValueError("loss masks need character offsets: load the target's fast "
                             "tokenizer (tokenizer.json)")
        enc = tok(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [(a + s, a + e) for s, e in enc["offset_mapping"]]


def _columns(offsets: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The first and the one-past-last character offsets of every token, as two arrays."""
    both = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    return both[:, 0], both[:, 1]


def tokenizer_identity(tokenizer, template_text: str, template_name: str | None) -> dict[str, Any]:
    """What identifies the token stream: tokenizer name, vocabulary size, chat-template hash."""
    return {"name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "vocab_size": len(tokenizer), "chat_template": template_name or "tokenizer",
            "chat_template_sha256": template_sha256(template_text)}


# ---------------------------------------------------------------------------------------------
# The target's template vs the one a token dataset was rendered with


def target_chat_template(target_dir: Path) -> str | None:
    """The chat template text a served target uses (chat_template.jinja or tokenizer_config)."""
    f = target_dir / "chat_template.jinja"
    if f.is_file():
        return f.read_text()
    tc = target_dir / "tokenizer_config.json"
    if tc.is_file():
        t = json.loads(tc.read_text()).get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            t = next((x.get("template") for x in t if x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return None


def template_drift(identity: dict[str, Any] | None, template: str | None
                   ) -> tuple[str, str] | None:
    """(the dataset's template sha256, the target's) when `template` is not the chat template a
    token dataset was rendered with (`identity`: its manifest's `tokenizer`, from
    `tokenizer_identity`); None when they are the same or either is unknown."""
    recorded = (identity or {}).get("chat_template_sha256")
    if not recorded or template is None:
        return None
    sha = template_sha256(template)
    return None if sha == recorded else (recorded, sha)


def template_mismatch(dataset: str | Path, target: str | Path, label: str | None = None, *,
                      after: str = "") -> str | None:
    """One line saying that `target` serves another chat template than the one the token or
    hidden-state dataset at `dataset` was rendered with, and the fix; None when they are the
    same or cannot be compared (no manifest or template hash, no target directory or template
    here). `label`: how the line names the dataset; `after`: what the fix must be followed by
    (e.g. extracting again). The drafter would be trained on other turn markers than it meets
    when served: `eyas extract` and training refuse it, `eyas doctor` warns."""
    path = Path(dataset) / "manifest.json"
    identity = json.loads(path.read_text()).get("tokenizer") if path.is_file() else None
    if not (identity or {}).get("chat_template_sha256"):
        return None
    dataset = label or dataset
    from eyas.data.common.targets import resolve_target
    try:
        target_dir = resolve_target(target, need="tokenizer")
    except (OSError, ValueError) as e:
        log.info("chat template of target %s not compared with %s's: %s", target, dataset, e)
        return None
    drift = template_drift(identity, target_chat_template(target_dir))
    if drift is None:
        return None
    name = identity.get("chat_template") or "tokenizer"
    used = "its tokenizer's own chat template" if name == "tokenizer" else \
        f"chat template {name!r}"
    return (f"{dataset} was rendered with {used} (sha256 {drift[0][:12]}…, tokenizer "
            f"{identity.get('name_or_path') or '?'}) but target {target} applies another "
            f"(sha256 {drift[1][:12]}…, in {target_dir}): the drafter would be trained on "
            f"other turn markers than it meets when served. Fix: prepare the conversations "
            f"again with this target's template (`eyas prepare --target {target}`, no "
            f"--chat-template){after}, or, if the server is to apply the dataset's template, "
            f"write it to {target_dir / 'chat_template.jinja'}")
