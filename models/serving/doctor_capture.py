"""The doctor's checks of where a dataset's states came from, of the target an export was
trained for, and of what the served check of a target needs (`eyas doctor`,
models/serving/doctor.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eyas.models.serving.contract import ERROR, PROVENANCE, WARNING, read_record

# config.json keys that differ between copies of one model (the writer's version, the dtype)
VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
MLA_SERVED = ("served check: vLLM's CPU build cannot run EAGLE-3 beside an MLA target (its MLA "
              "and the Llama drafter's KV blocks share no block size); on a GPU machine with "
              "vLLM's CUDA build: `eyas engines setup --runtime` then `eyas evaluate --engine "
              "vllm --drafter EXPORT --target TARGET --prompts P --k K --out OUT.json`")


def check_capture(report, manifest: dict[str, Any]) -> None:
    """The manifest's `capture`: who captured the states, and that an engine's layer ids mean
    the dataset's aux ids (vLLM's id k is HF hidden_states[k]) plus the last layer N."""
    cap = manifest.get("capture")
    if not isinstance(cap, dict):   # datasets from before capture sources were recorded
        report.checked.append("states captured by transformers (no capture record: an "
                              "extraction by an older eyas)")
        return
    if cap.get("source") != "vllm":
        report.checked.append(f"states captured by transformers {cap.get('transformers')} "
                              f"({cap.get('dtype')})")
        return
    ids, got = list(manifest.get("aux_layer_ids") or []), list(cap.get("engine_layer_ids") or [])
    n = manifest.get("num_layers")
    if got != [*ids, n]:
        report.add("DATA_CAPTURE_IDS", ERROR,
                   f"the engine captured layer ids {got} but the manifest says the aux states "
                   f"are hidden_states{ids} and the last state layer {n}",
                   "the drafter trains on other layers than the manifest names; served, it "
                   "reads the named ones and drafts near-random tokens",
                   "re-capture with `eyas extract --capture vllm --layers "
                   f"{','.join(map(str, ids))}` (eyas asks the engine for the aux ids and N)")
        return
    report.checked.append(f"states captured by {cap.get('engine')} {cap.get('version')} "
                          f"(extract_hidden_states, ids {got}: aux = hidden_states{ids}, "
                          f"{n} through the target's final norm)")


def check_served(report, target_config: dict[str, Any] | None) -> None:
    """What the served check of this target needs (an MLA target needs a GPU build)."""
    if target_config and target_config.get("kv_lora_rank"):
        report.not_checked.append(MLA_SERVED)


def trained_target(export_dir: str | Path) -> tuple[str | None, str]:
    """(the target the export was trained for, the file that says so): its
    eyas_provenance.json's target, else its eyas_export.json's training record."""
    for name, path in ((PROVENANCE, ("target", "name")), ("eyas_export.json",
                                                          ("training", "target"))):
        rec = read_record(export_dir, name)
        for key in path:
            rec = rec.get(key) if isinstance(rec, dict) else None
        if isinstance(rec, str) and rec:
            return rec, name
    return None, ""


def _target_names(target: str) -> set[str]:
    """The spellings of one target: the name as given, its hub id (a preset's), without an
    @revision, and the resolved path of a local config.json or directory."""
    from eyas.data.common.targets import DEFAULT_CACHE_DIR, HUB_IDS, LOADABLE
    names = {target, target.split("@", 1)[0], HUB_IDS.get(target, target)}
    path = Path(target).expanduser()
    if target in LOADABLE:
        path = DEFAULT_CACHE_DIR / "targets" / target
    if path.is_file():
        path = path.parent
    if path.is_dir():
        names.add(str(path.resolve()))
    return names


def _local_config(target: str) -> dict[str, Any] | None:
    """config.json of `target` when it is at hand without a download: a preset eyas ships or
    has built, or a local file or directory (None otherwise)."""
    from eyas.data.common.targets import DEFAULT_CACHE_DIR, PRESETS
    from eyas.models.serving.contract import resolve_target_config
    local = Path(target).expanduser().exists() or (
        target in PRESETS and (target != "smollm2"
                               or (DEFAULT_CACHE_DIR / "targets" / target).is_dir()))
    try:
        return resolve_target_config(target) if local else None
    except (OSError, ValueError):
        return None


def _shape(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in VOLATILE_CONFIG_KEYS}


def check_trained_target(report, export_dir: str | Path, target_config: Any,
                         tcfg: dict[str, Any] | None) -> None:
    """The target the export was trained for vs the one it is checked against (`tcfg`: that
    one's config.json): the same name, or a local copy with the same config.json."""
    trained, source = trained_target(export_dir)
    if trained is None:
        report.not_checked.append("trained target: the export records none (no "
                                  "eyas_provenance.json or eyas_export.json target)")
        return
    report.stats["trained_target"] = trained
    named = isinstance(target_config, (str, Path))
    given = str(target_config) if named else "the config given"
    if named and _target_names(trained) & _target_names(given):
        report.checked.append(f"trained for target {trained!r} ({source}), the target checked "
                              f"against")
        return
    theirs = _local_config(trained)
    if theirs is not None and tcfg is not None and _shape(theirs) == _shape(tcfg):
        report.checked.append(f"trained for target {trained!r} ({source}); {given} has its "
                              f"config.json (taken for a copy of it)")
    elif theirs is None and (not named or Path(given).expanduser().exists()):
        report.not_checked.append(f"trained for target {trained!r} ({source}); whether {given} "
                                  f"is that model is not known here (no local config of it)")
    else:
        report.add("EXPORT_TARGET", WARNING,
                   f"the export was trained for target {trained!r} ({source}) but is checked "
                   f"against {given!r}" + ("" if theirs is None else
                                           " (another config.json)"),
                   "a drafter learns one target's hidden states: served beside another target "
                   "(even one of the same shape) it drafts tokens that target rarely accepts",
                   f"pass --target-config {trained} (or its local copy), or train a drafter "
                   f"for {given}")
