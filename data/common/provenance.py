"""What a drafter was made from, as plain JSON: the datasets and the software.

    dataset_record(root, role)   # {"role", "path", "manifest_sha256", counts, the data card, ...}
    capture_contract(manifest)   # what the features are: target, fingerprint, aux ids, teacher, ...
    software_record()            # {"eyas": {"version", "commit", "dirty"}, "libraries": {...}}

A hidden-state dataset's manifest carries its whole lineage: the target and its weights'
fingerprint (data.capture.target_fingerprint), the `eyas prepare` summary of the token dataset it
was extracted from (input file and its SHA-256), and, when `eyas generate` wrote the
conversations, that run's data card (endpoint, model, sampling settings, prompts and their
SHA-256). The export's model card and `eyas_provenance.json` are built from these records
(models/serving/card.py).
"""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from eyas.data.common.checksums import file_sha256

MANIFEST = "manifest.json"
#: libraries whose versions change what a drafter computes or how it was trained
LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed", "triton", "safetensors")
#: manifest entries that define the features a drafter reads (serving must capture the same)
CONTRACT_KEYS = ("target", "target_fingerprint", "aux_layer_ids", "convention", "hidden_size",
                 "num_layers", "vocab_size", "target_dtype", "teacher", "aux_format")


def capture_contract(manifest: dict[str, Any]) -> dict[str, Any]:
    """The entries of a hidden-state manifest that say which features were captured, plus the
    stored fields' dtypes and shapes."""
    out = {k: manifest[k] for k in CONTRACT_KEYS if k in manifest}
    fields = manifest.get("fields") or {}
    out["fields"] = {n: {"dtype": f.get("dtype"), "shape": f.get("shape")}
                     for n, f in sorted(fields.items())}
    return out


def _generation(prepare: dict[str, Any]) -> dict[str, Any] | None:
    card = prepare.get("generation_card")
    if not isinstance(card, dict):
        return None
    keys = ("endpoint", "model", "sampling", "prompts", "prompts_sha256", "samples_per_prompt",
            "counts", "finish_reasons", "tokens", "file", "sha256", "matches_input")
    return {k: card[k] for k in keys if k in card}


def dataset_record(root: str | Path, role: str) -> dict[str, Any]:
    """The provenance of the dataset in `root`: its manifest's SHA-256, size, target, and the
    lineage the manifest records (the token dataset it came from, the prepared input file and
    the generation settings of `eyas generate`)."""
    root = Path(root)
    m, digest = json.loads((root / MANIFEST).read_text()), file_sha256(root / MANIFEST)
    prepare = m.get("prepare") if isinstance(m.get("prepare"), dict) else {}
    rec: dict[str, Any] = {
        "role": role, "path": str(root.resolve()), "manifest_sha256": digest,
        "kind": m.get("kind"), "n_samples": m.get("n_samples"), "n_tokens": m.get("n_tokens"),
        "target": m.get("target"), "target_fingerprint": m.get("target_fingerprint"),
        "tokenizer": m.get("tokenizer"),
        "prepare": {k: prepare[k] for k in ("input", "input_sha256", "records", "samples",
                                            "tokens", "loss_tokens", "max_length")
                    if k in prepare} or None,
        "generation": _generation(prepare)}
    tokens = m.get("tokens_dataset")
    if isinstance(tokens, dict) and tokens.get("path"):
        src = Path(tokens["path"])
        rec["tokens_dataset"] = {"path": str(src), "n_samples": tokens.get("n_samples"),
                                 "manifest_sha256": file_sha256(src / MANIFEST)
                                 if (src / MANIFEST).is_file() else None}
    return rec


def _git_commit(where: Path) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked files differ from it) when `where` is the top of a git
    checkout, else (None, None)."""
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(where), *args], capture_output=True,
                               text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != where.resolve():
        return None, None       # not a checkout of eyas (an installed copy inside another repo)
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def software_record() -> dict[str, Any]:
    """eyas's version and git commit (when it runs from a checkout) and the installed versions
    of LIBRARIES (a library that is not installed is left out)."""
    try:
        version = metadata.version("eyas")
    except metadata.PackageNotFoundError:
        version = None
    commit, dirty = _git_commit(Path(__file__).resolve().parents[2])
    libs = {}
    for name in LIBRARIES:
        try:
            libs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {"eyas": {"version": version, "commit": commit, "dirty": dirty}, "libraries": libs}
