"""Check an exported drafter directory against the serving contract, before any server starts.

`validate(dir, target_config)` returns a list of `Finding`s: each names a rule of
`models/serving/CONTRACT.md` (§1 files, §2 config.json, §3 model.safetensors) that the export
breaks, which engine misbehaves and how, and the fix. An empty list means vLLM and SGLang will both
load the directory and compute the function eyas trained. With ``numeric=True`` it also loads the
exported tensors the way the engines do and checks that they reproduce the trainer's logits
(validate_numeric.py).

Tensors are read lazily (safetensors headers for names/shapes/dtypes; values only for the vocab
mapping and a chunked NaN/inf and magnitude scan), so a 10 GB export validates in seconds. The
files are first checked against the export's SHA256SUMS, and every weight's largest |w| and RMS
against a bound for its role (validate_integrity.py).

    eyas validate DIR --target-config TARGET [--target-weights DIR] [--numeric]
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.data.common.options import option
from eyas.models.serving.loaders.cli import engine_names
from eyas.models.serving.contract import (ERROR, LAYOUT_A_ARCH, WARNING, Finding,
                                          format_findings, is_speculators_config, read_config,
                                          require_dir, resolve_target_config)
from eyas.models.serving.validate_integrity import checksum_findings, open_tensors
from eyas.models.serving.validate_static import check_config, check_tensors

log = logging.getLogger(__name__)


def speculators_findings(cfg: dict[str, Any]) -> tuple[list[Finding], dict[str, Any]]:
    """(findings specific to a speculators config, the equivalent layout-A dict to check on).

    The layer fields come from `transformer_layer_config`; the aux ids are vLLM's (both
    spellings are derived so that only real problems of the ids are reported).
    """
    out = [Finding("SPECULATORS_FORMAT", WARNING,
                   "config.json is in the speculators format (speculators_model_type "
                   f"{cfg.get('speculators_model_type')!r})",
                   "vLLM loads it; SGLang cannot parse it at all",
                   "serve SGLang from the layout-A export (eyas export writes both)")]
    if cfg.get("norm_before_residual") is not False:
        out.append(Finding(
            "NORM_BEFORE_RESIDUAL", ERROR,
            f"norm_before_residual = {cfg.get('norm_before_residual', 'absent')!r} in a "
            f"speculators config", "vLLM's speculators path defaults it to true: an absent "
            "flag serves the normed-residual variant; loads fine, acceptance collapses",
            'write "norm_before_residual": false (the function eyas trains)'))
    layer = cfg.get("transformer_layer_config")
    flat = dict(layer) if isinstance(layer, dict) else {}
    vl = cfg.get("eagle_aux_hidden_state_layer_ids")
    flat.update(architectures=[LAYOUT_A_ARCH], norm_before_residual=False,
                draft_vocab_size=cfg.get("draft_vocab_size"),
                target_hidden_size=cfg.get("target_hidden_size") or flat.get("hidden_size"),
                torch_dtype=cfg.get("torch_dtype", flat.get("torch_dtype")))
    for key in ("norm_before_fc", "fc_norm", "norm_output"):   # EAGLE-3.1: read from the top
        if key in cfg:
            flat[key] = cfg[key]
    if vl is not None:
        flat["eagle_aux_hidden_state_layer_ids"] = vl
        if isinstance(vl, list) and all(isinstance(i, int) for i in vl):
            flat["eagle_config"] = {"use_aux_hidden_state": True,
                                    "eagle_aux_hidden_state_layer_ids": [i - 1 for i in vl]}
    return out, flat


def served_config(path: str | Path) -> dict[str, Any]:
    """The layout-A config.json dict of the drafter directory `path` as the engines read it: a
    speculators-format config flattened (`speculators_findings`), any other as it is."""
    cfg = read_config(Path(path))
    return speculators_findings(cfg)[1] if is_speculators_config(cfg) else cfg


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
    path = Path(path)
    if not path.is_dir():
        return [Finding("CONFIG_MISSING", ERROR, f"{path} is not a directory",
                        "engines take a directory holding config.json and model.safetensors",
                        "pass the export directory")]
    files = checksum_findings(path)   # SHA256SUMS first: damaged files are named as such
    try:
        cfg = read_config(path)
    except (FileNotFoundError, ValueError) as e:
        return files + [Finding("CONFIG_MISSING", ERROR, str(e),
                                "both engines read the drafter's shape from config.json",
                                "re-export with `eyas export`")]
    tcfg = resolve_target_config(target_config)
    findings: list[Finding] = []
    speculators = is_speculators_config(cfg)
    if speculators:  # a vLLM-only export: check what it stands for, with layout-A rules
        findings, cfg = speculators_findings(cfg)
    findings = files + findings + check_config(cfg, tcfg)
    tdir, unreadable = open_tensors(path)
    if tdir is None:
        return findings + unreadable
    findings += tdir.findings
    tensor_findings = check_tensors(tdir, cfg, tcfg, check_values=check_values)
    if speculators:  # vLLM reads `layers.0.` natively; SGLang does not read this format at all
        tensor_findings = [f for f in tensor_findings if f.code != "NAME_LAYERS0"]
    findings += tensor_findings
    if numeric:
        if any(f.severity == ERROR for f in findings):
            log.warning("skipping the numerical check: fix the static errors first")
        else:
            from eyas.models.serving.validate_numeric import check_numeric
            findings += check_numeric(path, tcfg, cfg=cfg, target_weights=target_weights,
                                      tol=numeric_tol, trainer_state_dict=trainer_state_dict)
    return findings


@dataclass(kw_only=True)
class ValidateOptions:
    """Check an exported EAGLE-3 drafter directory against what vLLM and SGLang load
    (models/serving/CONTRACT.md). Exit 0 = clean, 1 = findings, 2 = usage error (e.g. a mistyped
    path)."""

    dir: str = option(help="the exported drafter directory (config.json + model.safetensors)",
                      positional=True)
    target_config: str = option(help="the target's config.json, its directory, hub id "
                                "(org/name[@revision]) or preset name")
    target_weights: str | None = option(
        None, "target directory whose embedding the numerical check uses (default: a seeded "
        "random embedding of the right shape)")
    numeric: bool = option(
        False, "also check that the exported tensors reproduce the trainer's logits when loaded "
        "the way the engines load them")
    no_values: bool = option(
        False, "skip the NaN/inf and magnitude scans of the weights (headers, vocab map and "
        "SHA256SUMS only)")
    json: bool = option(False, "print findings as JSON")
    engines: list[str] | None = option(
        None, "also load DIR with these engines' own loaders on CPU, in their own venvs, e.g. "
        "vllm,sglang (see `eyas engines --help`; default: none)", type=engine_names)


def main(args: ValidateOptions) -> int:
    """`eyas validate DIR --target-config FILE [--target-weights DIR] [--numeric]`."""
    require_dir(args.dir)  # a mistyped path is a usage error (2), not a finding (1)
    findings = validate(args.dir, args.target_config, check_values=not args.no_values,
                        numeric=args.numeric, target_weights=args.target_weights)
    if args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        print(format_findings(findings))
    if args.engines:
        from eyas.models.serving.loaders.cli import EnginesCheckOptions, check
        engines = check(EnginesCheckOptions(dir=args.dir, target_config=args.target_config,
                                            engines=args.engines))
        return max(1 if findings else 0, engines)
    return 1 if findings else 0

