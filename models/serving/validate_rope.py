"""The RoPE rules of the serving contract: a rope type and keys that vLLM and SGLang both read alike.

The engines read `rope_scaling` (else `rope_parameters`) through transformers and build their Llama
rotary class from it (facts and formulas in models/serving/engine_rope.py). A drafter
config is refused when an engine would ignore or misread its RoPE, so that the served function
differs from the trained one:

  ROPE_UNSERVED        a type outside default/linear/llama3/yarn/longrope ("dynamic": the two
                       engines compute different tables; others: no engine or no eyas drafter)
  ROPE_MISREAD         a key one engine reads and the other ignores, with a value that matters
                       (yarn attention_factor, attn_factor, extrapolation_factor, a zero mscale)
  ROPE_KEYS            a key the type needs is missing (vLLM raises; SGLang defaults it)
  ROPE_ENGINES_DIFFER  longrope below its original length (SGLang: short factors; vLLM: long)
  ROPE_TARGET          the drafter's RoPE is not the target's (acceptance falls at long context)
"""

from __future__ import annotations

import math
from typing import Any

from eyas.models.rope import target_rope_scaling
from eyas.models.serving.contract import ERROR, WARNING, Finding, Findings
from eyas.models.serving.engine_rope import engine_rope_params, mscale

ROPE_CODES = {"ROPE_UNSERVED": ERROR, "ROPE_MISREAD": ERROR, "ROPE_KEYS": ERROR,
              "ROPE_ENGINES_DIFFER": WARNING, "ROPE_TARGET": WARNING}
#: rope types both engines apply alike to a Llama EAGLE-3 drafter
SERVED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_NEEDED = {"linear": ("factor",), "yarn": ("factor",),
           "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
           "longrope": ("short_factor", "long_factor")}
_FIX_NULL = 'set "rope_scaling": null (plain RoPE) or re-derive the drafter from the target'


def check_rope(cfg: dict[str, Any], tcfg: dict[str, Any] | None) -> list[Finding]:
    """Findings on the drafter config.json's RoPE (`tcfg`: the target's text config, or None)."""
    out = Findings(ROPE_CODES)
    add = out.add
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if isinstance(raw, dict) and raw.get("type") not in (None, raw.get("rope_type", raw.get("type"))):
        add("ROPE_MISREAD", f"rope_scaling has rope_type={raw['rope_type']!r} and type={raw['type']!r}",
            "vLLM refuses the conflict; transformers 4 readers take `type`",
            "write one key, rope_type")
    _, p = engine_rope_params(cfg)
    kind = p["rope_type"]
    if kind == "dynamic":
        add("ROPE_UNSERVED", "rope_scaling type 'dynamic'",
            "vLLM serves plain RoPE (base rope_theta), SGLang a static NTK base "
            "rope_theta·(f²−f+1)^(d/(d−2)): the two engines compute different functions",
            f"{_FIX_NULL} (plain RoPE is what vLLM and transformers compute within "
            f"max_position_embeddings)")
        return out
    if kind not in SERVED_ROPE_TYPES:
        add("ROPE_UNSERVED", f"rope_scaling type {kind!r}",
            f"the engines' Llama drafter and eyas apply only {SERVED_ROPE_TYPES}", _FIX_NULL)
        return out
    missing = [k for k in _NEEDED.get(kind, ()) if p.get(k) is None]
    if missing:
        add("ROPE_KEYS", f"rope_scaling type {kind!r} lacks {missing}",
            "vLLM raises a KeyError; SGLang substitutes a default with a warning",
            "copy them from the target's rope_scaling")
        return out
    if kind == "yarn":
        _yarn_rules(p, add)
    if kind == "longrope" and int(cfg.get("max_position_embeddings", 0)) > int(
            p["original_max_position_embeddings"]):
        add("ROPE_ENGINES_DIFFER", f"longrope with max_position_embeddings "
            f"{cfg.get('max_position_embeddings')} > original "
            f"{p['original_max_position_embeddings']}",
            "vLLM (and eyas training) use long_factor at every position; SGLang uses "
            "short_factor for a forward pass whose positions all lie within the original length",
            "expect SGLang's acceptance on short prompts to differ; serve with vLLM to match")
    _target_rule(cfg, tcfg, add)
    return out


def _yarn_rules(p: dict[str, Any], add) -> None:
    f = float(p["factor"])
    m, m_all = p.get("mscale"), p.get("mscale_all_dim")
    if m is not None and m_all is not None and not (m and m_all):
        add("ROPE_MISREAD", f"rope_scaling yarn mscale={m!r}, mscale_all_dim={m_all!r}",
            "vLLM (a zero counts as absent) uses 0.1·ln(factor)+1, SGLang the mscale ratio",
            "drop the zero key, or give both non-zero")
    derived = mscale(f, m) / mscale(f, m_all) if (m and m_all) else mscale(f)
    af = p.get("attention_factor")
    if af is not None and not math.isclose(float(af), derived, rel_tol=1e-6):
        add("ROPE_MISREAD", f"rope_scaling yarn attention_factor={af!r} (the mscale rule gives {derived:.6g})",
            "vLLM and transformers scale cos/sin by attention_factor, SGLang ignores it",
            "drop attention_factor and express the scale through mscale/mscale_all_dim")
    for key in ("attn_factor", "extrapolation_factor"):
        if p.get(key, 1) != 1:
            add("ROPE_MISREAD", f"rope_scaling yarn {key}={p[key]!r}",
                "SGLang applies it, vLLM and transformers ignore it", f"drop {key}")


def _target_rule(cfg: dict[str, Any], tcfg: dict[str, Any] | None, add) -> None:
    if not tcfg:
        return
    theta, p = engine_rope_params(cfg)
    t_theta = tcfg.get("rope_theta", (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    want = target_rope_scaling(tcfg) or {"rope_type": "default"}
    want_kind = want.get("rope_type")
    got = {k: v for k, v in p.items() if k != "rope_theta"}
    if float(theta) != float(t_theta) or got.get("rope_type") != want_kind or any(
            got.get(k) != v for k, v in want.items()):
        add("ROPE_TARGET", f"drafter RoPE (rope_theta={theta}, {got}) is not the target's "
            f"(rope_theta={t_theta}, {want})",
            "the drafter then sees other relative positions than the target at long context",
            "re-derive the drafter from the target (Eagle3Config.from_target copies its RoPE)")


def rope_legacy_findings(cfg: dict[str, Any]) -> list[Finding]:
    """ROPE_LEGACY: rope_parameters (transformers 5) without the rope_theta / rope_scaling keys
    that engines built on transformers 4 read; an error when what they would miss is not the
    default (theta 10000, no scaling), since they would then serve another rotary embedding."""
    rp = cfg.get("rope_parameters")
    if not isinstance(rp, dict):
        return []
    scaled = rp.get("rope_type", rp.get("type", "default")) != "default"
    missing = (["rope_theta"] if "rope_theta" not in cfg else []) + \
        (["rope_scaling"] if scaled and not cfg.get("rope_scaling") else [])
    if not missing:
        return []
    theta_differs = "rope_theta" not in cfg and rp.get("rope_theta", 10000.0) != 10000.0
    return [Finding("ROPE_LEGACY", ERROR if theta_differs or "rope_scaling" in missing
                    else WARNING,
                    f"rope_parameters written without the legacy {' / '.join(missing)}",
                    "engines built on transformers 4 read rope_theta (default 10000) and "
                    "rope_scaling (default none: plain RoPE)",
                    f"also write {' and '.join(missing)} with rope_parameters' values")]
