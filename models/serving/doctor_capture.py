"""The doctor's checks of where a dataset's states came from and of what the served check of a
target needs (`eyas doctor`, models/serving/doctor.py)."""

from __future__ import annotations

from typing import Any

from eyas.models.serving.contract import ERROR

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
                   "re-capture with `eyas extract --engine vllm --layers "
                   f"{','.join(map(str, ids))}` (eyas asks the engine for the aux ids and N)")
        return
    report.checked.append(f"states captured by {cap.get('engine')} {cap.get('version')} "
                          f"(extract_hidden_states, ids {got}: aux = hidden_states{ids}, "
                          f"{n} through the target's final norm)")


def check_served(report, target_config: dict[str, Any] | None) -> None:
    """What the served check of this target needs (an MLA target needs a GPU build)."""
    if target_config and target_config.get("kv_lora_rank"):
        report.not_checked.append(MLA_SERVED)
