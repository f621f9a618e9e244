"""`Eagle3Config`: the drafter's shape, mapping 1:1 onto the exported layout-A config.json.

Layout A (models/serving/CONTRACT.md §2) is a one-layer Llama-style drafter that both vLLM
(`LlamaForCausalLMEagle3`) and SGLang load unchanged. Every exported field has a dataclass field
of the same name, except the aux layer ids, which the file spells twice, once per engine
(CONTRACT.md §2, "Aux layer ids"): `aux_layer_ids` holds the HF `hidden_states[k]` ids
(= vLLM ids).

Fields in `TRAINING_ONLY` (the TTT unroll depth) steer training and are never written to
config.json. `Eagle3Config.from_target` derives a drafter from a target's config.json dict with
per-family defaults for the attention/MLP shape (see `_family_shape`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from eyas.data.common.settings import VocabSettings
from eyas.data.common.targets import AUX_IDS_RULE, aux_layer_ids_error, default_aux_layer_ids
from eyas.models.rope import rope_type, target_rope_scaling

log = logging.getLogger(__name__)

#: fields that steer training only; `to_config_dict` never writes them
TRAINING_ONLY = ("ttt_steps",)
#: the EAGLE-3.1 variants (fields of Eagle3Config and config.json keys of the same name)
EAGLE31_KEYS = ("norm_before_fc", "fc_norm", "norm_output")

#: model_type values of MLA targets (DeepSeek-V2/V3, Kimi-K2/K2.5): their attention shape cannot be
#: copied into a Llama-style drafter, so the drafter gets a GQA shape of its own
_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")

# config.json keys that from_config_dict accepts and checks but that have no dataclass field
_FIXED_KEYS = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
}


@dataclass
class DrafterShape(VocabSettings):
    """The drafter's shape as chosen by a user: None derives the field from the target
    (`Eagle3Config.from_target`). The Hydra schema's `drafter` group extends it. Its first
    field, draft_vocab_size, is `data.common.settings.VocabSettings` (also `eyas vocab --size`)."""

    ttt_steps: int = 7
    """K: training-time-test unroll length; must be >= the serving num_speculative_tokens
    (training accepts 1..64, see train/limits.py)."""
    num_attention_heads: Optional[int] = None
    """Attention heads; null = the target family's default."""
    num_key_value_heads: Optional[int] = None
    """KV heads; null = the target family's default."""
    head_dim: Optional[int] = None
    """Head dimension; null = the target family's default."""
    intermediate_size: Optional[int] = None
    """SwiGLU width; null = the target family's default."""
    max_position_embeddings: Optional[int] = None
    """Exported context length; null = the target's."""
    norm_before_fc: bool = False
    """EAGLE-3.1: one RMSNorm over the concatenated aux states before fc (input_norm)."""
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm per aux state before fc (fc_norm.0-2)."""
    norm_output: bool = False
    """EAGLE-3.1: feed the next draft step the final norm's output, not the pre-norm state.
    The three variants load in vLLM >= 0.33 and SGLang >= 0.5.23 only (older builds ignore
    the keys and serve another function); all off is plain EAGLE-3."""

    def overrides(self) -> dict[str, int | bool]:
        """The fields set explicitly (not None), as `Eagle3Config.from_target` keywords."""
        return {f.name: getattr(self, f.name) for f in fields(DrafterShape)
                if getattr(self, f.name) is not None}


@dataclass
class Eagle3Config:
    """Shape of an EAGLE-3 drafter (layout A) plus the training-only unroll depth."""

    hidden_size: int
    """drafter width H; the target's hidden size, so the target embedding can be shared"""
    target_hidden_size: int
    """target hidden size tH; fc fan-in is 3 * tH"""
    num_attention_heads: int
    """query heads of the single decoder layer"""
    num_key_value_heads: int
    """key/value heads (GQA); divides num_attention_heads"""
    head_dim: int
    """per-head width; q_proj has num_attention_heads * head_dim rows"""
    intermediate_size: int
    """SwiGLU MLP width I"""
    vocab_size: int
    """the TARGET's vocabulary size V (embedding rows; size of vLLM's scattered logits)"""
    draft_vocab_size: int
    """lm_head rows Vd <= V; row i is target id i + d2t[i]"""
    aux_layer_ids: list[int]
    """[a, b, c], HF hidden_states[k] indices (= vLLM ids), strictly ascending, a >= 2"""
    rms_norm_eps: float = 1e-5
    """epsilon of every RMSNorm"""
    rope_theta: float = 10000.0
    """RoPE base"""
    rope_scaling: Optional[dict[str, Any]] = None
    """legacy HF rope_scaling dict (rope_type in SUPPORTED_ROPE_TYPES, models/rope.py) or None"""
    max_position_embeddings: int = 8192
    """>= the target's context length (vLLM crashes on longer prompts otherwise)"""
    hidden_act: str = "silu"
    """only SwiGLU ("silu") exists in both engines"""
    norm_before_residual: bool = False
    """always False: SGLang does not implement the True variant"""
    norm_before_fc: bool = False
    """EAGLE-3.1: one RMSNorm over the concatenated aux states [h_a|h_b|h_c] before fc
    (tensor input_norm.weight [3·tH]; vLLM >= 0.33 and SGLang >= 0.5.23 load it)"""
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm per aux state before fc (fc_norm.{0,1,2}.weight [tH]), applied
    after input_norm when both are on"""
    norm_output: bool = False
    """EAGLE-3.1: the hidden state fed to the next draft step is the final norm's output, not
    the pre-norm residual"""
    # ---- training only: never exported (TRAINING_ONLY) ----
    ttt_steps: int = 7
    """TTT unroll depth K used in training; >= the serving num_speculative_tokens"""

    def __post_init__(self) -> None:
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        for name in ("hidden_size", "target_hidden_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                     "draft_vocab_size", "max_position_embeddings", "ttt_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Eagle3Config.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; pick a KV head count that divides it")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds the target vocab_size="
                f"{self.vocab_size}; the draft vocabulary is a subset of the target's")
        if self.hidden_size == 3 * self.target_hidden_size:
            raise ValueError(
                f"hidden_size={self.hidden_size} == 3 * target_hidden_size: SGLang then skips fc "
                f"and serves a different function; use the target's hidden size")
        why = aux_layer_ids_error(self.aux_layer_ids)
        if why is not None:
            raise ValueError(f"aux_layer_ids={list(self.aux_layer_ids)}: {why}; expected "
                             f"{AUX_IDS_RULE}; the default for N target layers is "
                             f"[2, N//2, N-3]")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {self.hidden_act!r}")
        if self.norm_before_residual:
            raise ValueError("norm_before_residual=True is not supported: SGLang does not "
                             "implement it, so a drafter trained with it serves wrongly there")
        if rope_type(self.rope_scaling) == "longrope":  # validates the keys of every type
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != self.head_dim // 2:
                    raise ValueError(
                        f"rope_scaling.{key} has {len(self.rope_scaling[key])} entries, the "
                        f"drafter's head_dim={self.head_dim} needs head_dim/2 = {self.head_dim // 2};"
                        f" give the drafter the target's head_dim")

    # ------------------------------------------------------------------ target → drafter
    @classmethod
    def from_target(cls, target_config: dict[str, Any], *,
                    draft_vocab_size: int = VocabSettings.draft_vocab_size,
                    aux_layer_ids: list[int] | None = None, **overrides: Any) -> Eagle3Config:
        """Derive a drafter for a target from its config.json dict.

        Width = target hidden size; vocab, norm eps, RoPE base/scaling and context length are
        copied; attention/MLP shape from `_family_shape`. Multimodal configs (Kimi-K2.5) are read
        from their `text_config`. `aux_layer_ids` defaults to [2, N//2, N-3]. Any field can be
        overridden by keyword (e.g. `num_key_value_heads=4`).
        """
        tc = target_config.get("text_config") or target_config
        for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
            if key not in tc:
                raise ValueError(f"target config has no {key!r}; expected a Hugging Face "
                                 f"config.json dict (keys seen: {sorted(tc)[:12]}...)")
        num_layers = int(tc["num_hidden_layers"])
        if aux_layer_ids is None:
            aux_layer_ids = default_aux_layer_ids(num_layers)
        why = aux_layer_ids_error(aux_layer_ids, num_layers)
        if why is not None:
            raise ValueError(f"aux_layer_ids={list(aux_layer_ids)}: {why}; expected "
                             f"{AUX_IDS_RULE}")
        vocab = int(tc["vocab_size"])
        scaling = target_rope_scaling(tc)
        theta = tc.get("rope_theta", (tc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        kwargs: dict[str, Any] = dict(
            hidden_size=int(tc["hidden_size"]), target_hidden_size=int(tc["hidden_size"]),
            vocab_size=vocab, draft_vocab_size=min(int(draft_vocab_size), vocab),
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=int(tc.get("max_position_embeddings", 8192)),
            **_family_shape(tc))
        if draft_vocab_size > vocab:
            log.info("draft_vocab_size=%d > target vocab %d: using the full target vocabulary",
                     draft_vocab_size, vocab)
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown Eagle3Config override(s) {sorted(unknown)}; "
                            f"fields are {[f.name for f in fields(cls)]}")
        kwargs.update(overrides)
        return cls(**kwargs)

    # ------------------------------------------------------------------ config.json
    def to_config_dict(self) -> dict[str, Any]:
        """The exact layout-A config.json dict (models/serving/CONTRACT.md §2); training-only
        fields omitted."""
        a, b, c = self.aux_layer_ids
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "norm_before_residual": False,
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": [a - 1, b - 1, c - 1],
                             **({"norm_before_fc": True} if self.norm_before_fc else {})},
            "eagle_aux_hidden_state_layer_ids": [a, b, c],
            "torch_dtype": "bfloat16",
            # the EAGLE-3.1 variants only when on: older engine builds do not know the keys
            **{k: True for k in EAGLE31_KEYS if getattr(self, k)},
        }

    @classmethod
    def from_config_dict(cls, d: dict[str, Any], **training: Any) -> Eagle3Config:
        """Read a layout-A config.json dict (inverse of `to_config_dict`).

        Accepts either aux-id spelling (both must agree when both are present) and transformers
        5's `rope_parameters` in place of `rope_theta`/`rope_scaling`. Training-only fields
        (`ttt_steps`) come from keyword arguments. Keys with no meaning for layout A are
        reported in a warning, never silently used.
        """
        for key, want in _FIXED_KEYS.items():
            if key in d and d[key] != want:
                raise ValueError(f"config.json {key}={d[key]!r}, layout A needs {want!r}")
        if d.get("norm_before_residual", False):
            raise ValueError("config.json norm_before_residual=true: eyas drafters (and SGLang) "
                             "implement only false")
        aux = _aux_ids_from_dict(d)
        nbf = (d.get("eagle_config") or {}).get("norm_before_fc")
        if nbf is not None and bool(nbf) != bool(d.get("norm_before_fc", nbf)):
            raise ValueError(f"config.json norm_before_fc={d.get('norm_before_fc')!r} but "
                             f"eagle_config.norm_before_fc={nbf!r}: both engines read "
                             f"eagle_config's first; write one value in both places")
        names = {f.name for f in fields(cls)} - set(TRAINING_ONLY) - {"aux_layer_ids"}
        kwargs: dict[str, Any] = {n: d[n] for n in names if n in d}
        if nbf is not None:
            kwargs["norm_before_fc"] = bool(nbf)
        if not d.get("rope_scaling") and isinstance(d.get("rope_parameters"), dict):
            # as the engines read it (`models.serving.engine_rope`): rope_scaling when present,
            # else rope_parameters, whose rope_theta wins over the top-level one
            rp = dict(d["rope_parameters"])
            kwargs["rope_theta"] = float(rp.pop("rope_theta", d.get("rope_theta", 10000.0)))
            kwargs["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
        missing = [n for n in ("hidden_size", "target_hidden_size", "num_attention_heads",
                               "num_key_value_heads", "intermediate_size", "vocab_size")
                   if kwargs.get(n) is None]
        if missing:
            raise ValueError(f"config.json lacks {missing} (or has null): layout A writes "
                             f"explicit ints; re-export the drafter")
        kwargs.setdefault("head_dim", None)
        if kwargs["head_dim"] is None:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        if kwargs.get("draft_vocab_size") is None:
            kwargs["draft_vocab_size"] = kwargs["vocab_size"]
        known = names | set(_FIXED_KEYS) | {"eagle_config", "eagle_aux_hidden_state_layer_ids",
                                            "torch_dtype", "rope_parameters", "norm_before_residual",
                                            "transformers_version", "bos_token_id", "eos_token_id",
                                            "pad_token_id", "initializer_range", "use_cache",
                                            "attention_dropout", "pretraining_tp", "dtype"}
        extra = sorted(set(d) - known)
        if extra:
            log.warning("config.json keys ignored by the layout-A drafter: %s", extra)
        return cls(aux_layer_ids=aux, **kwargs, **training)

    def to_dict(self) -> dict[str, Any]:
        """All fields (including training-only ones), e.g. for checkpoints and logging."""
        return asdict(self)


# ---------------------------------------------------------------------- helpers
def _family_shape(tc: dict[str, Any]) -> dict[str, int]:
    """Attention/MLP shape of the drafter for a target (text) config.

    Dense GQA targets (Llama, Qwen, SmolLM2, tiny Llama): the target's own layer shape.
    MLA targets (DeepSeek-V3, Kimi-K2/K2.5): GQA with head_dim 128, H/128 heads, 8 KV heads and
    the target's dense intermediate size (7168 → 56/8/128, I=18432), as published Kimi drafters
    use; tiny MLA targets (H < 1024) get 4 heads / 2 KV heads of width H/4.
    """
    hidden = int(tc["hidden_size"])
    mla = tc.get("model_type") in _MLA_MODEL_TYPES or "kv_lora_rank" in tc
    if mla:
        if hidden % 128 == 0 and hidden >= 1024:
            heads, kv, head_dim = hidden // 128, min(8, hidden // 128), 128
        else:
            heads, kv, head_dim = 4, 2, hidden // 4
        return dict(num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                    intermediate_size=int(tc.get("intermediate_size", 2 * hidden)))
    heads = int(tc["num_attention_heads"])
    return dict(num_attention_heads=heads,
                num_key_value_heads=int(tc.get("num_key_value_heads") or heads),
                head_dim=int(tc.get("head_dim") or hidden // heads),
                intermediate_size=int(tc["intermediate_size"]))


def _aux_ids_from_dict(d: dict[str, Any]) -> list[int]:
    top = d.get("eagle_aux_hidden_state_layer_ids")
    sg = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top is None and sg is None:
        raise ValueError("config.json has neither eagle_aux_hidden_state_layer_ids nor "
                         "eagle_config.eagle_aux_hidden_state_layer_ids; layout A writes both")
    if top is not None and sg is not None and [int(i) + 1 for i in sg] != [int(i) for i in top]:
        raise ValueError(f"aux layer ids disagree: eagle_aux_hidden_state_layer_ids={top} (vLLM) "
                         f"but eagle_config ids={sg} (SGLang, must be each vLLM id - 1)")
    return [int(i) for i in top] if top is not None else [int(i) + 1 for i in sg]
