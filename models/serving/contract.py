"""The shared words of the serving contract: findings, the layout, and the tensor-directory reader.

Every module of `models.serving` speaks in these terms: a `Finding` names a broken rule of
`models/serving/CONTRACT.md` (with a stable code, the engine behaviour behind it and the fix);
`CORE_TENSORS` / `expected_shapes` say what layout A ships; `TensorDir` reads names, shapes and
dtypes of a drafter directory from the safetensors headers. This module imports no other part of
the serving package, so the exporter, importer, validators, engines check and doctor can all
build on it without importing each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from eyas.data.store.format import ST_TO_TORCH

ERROR, WARNING = "error", "warning"

#: every tensor layout A ships (d2t/t2d only when the draft vocabulary is smaller)
CORE_TENSORS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
)


def norm_before_fc(cfg: dict[str, Any]) -> bool:
    """The EAGLE-3.1 flag as both engines read it: eagle_config's value first, then the
    top-level key (vLLM 0.33 and SGLang 0.5.23 alike)."""
    return bool((cfg.get("eagle_config") or {}).get("norm_before_fc",
                                                    cfg.get("norm_before_fc", False)))


def eagle31_tensors(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The tensors the EAGLE-3.1 aux norms add when config.json turns them on: input_norm
    (norm_before_fc, one RMSNorm over [h_a|h_b|h_c]) and fc_norm.{0,1,2} (one per aux state)."""
    names: tuple[str, ...] = ("input_norm.weight",) if norm_before_fc(cfg) else ()
    if cfg.get("fc_norm"):
        names += tuple(f"fc_norm.{i}.weight" for i in range(3))
    return names


def layout_tensors(cfg: dict[str, Any]) -> tuple[str, ...]:
    """Every tensor a drafter with this config.json ships besides d2t/t2d."""
    return CORE_TENSORS + eagle31_tensors(cfg)

LAYOUT_A_ARCH = "LlamaForCausalLMEagle3"
#: safetensors header dtype names of the float torch dtypes (`eyas.data.store.format.ST_TO_TORCH`)
FLOAT_DTYPES = tuple(k for k, v in ST_TO_TORCH.items() if v.is_floating_point)


class ExportError(ValueError):
    """The checkpoint cannot become a valid layout-A export; the message says why and how to fix."""


#: what to do when an export's output directory already exists
OVERWRITE_HINT = "choose a new directory or pass overwrite=True (--overwrite)"
#: the run record beside an export (models/serving/card.py writes it)
PROVENANCE = "eyas_provenance.json"


@dataclass(frozen=True)
class Finding:
    """One broken rule: `code` is stable (tests and scripts match on it)."""

    code: str
    severity: str  # "error" (wrong results or a crash) | "warning" (contract deviation, risky)
    message: str   # what is wrong, naming the file/key/value
    why: str       # which engine does what with it
    fix: str       # how to repair the export

    def __str__(self) -> str:
        return (f"[{self.severity}] {self.code}: {self.message}\n"
                f"    why: {self.why}\n    fix: {self.fix}")


class Findings(list):
    """A list of findings whose `add` takes each code's severity from `codes` (code -> severity)
    unless one is given."""

    def __init__(self, codes: dict[str, str]):
        super().__init__()
        self.codes = codes

    def add(self, code: str, message: str, why: str, fix: str,
            severity: str | None = None) -> None:
        self.append(Finding(code, severity or self.codes[code], message, why, fix))


# ---------------------------------------------------------------------------------------------
# The layout: expected tensor shapes from a config.json dict
# ---------------------------------------------------------------------------------------------

def is_int(v: Any) -> bool:
    """An int and not a bool (JSON's true/false are ints to Python)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _int(cfg: dict[str, Any], key: str) -> int | None:
    return cfg[key] if is_int(cfg.get(key)) else None


def config_dims(cfg: dict[str, Any]) -> dict[str, int | None]:
    """H, tH, nh, nkv, hd, I, V, Vd of a layout-A config.json dict (None where absent)."""
    H, nh = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    hd = _int(cfg, "head_dim")
    if hd is None and H and nh:
        hd = H // nh  # LlamaConfig's fallback when head_dim is omitted
    return dict(H=H, tH=_int(cfg, "target_hidden_size"), nh=nh,
                nkv=_int(cfg, "num_key_value_heads") or nh, hd=hd,
                I=_int(cfg, "intermediate_size"), V=_int(cfg, "vocab_size"),
                Vd=_int(cfg, "draft_vocab_size"))


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Layout-A tensor name -> shape implied by the config (None where a dimension is unknown)."""
    d = config_dims(cfg)
    H, tH, nh, nkv, hd, inter, V, Vd = (d[k] for k in ("H", "tH", "nh", "nkv", "hd", "I", "V",
                                                        "Vd"))

    def shape(*dims):
        return None if any(x is None for x in dims) else tuple(dims)

    q = nh * hd if nh and hd else None
    kv = nkv * hd if nkv and hd else None
    return {
        "fc.weight": shape(H, 3 * tH if tH else None),
        "midlayer.input_layernorm.weight": shape(H),
        "midlayer.hidden_norm.weight": shape(H),
        "midlayer.self_attn.q_proj.weight": shape(q, 2 * H if H else None),
        "midlayer.self_attn.k_proj.weight": shape(kv, 2 * H if H else None),
        "midlayer.self_attn.v_proj.weight": shape(kv, 2 * H if H else None),
        "midlayer.self_attn.o_proj.weight": shape(H, q),
        "midlayer.post_attention_layernorm.weight": shape(H),
        "midlayer.mlp.gate_proj.weight": shape(inter, H),
        "midlayer.mlp.up_proj.weight": shape(inter, H),
        "midlayer.mlp.down_proj.weight": shape(H, inter),
        "norm.weight": shape(H),
        "lm_head.weight": shape(Vd, H),  # Vd absent: DRAFT_VOCAB_MISSING says so
        **{n: shape(3 * tH if tH else None) if n == "input_norm.weight" else shape(tH)
           for n in eagle31_tensors(cfg)},
        "d2t": shape(Vd),
        "t2d": shape(V),
    }


