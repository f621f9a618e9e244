"""Samples as decoded text with the loss mask visible (`eyas inspect DIR --samples N`).

A sample is split into maximal runs of tokens with the same loss-mask value; each run is decoded
on its own with ``tokenizer.decode(ids, skip_special_tokens=False)``, so special tokens (chat
headers, end-of-turn markers) appear exactly as the model sees them. Trained runs (loss mask 1)
are wrapped in ``[[`` … ``]]`` (`style="brackets"`, for pipes and files) or shown in colour
(`style="ansi"`, for a terminal). Text outside the markers is context the drafter reads but is
not trained on. A sample whose own text holds ``[[`` or ``]]`` says so in its header line.

A run boundary that falls inside a multi-byte character shows that character as replacement
characters on both sides: the rendering is per run, like the mask.
"""

from __future__ import annotations

import os
import sys
from itertools import groupby
from operator import itemgetter
from typing import Any, Sequence

OPEN, CLOSE = "[[", "]]"
#: trained text in a terminal: black on green; reset before every newline so the colour stops there
ANSI_ON, ANSI_OFF = "\x1b[30;42m", "\x1b[0m"
STYLES = ("brackets", "ansi")


def mask_runs(ids: Sequence[int], mask: Sequence[bool]) -> list[tuple[bool, list[int]]]:
    """Maximal runs of equal mask value: [(trained, ids), ...] in order (empty for no tokens)."""
    if len(ids) != len(mask):
        raise ValueError(f"{len(ids)} ids but {len(mask)} mask values")
    return [(m, [int(t) for _, t in run])
            for m, run in groupby(zip(map(bool, mask), ids), key=itemgetter(0))]


def _ansi(text: str) -> str:
    return "\n".join(ANSI_ON + line + ANSI_OFF if line else "" for line in text.split("\n"))


def sample_header(i: int, ids: Sequence[int], mask: Sequence[bool], note: str = "") -> str:
    """``[i] tokens T  trained K (K/T as a percentage)`` plus an optional note."""
    n, k = len(ids), int(sum(bool(m) for m in mask))
    frac = f"{100 * k / n:.1f}%" if n else "-"
    return f"[{i}] tokens {n}  trained {k} ({frac})" + (f"  {note}" if note else "")


def render_sample(tokenizer: Any, i: int, ids: Sequence[int], mask: Sequence[bool],
                  style: str = "brackets") -> str:
    """Header line, then the decoded sample with its trained runs marked (module doc), then an
    end line."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    runs = [(trained, tokenizer.decode(run, skip_special_tokens=False))
            for trained, run in mask_runs(ids, mask)]
    plain = "".join(text for _, text in runs)
    note = (f"(the text itself contains {OPEN} or {CLOSE})"
            if style == "brackets" and (OPEN in plain or CLOSE in plain) else "")
    mark = (lambda text: OPEN + text + CLOSE) if style == "brackets" else _ansi
    body = "".join(mark(text) if trained else text for trained, text in runs)
    return f"{sample_header(i, ids, mask, note)}\n{body}\n[{i}] end"


def default_style(stream=None, color: str = "auto") -> str:
    """"ansi" for `color="always"`, or for "auto" on a terminal without NO_COLOR; else brackets."""
    if color == "always":
        return "ansi"
    if color == "never" or os.environ.get("NO_COLOR"):
        return "brackets"
    stream = sys.stdout if stream is None else stream
    return "ansi" if getattr(stream, "isatty", lambda: False)() else "brackets"


def dataset_tokenizer(manifest: dict[str, Any], target: str | None = None):
    """(tokenizer, None) for the dataset's target (or `target`), (tokenizer, warning) if its
    vocabulary size differs from the manifest's record, or (None, why) if none loads.

    Tried in order: `target`, else the manifest's ``target`` and then its recorded
    ``tokenizer.name_or_path``."""
    from eyas.data.common.targets import load_tokenizer
    tok_info = manifest.get("tokenizer") if isinstance(manifest.get("tokenizer"), dict) else {}
    names = [target] if target else [manifest.get("target"), tok_info.get("name_or_path")]
    names = [str(n) for n in names if n]
    if not names:
        return None, "the manifest names no target; pass --target MODEL"
    errors = []
    for name in dict.fromkeys(names):
        try:
            tok = load_tokenizer(name)
        except Exception as e:  # noqa: BLE001  any failure means: show ids instead
            errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        want = tok_info.get("vocab_size")
        if isinstance(want, int) and want != len(tok):
            return tok, (f"warning: the tokenizer of {name} has {len(tok)} tokens, the dataset "
                         f"was tokenised with {want}; the text may not be what the model saw")
        return tok, None
    return None, "; ".join(errors)
