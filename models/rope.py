"""The drafter's rotary position embedding: the target's RoPE type, computed the way the engines serve it.

A layout-A drafter is a Llama decoder layer, so vLLM and SGLang build its rotary embedding from
the drafter's config.json `rope_theta` / `rope_scaling` (read through transformers, which merges
them into `rope_parameters`) with their Llama rotary classes (facts: models/serving/engine_rope.py).
The drafter implements every type both engines apply to that layer:

    default   θ^(-2i/d)
    linear    inv_freq / factor
    llama3    Llama-3.1 wavelength-banded interpolation (factor, low/high_freq_factor, original length)
    yarn      YaRN ramp between interpolation and extrapolation (factor, original length, beta_fast,
              beta_slow, truncate); cos and sin are multiplied by the attention factor
              mscale = 0.1·ln(factor) + 1, or mscale(factor, mscale) / mscale(factor, mscale_all_dim)
              when both are given, or `attention_factor`
    longrope  per-dimension rescale factors: `long_factor` when max_position_embeddings exceeds the
              original length, `short_factor` otherwise; cos/sin × long_mscale / short_mscale,
              default sqrt(1 + ln(s)/ln(orig)) with s = max_position_embeddings / original length
    dynamic   plain RoPE (base θ), as vLLM serves it; SGLang serves another table, so a dynamic
              target's drafter is derived with plain RoPE (`target_rope_scaling`) and the
              validator refuses an exported "dynamic"

The inverse frequencies and the yarn attention factor come from transformers' `ROPE_INIT_FUNCTIONS`
(the functions its Llama uses); the longrope attention factor follows the engines (hand-written
above, since transformers derives it from `factor`). `models.serving.engine_rope` re-derives all of
it from the engines' own formulas, independently of this module.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

#: RoPE types the drafter implements (and vLLM/SGLang's Llama drafter classes apply)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
#: keys each type needs in rope_scaling (`target_rope_scaling` fills the original length)
_NEEDED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",
                                                                     "original_max_position_embeddings"),
           "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                      "original_max_position_embeddings"),
           "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
#: types whose original (pre-extension) context length the scaling reads
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    """The rope type of a legacy rope_scaling dict; raises for types or keys the drafter lacks."""
    if not rope_scaling:
        return "default"
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not implemented by the drafter "
                         f"(supported: {SUPPORTED_ROPE_TYPES}); set rope_scaling=None or one of those")
    missing = [k for k in _NEEDED.get(kind, ()) if rope_scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling {rope_scaling} of type {kind!r} lacks {missing}; "
                         f"copy them from the target's config.json")
    unsupported = [k for k in ("alpha", "max_trained_positions") if k in rope_scaling]
    if kind == "dynamic" and unsupported:
        raise ValueError(f"rope_scaling {rope_scaling}: dynamic RoPE with {unsupported} is not "
                         f"implemented by the drafter; set rope_scaling=None")
    return kind


def target_rope_scaling(tc: dict[str, Any]) -> dict[str, Any] | None:
    """The drafter's rope_scaling for a target (text) config.json dict.

    The target's scaling, spelled `rope_type`, with `original_max_position_embeddings` made
    explicit (transformers and the engines would otherwise default it to the DRAFTER's
    max_position_embeddings). A dynamic target gets plain RoPE (module docstring); a type no
    engine applies to a Llama drafter falls back to plain RoPE with a warning.
    """
    scaling = tc.get("rope_scaling")
    if scaling is None and isinstance(tc.get("rope_parameters"), dict):
        scaling = {k: v for k, v in tc["rope_parameters"].items() if k != "rope_theta"}
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return None
    scaling = {k: v for k, v in scaling.items() if k != "type"} | {
        "rope_type": scaling.get("rope_type", scaling.get("type"))}
    kind = scaling["rope_type"]
    if kind == "dynamic":
        log.info("target rope_scaling %s: the drafter uses plain RoPE, which is what vLLM and "
                 "transformers compute for dynamic NTK within max_position_embeddings (SGLang "
                 "would serve an exported 'dynamic' with a different base)", scaling)
        return None
    if kind in _ORIGINAL_LENGTH_TYPES and scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = int(
            tc.get("original_max_position_embeddings") or tc.get("max_position_embeddings", 8192))
    try:
        rope_type(scaling)
    except ValueError:
        log.warning("target rope_scaling %s is not implemented by the Llama-style drafter; the "
                    "drafter uses plain RoPE (override rope_scaling=... to change)", scaling)
        return None
    return scaling


def _hf_config(head_dim: int, theta: float, scaling: dict[str, Any], max_position: int):
    """A one-head LlamaConfig carrying this RoPE, for transformers' init functions (4.56 and 5.x)."""
    from transformers import LlamaConfig

    kind = rope_type(scaling)
    extra: dict[str, Any] = {}
    if kind == "longrope":  # transformers 4.x reads the original length from the top level
        orig = int(scaling["original_max_position_embeddings"])
        extra["original_max_position_embeddings"] = orig
        scaling = dict(scaling, factor=max_position / orig)   # unused here; silences a warning
    if kind == "yarn":      # transformers 4.x derives yarn's factor as max_position / original
        span = float(scaling["original_max_position_embeddings"]) * float(scaling["factor"])
        max_position = int(span) if span == int(span) else span
    return LlamaConfig(hidden_size=head_dim, num_attention_heads=1, num_key_value_heads=1,
                       head_dim=head_dim, max_position_embeddings=max_position, rope_theta=theta,
                       rope_scaling=dict(scaling), **extra)


def rope_parameters(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                    max_position: int) -> tuple[Tensor, float]:
    """([head_dim/2] fp32 inverse frequencies, attention factor multiplying cos and sin)."""
    key = json.dumps(scaling, sort_keys=True) if scaling else ""
    inv, factor = _rope_parameters(int(head_dim), float(theta), key, int(max_position))
    return inv.clone(), factor


@functools.lru_cache(maxsize=32)
def _rope_parameters(head_dim: int, theta: float, key: str, max_position: int
                     ) -> tuple[Tensor, float]:
    scaling = json.loads(key) if key else None
    kind = rope_type(scaling)
    if kind == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = _hf_config(head_dim, theta, scaling, max_position)
    orig = int(scaling.get("original_max_position_embeddings") or max_position)
    if kind == "longrope":
        inv, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=max_position)
        return inv.float(), _longrope_attention_factor(scaling, max_position, orig)
    inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")                  # seq_len None: static
    return inv.float(), float(factor)


def _longrope_attention_factor(scaling: dict[str, Any], max_position: int, orig: int) -> float:
    """The engines' longrope cos/sin factor (vLLM/SGLang Phi3LongRoPEScaledRotaryEmbedding)."""
    key = "long_mscale" if max_position > orig else "short_mscale"
    if scaling.get(key) is not None:
        return float(scaling[key])
    s = max_position / orig
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig))


def apply_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_factor: float = 1.0
               ) -> Tensor:
    """Rotate x [heads, T, d] by positions [T] (rotate-half / NeoX layout, as Llama); fp32 math.

    cos and sin are multiplied by `attention_factor` (yarn, longrope), as the engines do."""
    angles = positions.float()[:, None] * inv_freq.to(x.device)[None, :]  # [T, d/2]
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
