"""The optional vLLM-only speculators-format export (`eyas export --speculators-config`).

vLLM also loads EAGLE-3 drafters described by a speculators config (`speculators_model_type:
eagle3`, the Llama layer under `transformer_layer_config`); SGLang does not, so the layout-A
directory stays the primary export and this one is written next to it, sharing its weights.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from eyas.data.common.checksums import write_checksums
from eyas.data.common.utils import atomic_write_dir
from eyas.models.serving.card import read_provenance, write_card
from eyas.models.serving.contract import OVERWRITE_HINT, ExportError, norm_before_fc


log = logging.getLogger(__name__)


_EAGLE_KEYS = ("architectures", "eagle_config", "eagle_aux_hidden_state_layer_ids",
               "draft_vocab_size", "target_hidden_size", "norm_before_residual", "torch_dtype",
               "norm_before_fc", "fc_norm", "norm_output")


def speculators_config(cfg: dict[str, Any], *, verifier: str,
                       verifier_architectures: list[str] | None = None,
                       num_speculative_tokens: int = 3) -> dict[str, Any]:
    """The speculators-format (`speculators_model_type: eagle3`) config of a layout-A config.

    vLLM reads `transformer_layer_config` as the Llama layer config, `draft_vocab_size`,
    `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (as is) and
    `norm_before_residual` (default TRUE there, so it is written false), the EAGLE-3.1 flags
    `norm_before_fc`, `fc_norm` and `norm_output` (written when on), and takes the default
    `num_speculative_tokens` from the first proposal method.
    """
    layer = {k: v for k, v in cfg.items() if k not in _EAGLE_KEYS}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg.get("target_hidden_size", cfg["hidden_size"]),
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
        # the EAGLE-3.1 norms: vLLM copies these top-level keys into the layer config
        **{k: True for k, on in (("norm_before_fc", norm_before_fc(cfg)),
                                 ("fc_norm", bool(cfg.get("fc_norm"))),
                                 ("norm_output", bool(cfg.get("norm_output")))) if on},
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier,
                         "architectures": list(verifier_architectures or [])},
        },
        "torch_dtype": "bfloat16",
    }


def verifier_reference(verifier: str) -> str:
    """How config.json names the verifier. `vllm serve DIR` loads `name_or_path` verbatim, from
    the server's working directory, and (as Hugging Face does) a local path of that name wins
    over a hub id. So a relative or `~` path that exists here is written absolute
    (`os.path.abspath`: symlinked names kept); anything else (a hub id, an absolute path, a path
    of the serving machine) as given."""
    try:
        expanded = os.path.expanduser(verifier)
    except RuntimeError as e:                  # `~user/...` of an unknown user
        raise ExportError(f"--verifier {verifier!r}: {e}") from None
    if os.path.isabs(verifier):
        return verifier
    if not os.path.exists(expanded):
        if expanded == verifier:               # a hub id, or a path of the serving machine
            return verifier
        raise ExportError(f"--verifier {verifier!r}: {expanded} does not exist; pass the "
                          f"target's path on the serving machine as an absolute path, or a hub id")
    absolute = os.path.abspath(expanded)
    log.warning("speculators export: verifier %r is a local path here, written as %s (serving "
                "elsewhere? pass that machine's absolute path or the hub id)", verifier, absolute)
    return absolute


def write_speculators_export(layout_a_dir: Path, out_dir: Path, *, verifier: str | None,
                             target_config: dict | None, num_speculative_tokens: int,
                             overwrite: bool = False) -> Path:
    """`out_dir` = speculators config.json + the layout-A weights (hard-linked when possible),
    the layout-A eyas_provenance.json and a model card of its own (vLLM only, K =
    `num_speculative_tokens`: models/serving/card.py `write_card`), then its SHA256SUMS."""
    if not verifier:
        raise ExportError("a speculators-format export names its verifier (the target model path "
                          "or hub id vLLM serves): pass verifier=… (--verifier PATH)")
    verifier = verifier_reference(verifier)
    cfg = json.loads((Path(layout_a_dir) / "config.json").read_text())
    spec = speculators_config(cfg, verifier=verifier,
                              verifier_architectures=(target_config or {}).get("architectures"),
                              num_speculative_tokens=num_speculative_tokens)

    def build(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(spec, indent=2) + "\n")
        for f in Path(layout_a_dir).iterdir():
            if f.suffix == ".safetensors" or f.name == "model.safetensors.index.json":
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)
        prov = read_provenance(layout_a_dir)    # the run record travels along, as it is
        if prov is not None:                    # README.md: this directory's own card
            write_card(tmp, prov)
        write_checksums(tmp)

    out = atomic_write_dir(out_dir, build, if_exists="replace" if overwrite else "error",
                           exists_hint=OVERWRITE_HINT)
    log.info("wrote the vLLM-only speculators-format export to %s", out)
    return out
