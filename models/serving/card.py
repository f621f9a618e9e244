"""The model card (`README.md`) and `eyas_provenance.json` of every export.

    prov = build_provenance(run, cfg, meta, findings)   # the JSON record (below)
    write_card(export_dir, prov)                        # README.md + eyas_provenance.json
    record_checks(export_dir, engines=…, speculative=…) # later results, re-rendered + re-hashed

`run` is what the trainer knows of the run (train/provenance.py writes it into every checkpoint
as `eyas_provenance.json`): the resolved config, the datasets with their manifests' SHA-256
(data/common/provenance.py), the capture contract, the software, the training steps and tokens,
the eval record of the exported step and which checkpoint was selected. The export adds what it
knows itself: the drafter's shape from config.json, the static validator's verdict and the
serving commands. What the card holds: docs/export-and-serving.md; its YAML front matter has
`base_model`, tags and an `eyas:` block of the headline facts. Nothing in it depends on where the
directory lives or when it was written: one checkpoint, one card, byte for byte (CONTRACT.md §1).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

from eyas.data.common.checksums import CHECKSUMS_NAME, file_sha256, read_checksums
from eyas.data.common.provenance import software_record
from eyas.data.common.utils import atomic_write_bytes, json_safe
from eyas.models.serving.card_render import render_card
from eyas.models.serving.contract import (PROVENANCE, is_int, is_speculators_config,
                                          resolve_target_config)
from eyas.models.serving.doctor_speedup import chain_acceptance, speedup_table

log = logging.getLogger(__name__)

CARD = "README.md"
#: where the card's serving commands name the export (replace with its path or hub id)
DRAFTER_PLACEHOLDER = "DRAFTER_DIR"


def serve_commands(export_dir: str | Path, target: str, k: int) -> tuple[str, str]:
    """The vLLM and SGLang command lines that serve `target` with this drafter, K draft tokens."""
    spec = json.dumps({"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": k},
                      separators=(",", ":"))
    vllm = f"vllm serve {target} --speculative-config '{spec}'"
    sglang = (f"python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 "
              f"--speculative-draft-model-path {export_dir} --speculative-num-steps {k} "
              f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    return vllm, sglang


def _drafter(cfg: Mapping[str, Any], meta: Mapping[str, Any],
             run: Mapping[str, Any]) -> dict[str, Any]:
    """The drafter's shape from its config.json (and the vocabulary coverage of the run)."""
    ec = cfg.get("eagle_config") or {}
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "target_hidden_size", "max_position_embeddings", "rope_theta",
            "rope_scaling")
    out = {"architecture": (cfg.get("architectures") or [None])[0],
           "aux_layer_ids": cfg.get("eagle_aux_hidden_state_layer_ids"),
           "aux_layer_ids_sglang": ec.get("eagle_aux_hidden_state_layer_ids"),
           "draft_vocab_size": cfg.get("draft_vocab_size"), "vocab_size": cfg.get("vocab_size"),
           "ttt_steps": trained_k(meta, run),
           **{k: cfg[k] for k in keys if cfg.get(k) is not None}}
    out["vocab_coverage"] = (run.get("drafter") or {}).get("vocab_coverage")
    return out


def speculative_tokens(spec: Mapping[str, Any]) -> int | None:
    """K of a speculators config: `speculative_tokens` of its default proposal method (vLLM
    takes the first method's)."""
    methods = (spec.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens") if isinstance(methods[0], Mapping) else None
    return k if is_int(k) else None


def trained_k(meta: Mapping[str, Any] | None, run: Mapping[str, Any] | None,
              export_dir: str | Path | None = None) -> int | None:
    """The TTT depth a drafter was trained with: its eyas_export.json's `ttt_steps` (`meta`),
    else its provenance's `drafter.ttt_steps` (`run`: an export without eyas_export.json, such
    as a speculators directory), else the `speculative_tokens` of the speculators config.json
    in `export_dir`."""
    for k in ((meta or {}).get("ttt_steps"), ((run or {}).get("drafter") or {}).get("ttt_steps")):
        if k is not None:
            return k
    spec = _speculators_config(export_dir) if export_dir is not None else None
    return None if spec is None else speculative_tokens(spec)


def _speculators_config(d: str | Path) -> dict[str, Any] | None:
    """The config.json in directory `d` when it is a speculators-format one, else None."""
    f = Path(d) / "config.json"
    cfg = json.loads(f.read_text()) if f.is_file() else {}
    return cfg if isinstance(cfg, dict) and is_speculators_config(cfg) else None


def _validator(findings: list[Any] | None, where: Path | None) -> dict[str, Any] | None:
    """The static validator's verdict; paths inside the directory it checked are made relative
    (an export is checked in a temporary directory before it is renamed into place)."""
    if findings is None:
        return None

    def rel(msg: str) -> str:
        return msg if where is None else msg.replace(f"{where}/", "").replace(str(where), ".")

    return {"errors": sum(f.severity == "error" for f in findings),
            "warnings": sum(f.severity == "warning" for f in findings),
            "findings": [{"code": f.code, "severity": f.severity, "message": rel(f.message)}
                         for f in findings]}


def build_provenance(run: Mapping[str, Any] | None, cfg: Mapping[str, Any],
                     meta: Mapping[str, Any], findings: list[Any] | None, *,
                     where: str | Path | None = None) -> dict[str, Any]:
    """The export's eyas_provenance.json: the run record (or, without one, the software of this
    process), the drafter's shape, and the export's own checks (`findings` of the static
    validator run on directory `where`; None: not run)."""
    run = dict(run or {})
    software = run.get("software") or software_record()
    training = meta.get("training") or {}
    prov = {"format": "eyas-provenance", "version": 1,
            "target": run.get("target") or {"name": training.get("target")},
            "drafter": _drafter(cfg, meta, run),
            "datasets": run.get("datasets") or [], "capture": run.get("capture"),
            "training": run.get("training"), "eval": run.get("eval"),
            "selected": run.get("selected"), "config": run.get("config"),
            "software": software,
            # checks of another directory (a re-exported one) are not this export's
            "checks": {"validator": _validator(findings, None if where is None
                                               else Path(where))}}
    return json_safe(prov)


def _write(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))   # keeps the user's umask (data/common/utils.py)


