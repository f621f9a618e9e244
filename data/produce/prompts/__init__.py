"""Prompts shipped with eyas (self-written, short, varied; OpenAI `messages` JSONL with ids).

- `default.jsonl` (645 prompts): general knowledge, how-to, short math, coding, writing,
  definitions, comparisons, advice. The embedded default pipeline answers them with the target
  (`eyas prepare --generate`) to build a small training set.
- `heldout.jsonl` (64 different prompts): kept out of training, for evaluation.
"""

from __future__ import annotations

from pathlib import Path

PROMPT_DIR = Path(__file__).resolve().parent


def prompts_path(name: str = "default") -> Path:
    """Path of a shipped prompt file: "default" or "heldout"."""
    path = PROMPT_DIR / f"{name}.jsonl"
    if not path.is_file():
        names = sorted(p.stem for p in PROMPT_DIR.glob("*.jsonl"))
        raise FileNotFoundError(f"no shipped prompt file {name!r}; available: {names}")
    return path
