"""RoPE of a layout-A drafter as vLLM and SGLang compute it (the engine-math reference's half of it).

Independent of the trainer's `models.rope` (no transformers init functions, no shared code): the
formulas below are the engines' Llama rotary classes, read from vLLM 0.33
(`model_executor/layers/rotary_embedding/`: `get_rope`, `RotaryEmbedding`,
`LinearScalingRotaryEmbedding`, `Llama3RotaryEmbedding`, `YaRNScalingRotaryEmbedding`,
`Phi3LongRoPEScaledRotaryEmbedding`, `DynamicNTKScalingRotaryEmbedding`) and SGLang 0.5.23
(`srt/layers/rotary_embedding/`: `factory.get_rope`, `yarn.py`, `rope_variant.py`). Where the two
engines differ, `engine=` picks one.

What the engines read and compute (vLLM 0.33, SGLang 0.5.23, both through transformers 5):
  * Both build the drafter's Llama config with transformers, which takes `rope_scaling` when
    present (else `rope_parameters`), fills `rope_theta` from the top level, copies a legacy
    `type` into `rope_type`, and for llama3/yarn/longrope defaults
    `original_max_position_embeddings` to the drafter's own `max_position_embeddings`. vLLM's
    Llama layer passes `config.rope_parameters` to `get_rope`; SGLang's passes the same dict
    (its fallback is `rope_scaling`). eyas writes `rope_theta` and a `rope_scaling` with
    `rope_type` and the original length spelled out.
  * default, linear (positions / factor), llama3: identical in both engines and transformers.
  * yarn: both ramp between interpolated and extrapolated frequencies over the original
    length (beta_fast 32, beta_slow 1, truncate true by default) and multiply cos/sin by
    mscale = 0.1·ln(factor) + 1, or mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    vLLM reads `attention_factor` as an override and uses the mscale ratio only when both are
    truthy; SGLang never reads `attention_factor`, uses the ratio when both are not None, and
    multiplies by `attn_factor` and the ramp by `extrapolation_factor` (which vLLM ignores).
  * longrope: both divide the frequencies by `short_factor` / `long_factor` and scale cos/sin by
    `short_mscale` / `long_mscale`, default sqrt(1 + ln(L/orig)/ln(orig)) with L the drafter's
    max_position_embeddings (neither reads `factor` or `attention_factor`). vLLM picks long
    factors for every position when the served length exceeds orig; SGLang picks them per
    forward pass, only when some position exceeds orig.
  * dynamic: vLLM builds a static table with base θ·((f·L/L_trained) − (f−1))^(d/(d−2)),
    L_trained defaulting to L, i.e. plain RoPE; SGLang a static table with base
    θ·(f² − f + 1)^(d/(d−2)). Neither rescales with the running length.
  * Types outside these (ntk, deepseek_yarn, mrope, …) are other classes of `get_rope` that a
    Llama EAGLE-3 drafter never sees from an eyas export.
The trainer's side is models/rope.py, the rules validate_rope.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ENGINES = ("vllm", "sglang")


def engine_rope_params(cfg: dict) -> tuple[float, dict]:
    """(rope_theta, rope parameters) as the engines get them from a drafter config.json dict,
    through transformers (the first point of the module docstring)."""
    rp = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(rp.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rp.setdefault("rope_type", rp.pop("type", "default"))
    rp.pop("type", None)
    if rp["rope_type"] in ("llama3", "yarn", "longrope"):
        rp.setdefault("original_max_position_embeddings", int(cfg.get("max_position_embeddings", 8192)))
    return theta, rp


def mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


class EngineRope:
    """cos/sin tables of one drafter's rotary embedding, the way `engine` builds and indexes them."""

    def __init__(self, cfg: dict, head_dim: int, engine: str = "vllm"):
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r}; choose one of {ENGINES}")
        self.engine, self.d = engine, int(head_dim)
        self.theta, self.p = engine_rope_params(cfg)
        self.kind = self.p["rope_type"]
        self.max_position = int(cfg.get("max_position_embeddings", 8192))
        self.factor = 1.0                      # cos/sin multiplier (yarn, longrope)
        self.long = None                       # longrope: (short inv_freq, long inv_freq, mscales)
        self.inv_freq = self._build()

    def _base_inv(self, base: float) -> Tensor:
        return 1.0 / (base ** (torch.arange(0, self.d, 2, dtype=torch.float) / self.d))

    def _build(self) -> Tensor:
        p, kind = self.p, self.kind
        if kind == "default":
            return self._base_inv(self.theta)
        if kind == "linear":                                   # positions / factor
            return self._base_inv(self.theta) / float(p["factor"])
        if kind == "llama3":
            return self._llama3()
        if kind == "yarn":
            return self._yarn()
        if kind == "longrope":
            return self._longrope()
        if kind == "dynamic":
            f = float(p["factor"])
            if self.engine == "vllm":
                trained = float(p.get("max_trained_positions", self.max_position))
                ratio = f * self.max_position / trained - (f - 1)
            else:
                ratio = f * f - (f - 1)
            return self._base_inv(self.theta * ratio ** (self.d / (self.d - 2)))
        raise ValueError(f"rope type {kind!r} is not implemented by the engine reference")

    def _llama3(self) -> Tensor:
        p, inv = self.p, self._base_inv(self.theta)
        factor, lo, hi = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        orig = float(p["original_max_position_embeddings"])
        wave = 2 * math.pi / inv
        smooth = (orig / wave - lo) / (hi - lo) if hi != lo else torch.zeros_like(inv)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wave < orig / hi, inv, torch.where(wave > orig / lo, inv / factor, blended))

    def _yarn(self) -> Tensor:
        p, d = self.p, self.d
        f, orig = float(p["factor"]), float(p["original_max_position_embeddings"])
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        if self.engine == "vllm":
            if p.get("attention_factor") is not None:
                self.factor = float(p["attention_factor"])
            else:
                self.factor = mscale(f, m) / mscale(f, m_all) if (m and m_all) else mscale(f)
            extrapolation = 1.0
        else:
            both = m is not None and m_all is not None
            self.factor = (mscale(f, m) / mscale(f, m_all) if both else mscale(f))
            self.factor *= float(p.get("attn_factor", 1))
            extrapolation = float(p.get("extrapolation_factor", 1))
        fast, slow = p.get("beta_fast", 32), p.get("beta_slow", 1)

        def dim_of(rotations: float) -> float:
            return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dim_of(fast), dim_of(slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float) - low) / (high - low), 0, 1)
        keep = (1 - ramp) * extrapolation                      # share of extrapolated frequency
        pos_freqs = self.theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)
        return (1.0 / (f * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep

    def _longrope(self) -> Tensor:
        p = self.p
        orig = int(p["original_max_position_embeddings"])
        scale = self.max_position / orig
        default = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig))
        shape = self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float) / self.d)
        short = 1.0 / (torch.tensor(p["short_factor"], dtype=torch.float32) * shape)
        long = 1.0 / (torch.tensor(p["long_factor"], dtype=torch.float32) * shape)
        m_short = float(p["short_mscale"]) if p.get("short_mscale") is not None else default
        m_long = float(p["long_mscale"]) if p.get("long_mscale") is not None else default
        self.long = (short, long, m_short, m_long, orig)
        return long if self.max_position > orig else short

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 cos, sin [n, d/2] at positions [n] (cos/sin factor applied)."""
        inv, factor = self.inv_freq, self.factor
        if self.long is not None:
            short, long, m_short, m_long, orig = self.long
            use_long = (self.max_position > orig if self.engine == "vllm"
                        else bool((positions > orig).any()))
            inv, factor = (long, m_long) if use_long else (short, m_short)
        t = positions.to(torch.float)
        if self.kind == "linear":                            # vLLM/SGLang scale t, not inv_freq
            t, inv = t / float(self.p["factor"]), self._base_inv(self.theta)
        freqs = t[:, None] * inv[None, :]
        return freqs.cos() * factor, freqs.sin() * factor

    def tables(self, positions: Tensor, device: torch.device | str = "cpu"
               ) -> tuple[Tensor, Tensor]:
        """cos, sin [n, 1, d] at positions [n] for `rotate`, computed on the CPU (fp32) and
        moved to `device` once (q and k share them)."""
        cos, sin = self.cos_sin(positions.cpu())
        cos = torch.cat([cos, cos], -1)[:, None, :]
        sin = torch.cat([sin, sin], -1)[:, None, :]
        return cos.to(device), sin.to(device)

    @staticmethod
    def rotate(x: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
        """NeoX-style rotary embedding of x [n, heads, d]: x·cos + rotate_half(x)·sin, with
        `tables` = `tables(positions, x.device)`."""
        cos, sin = tables
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], -1)
        return (xf * cos + rotated * sin).to(x.dtype)