# ---------------------------------------------------------------------------------------------
# Lazy reader of a directory of safetensors files
# ---------------------------------------------------------------------------------------------

class TensorDir:
    """Names, shapes and dtypes of every tensor in a drafter directory, read from headers only.

    Handles one `model.safetensors` or shards `model-0000x-of-0000y.safetensors` with
    `model.safetensors.index.json`. Problems with the files themselves (duplicate names across
    shards, an index pointing at a missing file) are collected in `self.findings`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.findings: list[Finding] = []
        self.files = sorted(self.path.glob("*.safetensors"))
        self._where: dict[str, Path] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}  # name -> (dtype str, shape)
        for f in self.files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    if name in self._where:
                        self.findings.append(Finding(
                            "SHARD_DUPLICATE", ERROR,
                            f"tensor {name!r} is in both {self._where[name].name} and {f.name}",
                            "which copy an engine loads depends on file order",
                            "re-export: every tensor must live in exactly one shard"))
                        continue
                    self._where[name] = f
                    self._meta[name] = (sl.get_dtype(), tuple(sl.get_shape()))
        self._check_index()

    def _check_index(self) -> None:
        index = self.path / "model.safetensors.index.json"
        if not index.is_file():
            if len(self.files) > 1:
                self.findings.append(Finding(
                    "SHARD_INDEX", WARNING,
                    f"{len(self.files)} safetensors files but no model.safetensors.index.json",
                    "engines load every *.safetensors file; a stray file adds tensors",
                    "keep only the export's own files, or write the index"))
            return
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            self.findings.append(Finding(
                "SHARD_INDEX", ERROR, f"{index} is not a valid index ({e})",
                "loaders read the shard list from it", "re-export the directory"))
            return
        for name, fname in weight_map.items():
            if not (self.path / fname).is_file():
                self.findings.append(Finding(
                    "SHARD_INDEX", ERROR,
                    f"{index.name} maps {name!r} to {fname}, which does not exist",
                    "the loader fails to open the shard", "re-export the directory"))
            elif self._where.get(name, self.path / fname).name != fname:
                self.findings.append(Finding(
                    "SHARD_INDEX", ERROR,
                    f"{index.name} maps {name!r} to {fname} but it is in "
                    f"{self._where[name].name}", "the index and the shards disagree",
                    "re-export the directory"))
        missing = sorted(set(self._where) - set(weight_map))
        if missing:
            self.findings.append(Finding(
                "SHARD_INDEX", WARNING, f"{index.name} does not list {missing[:5]}",
                "index-driven loaders skip unlisted tensors", "re-export the directory"))

    @property
    def names(self) -> list[str]:
        return list(self._meta)

    def dtype(self, name: str) -> str:
        return self._meta[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][1]

    def load(self, name: str) -> torch.Tensor:
        with safe_open(self._where[name], framework="pt") as st:
            return st.get_tensor(name)

    def chunks(self, name: str, max_elems: int = 1 << 24) -> Iterator[torch.Tensor]:
        """The tensor in row windows of at most ~max_elems values (memory-mapped reads)."""
        shape = self.shape(name)
        if len(shape) <= 1:
            yield self.load(name)
            return
        per_row = max(1, int(torch.tensor(shape[1:]).prod()))
        step = max(1, max_elems // per_row)
        with safe_open(self._where[name], framework="pt") as st:
            sl = st.get_slice(name)
            for a in range(0, shape[0], step):
                yield sl[a:a + step]

    def load_all(self) -> dict[str, torch.Tensor]:
        return {n: self.load(n) for n in self.names}


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/inf in a float tensor: min and max are finite (NaN propagates through both).

    One aminmax pass is ~10x faster than `isfinite(t).all()` on bf16 and allocates nothing.
    """
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a drafter directory, with an error naming the file when it is unusable."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} does not exist: a drafter directory needs a config.json")
    try:
        cfg = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{f} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def resolve_target_config(target_config: dict[str, Any] | str | Path | None) -> dict | None:
    """A target config.json dict (its text part) from a dict, a preset name, a file or a dir."""
    if target_config is None:
        return None
    from eyas.data.common.targets import load_target_config, text_config
    cfg = target_config if isinstance(target_config, dict) else load_target_config(target_config)
    return text_config(cfg)


def require_dir(path: str | Path, what: str = "export directory") -> Path:
    """`path` as a directory, or the usage error (exit 2) a command reports for a mistyped path;
    a directory that exists but is not a valid export is a finding instead."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such {what}")
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: not a directory (expected the {what})")
    return path


def is_speculators_config(cfg: dict[str, Any]) -> bool:
    """A speculators-format config.json (vLLM only), not layout A."""
    return "speculators_model_type" in cfg or "transformer_layer_config" in cfg


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "clean: no findings"
    n_err = sum(f.severity == ERROR for f in findings)
    lines = [str(f) for f in findings]
    lines.append(f"{n_err} error(s), {len(findings) - n_err} warning(s)")
    return "\n".join(lines)


def read_record(export_dir: str | Path, name: str) -> Any:
    """The JSON file `name` of the export; None when absent or damaged (the validator names a
    damaged one)."""
    try:
        return json.loads((Path(export_dir) / name).read_text())
    except (OSError, ValueError):
        return None