def predicted_speedup(prov: Mapping[str, Any]) -> dict[str, Any]:
    """The card's table of predicted speedup by K and concurrency (doctor_speedup.py), from the
    recorded acceptance and the config of the target named in `prov`; without either, the
    reason it is skipped (`skipped`)."""
    dr, name = prov.get("drafter") or {}, (prov.get("target") or {}).get("name")
    acc, k = chain_acceptance(prov.get("eval")), dr.get("ttt_steps")
    if acc is None or not k:
        return {"skipped": "no recorded evaluation with per-position acceptance"}
    try:
        tcfg = resolve_target_config(name) if name else None
    except (OSError, ValueError, KeyError) as e:
        log.info("predicted speedup: no config of target %r (%s)", name, e)
        tcfg = None
    if tcfg is None:
        return {"skipped": f"the config of target {name!r} is not available here"}
    try:
        return speedup_table(tcfg, dr, acc, int(k))
    except KeyError as e:
        return {"skipped": f"the config of target {name!r} or of the drafter lacks {e}"}


def write_card(export_dir: str | Path, prov: Mapping[str, Any]) -> None:
    """README.md and eyas_provenance.json of `prov` into `export_dir` (before its SHA256SUMS).

    A speculators-format directory (its config.json) gets the vLLM-only card: its architecture,
    its verifier and K = its `speculative_tokens`; its eyas_provenance.json is the layout-A
    export's record, unchanged."""
    d = Path(export_dir)
    if not (prov.get("predicted_speedup") or {}).get("rows"):
        # made once: the acceptance, drafter and target it reads do not change after export
        prov = {**prov, "predicted_speedup": json_safe(predicted_speedup(prov))}
    _write(d / PROVENANCE, json.dumps(prov, indent=1, allow_nan=False) + "\n")
    k = (prov.get("drafter") or {}).get("ttt_steps") or 3
    target = (prov.get("target") or {}).get("name") or "TARGET"
    spec = _speculators_config(d)
    if spec is None:
        _write(d / CARD, render_card(prov, serve_commands(DRAFTER_PLACEHOLDER, target, k)))
        return
    k = speculative_tokens(spec) or k
    verifier = ((spec.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    arch = (spec.get("architectures") or ["Eagle3Speculator"])[0]
    _write(d / CARD, render_card(prov, serve_commands(DRAFTER_PLACEHOLDER, verifier or target, k),
                                 speculators=(arch, k)))


def read_provenance(path: str | Path) -> dict[str, Any] | None:
    """The eyas_provenance.json in directory `path` (a checkpoint or an export), or None."""
    f = Path(path) / PROVENANCE
    if not f.is_file():
        return None
    try:
        rec = json.loads(f.read_text())
    except ValueError as e:
        raise ValueError(f"{f}: not valid JSON ({e}); the provenance record is damaged: "
                         f"restore it, or delete it to export without one") from None
    if not isinstance(rec, dict) or rec.get("format") != "eyas-provenance":
        raise ValueError(f"{f}: not an eyas provenance record (format "
                         f"{rec.get('format') if isinstance(rec, dict) else type(rec).__name__!r}"
                         f", expected 'eyas-provenance'): move it out of the directory")
    return rec


def record_checks(export_dir: str | Path, **checks: Any) -> dict[str, Any]:
    """Add results learnt after the export (engine loaders, real decoding) to its provenance
    and card, and re-record the two files' SHA-256 in its SHA256SUMS.

    Only `export_dir` changes. The `<export>-speculators/` directory written beside a layout-A
    export keeps the record of export time: the checks recorded here are of the layout-A
    directory (SGLang cannot load the other). Called on a speculators directory, it re-renders
    that directory's own vLLM-only card."""
    d = Path(export_dir)
    prov = read_provenance(d)
    if prov is None:
        raise ValueError(f"{d} has no {PROVENANCE}: re-export it with this eyas to record checks")
    prov["checks"] = {**(prov.get("checks") or {}), **json_safe(checks)}
    write_card(d, prov)
    listed = read_checksums(d)
    if listed is not None:
        listed.update({n: file_sha256(d / n) for n in (CARD, PROVENANCE)})
        _write(d / CHECKSUMS_NAME, "".join(f"{h}  {n}\n" for n, h in sorted(listed.items())))
    return prov

