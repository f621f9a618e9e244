"""Chat templates shipped with eyas, as the model authors publish them.

A target's own tokenizer normally carries its chat template; these copies exist for targets whose
tokenizer lacks one (or carries an older one) and for tests that apply several real templates to
one tokenizer. Each file holds the template text of the model's `tokenizer_config.json`
`chat_template` field, decoded (real newlines), plus one trailing newline that `load_template`
removes so the text (and its sha256) equals the published string.

| name          | model family                        | end of an assistant turn        |
|---------------|-------------------------------------|---------------------------------|
| `llama-3.1`   | Llama-3.1-Instruct                  | `<|eot_id|>`                    |
| `qwen3`       | Qwen3 (thinking: `<think>` blocks)  | `<|im_end|>` then a newline     |
| `deepseek-v3` | DeepSeek-V3 (chat)                  | `<｜end▁of▁sentence｜>`          |
"""

from __future__ import annotations

import hashlib
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent


def available_templates() -> list[str]:
    """Names of the shipped templates (file stems of ``data/templates/*.jinja``)."""
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
