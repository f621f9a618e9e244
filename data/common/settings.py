"""The data-side settings the `eyas` subcommands share with the trainer, with their defaults.

The Hydra schema (`train/config.py`) extends these dataclasses, as its `drafter` group extends
`models.config.DrafterShape`, so a Hydra key (`data.max_length`, `target.dtype`, …) and the
matching command-line option (`eyas prepare --max-length`, `eyas extract --dtype`, …) have one
default, defined here. The command-line front ends take their defaults and help from these
fields (`field_help`); tests/train/test_cli_defaults.py checks that every option matches.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from functools import lru_cache
from typing import Any, List, Optional


class AuxFormat(str, Enum):
    bf16 = "bf16"
    fp8 = "fp8"


class TeacherKind(str, Enum):
    last = "last"
    topk = "topk"


class KVCache(str, Enum):
    dynamic = "dynamic"
    static = "static"


#: precision spellings -> canonical torch dtype names; "auto" is decided per device
#: (`eyas.data.common.targets.target_dtype_name`)
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
#: what `target.dtype` / `--dtype` accept
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)


@dataclass
class SeedSettings:
    seed: int = 0
    """Seed of weights, data order and dropout-free randomness (and of sampled generation)."""


@dataclass
class TargetSettings:
    name: str = "smollm2"
    """Target model: a local Hugging Face model directory, a hub id (org/name[@revision], from
    the HF cache, downloaded when the hub is online), or a preset (smollm2, tiny-llama,
    tiny-deepseek-v3; llama-3.1-8b, qwen3-8b, deepseek-v3, kimi-k2.5 are config-only: the
    target=llama_3_1_8b ... groups name their models' hub ids instead)."""
    aux_layer_ids: Optional[List[int]] = None
    """Aux layers as HF `hidden_states[k]` ids (= vLLM ids); null = 2, N//2, N-3."""
    dtype: str = "auto"
    """dtype the target runs in for generation and extraction: bfloat16 (bf16), float32 (fp32),
    or auto (bfloat16 on CUDA; float32 on CPU, where bf16 matmuls are emulated ~10x slower)."""


@dataclass
class VocabSettings:
    draft_vocab_size: int = 32000
    """Rows of the draft lm_head (capped at the target vocabulary)."""


@dataclass
class TokenizeSettings:
    max_length: int = 2048
    """Longest conversation kept when tokenising (tokens)."""


@dataclass
class GenerationSettings:
    """How `data.generate` answers prompts with the target (`eyas prepare --generate`). The
    trainer's embedded default keeps short, partly sampled answers (`train.config.DataConfig`)."""

    max_new_tokens: int = 512
    """Length cap of generated assistant turns (tokens)."""
    generation_batch_size: int = 16
    """Prompts per generate() call."""
    temperature: float = 0.0
    """Sampling temperature of the generated answers; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus (top-p) cutoff of the sampled answers."""
    generation_cache: KVCache = KVCache.dynamic
    """KV cache of the answers' `generate` calls: dynamic (transformers' default, grown token by
    token) or static (allocated once per call; on a GPU transformers compiles its decoding
    step for each shape, so every batch is padded to generation_batch_size rows and its prompts
    to a multiple of 64 tokens: one compile per 64-token prompt length; batches run shortest
    first, so most share one. benchmarks/generate_cache.py, generate_stage.py)."""

    def generate_kwargs(self) -> dict[str, Any]:
        """These settings as `data.generate.generate_conversations` keywords."""
        return dict(max_new_tokens=self.max_new_tokens, batch_size=self.generation_batch_size,
                    temperature=self.temperature, top_p=self.top_p,
                    cache=KVCache(self.generation_cache).value)


@dataclass
class EndpointSettings:
    """How `eyas generate --endpoint` (data.served) talks to an OpenAI-compatible server."""

    endpoint_concurrency: int = 8
    """Requests in flight at once to the served target."""


@dataclass
class SynthesisSettings:
    synthetic_temperature: float = 1.0
    """Sampling temperature of the prompts the target writes itself (data.synthesize)."""
    synthetic_opener_words: int = 0
    """0: synthetic prompts come from the chat template alone. N > 0: each starts with the first
    N words of a random given prompt and the target writes the rest, so they follow its style."""
    synthetic_examples: int = 0
    """0: off. N > 0: each synthetic prompt is written as the next item of a numbered list of N
    random given prompts (plain text, no chat template; it ends at the line break), so it
    follows their length and register, not only their first words."""


@dataclass
class ExtractionSettings:
    extract_pad_batches: bool = False
    """Extraction pads samples of different lengths into one forward (much faster on a GPU;
    the features then differ from unpadded forwards by kernel rounding only)."""
    aux_format: AuxFormat = AuxFormat.bf16
    """Storage of aux states when extracting: bf16 or fp8 (e4m3 + per-token scale)."""
    teacher: TeacherKind = TeacherKind.last
    """Teacher stored by extraction: the post-norm last hidden state, or top-k logits."""

    def extract_kwargs(self) -> dict[str, Any]:
        """These settings as `data.extract.extract` keywords."""
        return dict(aux_format=self.aux_format.value, teacher=self.teacher.value,
                    pad_batches=self.extract_pad_batches)


def default(cls: type, name: str) -> Any:
    """The default of field `name` of dataclass `cls`, an enum as its value (for argparse)."""
    f = next(f for f in fields(cls) if f.name == name)
    value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return value.value if isinstance(value, Enum) else value


@lru_cache(maxsize=None)
def _docs(cls: type) -> dict[str, str]:
    """{field: its doc line(s), joined} for the fields `cls` itself declares."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, out = tree.body[0].body, {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            out[stmt.target.id] = " ".join(nxt.value.value.split())
    return out


def field_help(cls: type, name: str, key: str | None = None, note: str = "") -> str:
    """argparse help for an option backed by field `name` of `cls`: its doc line, `note`, and
    the default, named by the trainer's Hydra key `key` (e.g. "data.max_length") if it has one."""
    doc = next((_docs(c)[name] for c in cls.__mro__
                if hasattr(c, "__dataclass_fields__") and name in _docs(c)), "")
    named = f"{key}, " if key else ""
    text = " ".join(t for t in (doc, note) if t)
    return f"{text} (default: {named}{default(cls, name)})".replace("%", "%%")
