"""Check an exported drafter directory against the serving contract, before any server starts.

`validate(dir, target_config)` returns a list of `Finding`s: each names a rule of
`serving-contract.md` (§2 config.json, §3 model.safetensors) that the export breaks, which engine
misbehaves and how, and the fix. An empty list means vLLM and SGLang will both load the directory
and compute the function eyas trained. With ``numeric=True`` it also loads the exported tensors the
way the engines do and checks that they reproduce the trainer's logits (validate_numeric.py).

Tensors are read lazily (safetensors headers for names/shapes/dtypes; values only for the vocab
mapping and a chunked NaN/inf scan), so a 10 GB export validates in seconds.

    eyas validate DIR --target-config TARGET [--target-weights DIR] [--numeric]

exits 0 when the directory is clean and 1 when there are findings (errors or warnings).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

ERROR, WARNING = "error", "warning"

#: decoder-layer prefix of layout A (SGLang before mid-2026 reads only this spelling)
LAYER = "midlayer."
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
VOCAB_TENSORS = ("d2t", "t2d")

# safetensors header dtype strings -> torch dtypes (the ones a drafter can contain)
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2")


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


def finding(code: str, severity: str, message: str, why: str, fix: str) -> Finding:
    return Finding(code, severity, message, why, fix)


# ---------------------------------------------------------------------------------------------
# The layout: expected tensor shapes from a config.json dict
# ---------------------------------------------------------------------------------------------

def _int(cfg: dict[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


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
                        self.findings.append(finding(
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
                self.findings.append(finding(
                    "SHARD_INDEX", WARNING,
                    f"{len(self.files)} safetensors files but no model.safetensors.index.json",
                    "engines load every *.safetensors file; a stray file adds tensors",
                    "keep only the export's own files, or write the index"))
            return
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            self.findings.append(finding(
                "SHARD_INDEX", ERROR, f"{index} is not a valid index ({e})",
                "loaders read the shard list from it", "re-export the directory"))
            return
        for name, fname in weight_map.items():
            if not (self.path / fname).is_file():
                self.findings.append(finding(
                    "SHARD_INDEX", ERROR,
                    f"{index.name} maps {name!r} to {fname}, which does not exist",
                    "the loader fails to open the shard", "re-export the directory"))
            elif self._where.get(name, self.path / fname).name != fname:
                self.findings.append(finding(
                    "SHARD_INDEX", ERROR,
                    f"{index.name} maps {name!r} to {fname} but it is in "
                    f"{self._where[name].name}", "the index and the shards disagree",
                    "re-export the directory"))
        missing = sorted(set(self._where) - set(weight_map))
        if missing:
            self.findings.append(finding(
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


def is_speculators_config(cfg: dict[str, Any]) -> bool:
    """A speculators-format config.json (vLLM only), not layout A."""
    return "speculators_model_type" in cfg or "transformer_layer_config" in cfg


def speculators_findings(cfg: dict[str, Any]) -> tuple[list[Finding], dict[str, Any]]:
    """(findings specific to a speculators config, the equivalent layout-A dict to check on).

    The layer fields come from `transformer_layer_config`; the aux ids are vLLM's (both
    spellings are derived so that only real problems of the ids are reported).
    """
    out = [finding("SPECULATORS_FORMAT", WARNING,
                   "config.json is in the speculators format (speculators_model_type "
                   f"{cfg.get('speculators_model_type')!r})",
                   "vLLM loads it; SGLang cannot parse it at all",
                   "serve SGLang from the layout-A export (eyas export writes both)")]
    if cfg.get("norm_before_residual") is not False:
        out.append(finding(
            "NORM_BEFORE_RESIDUAL", ERROR,
            f"norm_before_residual = {cfg.get('norm_before_residual', 'absent')!r} in a "
            f"speculators config", "vLLM's speculators path defaults it to true: an absent "
            "flag serves the normed-residual variant; loads fine, acceptance collapses",
            'write "norm_before_residual": false (the function eyas trains)'))
    layer = cfg.get("transformer_layer_config")
    flat = dict(layer) if isinstance(layer, dict) else {}
    vl = cfg.get("eagle_aux_hidden_state_layer_ids")
    flat.update(architectures=["LlamaForCausalLMEagle3"], norm_before_residual=False,
                draft_vocab_size=cfg.get("draft_vocab_size"),
                target_hidden_size=cfg.get("target_hidden_size") or flat.get("hidden_size"),
                torch_dtype=cfg.get("torch_dtype", flat.get("torch_dtype")))
    if vl is not None:
        flat["eagle_aux_hidden_state_layer_ids"] = vl
        if isinstance(vl, list) and all(isinstance(i, int) for i in vl):
            flat["eagle_config"] = {"use_aux_hidden_state": True,
                                    "eagle_aux_hidden_state_layer_ids": [i - 1 for i in vl]}
    return out, flat


def resolve_target_config(target_config: dict[str, Any] | str | Path | None) -> dict | None:
    """A target config.json dict (its text part) from a dict, a preset name, a file or a dir."""
    if target_config is None:
        return None
    from eyas.models.targets import load_target_config, text_config
    cfg = target_config if isinstance(target_config, dict) else load_target_config(target_config)
    return text_config(cfg)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

def validate(path: str | Path, target_config: dict[str, Any] | str | Path | None, *,
             check_values: bool = True, numeric: bool = False,
             target_weights: str | Path | None = None, numeric_tol: float = 1e-3,
             trainer_state_dict: dict[str, torch.Tensor] | None = None) -> list[Finding]:
    """All contract findings for the drafter directory `path` served with `target_config`.

    `target_config`: the target's config.json (dict, file, directory or preset name; Kimi's
    `text_config` is used when present). None skips the rules that need the target.
    `check_values`: scan every tensor for NaN/inf (chunked; set False for a header-only check).
    `numeric`: also check that the engines' math on the exported tensors reproduces the
    training forward (validate_numeric.py), on `target_weights`' embedding (a directory of the
    target's safetensors) or a seeded random one; `trainer_state_dict` (the checkpoint's
    tensors) makes the training side independent of the export.
    """
    from eyas.models.validate_static import check_config, check_tensors
    path = Path(path)
    if not path.is_dir():
        return [finding("CONFIG_MISSING", ERROR, f"{path} is not a directory",
                        "engines take a directory holding config.json and model.safetensors",
                        "pass the export directory")]
    try:
        cfg = read_config(path)
    except (FileNotFoundError, ValueError) as e:
        return [finding("CONFIG_MISSING", ERROR, str(e),
                        "both engines read the drafter's shape from config.json",
                        "re-export with `eyas export`")]
    tcfg = resolve_target_config(target_config)
    findings: list[Finding] = []
    speculators = is_speculators_config(cfg)
    if speculators:  # a vLLM-only export: check what it stands for, with layout-A rules
        findings, cfg = speculators_findings(cfg)
    findings += check_config(cfg, tcfg)
    tdir = TensorDir(path)
    findings += tdir.findings
    tensor_findings = check_tensors(tdir, cfg, tcfg, check_values=check_values)
    if speculators:  # vLLM reads `layers.0.` natively; SGLang does not read this format at all
        tensor_findings = [f for f in tensor_findings if f.code != "NAME_LAYERS0"]
    findings += tensor_findings
    if numeric:
        if any(f.severity == ERROR for f in findings):
            log.warning("skipping the numerical check: fix the static errors first")
        else:
            from eyas.models.validate_numeric import check_numeric
            findings += check_numeric(path, tcfg, target_weights=target_weights, tol=numeric_tol,
                                      trainer_state_dict=trainer_state_dict)
    return findings


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "clean: no findings"
    n_err = sum(f.severity == ERROR for f in findings)
    lines = [str(f) for f in findings]
    lines.append(f"{n_err} error(s), {len(findings) - n_err} warning(s)")
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    """`eyas validate DIR --target-config FILE [--target-weights DIR] [--numeric]`."""
    p = argparse.ArgumentParser(
        prog="eyas validate",
        description="Check an exported EAGLE-3 drafter directory against what vLLM and SGLang "
                    "load (serving-contract.md). Exit 0 = clean, 1 = findings.")
    p.add_argument("dir", help="the exported drafter directory (config.json + model.safetensors)")
    p.add_argument("--target-config", required=True,
                   help="the target's config.json, its directory, or an eyas preset name")
    p.add_argument("--target-weights", default=None,
                   help="target directory whose embedding the numerical check uses "
                        "(default: a seeded random embedding of the right shape)")
    p.add_argument("--numeric", action="store_true",
                   help="also check that the exported tensors reproduce the trainer's logits "
                        "when loaded the way the engines load them")
    p.add_argument("--no-values", action="store_true",
                   help="skip the NaN/inf scan of the weights (headers and vocab map only)")
    p.add_argument("--json", action="store_true", help="print findings as JSON")
    p.add_argument("--engines", default=None,
                   help="also load DIR with these engines' own loaders on CPU, in their own "
                        "venvs, e.g. vllm,sglang (see `eyas engines --help`)")
    args = p.parse_args(argv)
    findings = validate(args.dir, args.target_config, check_values=not args.no_values,
                        numeric=args.numeric, target_weights=args.target_weights)
    if args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        print(format_findings(findings))
    if args.engines:
        from eyas.models.engines import engines_cli_main
        engines = engines_cli_main([args.dir, "--target-config", args.target_config,
                                    "--engines", args.engines])
        return max(1 if findings else 0, engines)
    return 1 if findings else 0


if __name__ == "__main__":
    from eyas.data.log import run_main
    run_main(cli_main)
