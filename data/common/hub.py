"""Targets named by a Hugging Face hub id (`org/name`, optionally `org/name@revision`).

Resolution goes through `huggingface_hub.snapshot_download` into the usual HF cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), so a model downloaded
once by any HF tool is found again, and with `HF_HUB_OFFLINE=1` only that cache is read (no
network). What is fetched depends on the need: a config read fetches config and tokenizer files
only, the embedding and head fetch the safetensors shards that hold those two tensors, a model
load fetches everything. Every failure is one line (`HubError`): the id, whether the hub was
offline, and the fix.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

#: what the hub id syntax accepts: `org/name` or `org/name@revision`
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")

#: config and tokenizer files: enough to read shapes and tokenise, no weights
CONFIG_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                "added_tokens.json", "vocab*", "merges.txt", "*.model", "*.tiktoken",
                "chat_template*", "preprocessor_config.json"]
INDEX_FILE = "model.safetensors.index.json"

_TRUE = {"1", "true", "yes", "on"}


class HubError(FileNotFoundError):
    """A hub id that could not be resolved; the message is one line with the fix."""


def parse_hub_id(name: str | Path) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `name` is spelt as a hub id and is no existing path."""
    text = str(name)
    if Path(text).expanduser().exists():
        return None
    m = HUB_ID.match(text)
    return (m["repo"], m["rev"]) if m else None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir() -> Path:
    """The HF hub cache this process uses, read from the environment now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _reason(offline: bool, cause: BaseException | None = None) -> str:
    where = f"the HF cache {hub_cache_dir()}"
    if offline:   # the cause only repeats "not cached"
        return (f"a Hugging Face hub id (hub offline): not in {where} and HF_HUB_OFFLINE=1 "
                f"forbids downloads. Fix: download it once with the hub reachable (unset "
                f"HF_HUB_OFFLINE), point HF_HOME or HF_HUB_CACHE at a cache that holds it, or "
                f"pass a local model directory")
    first = " ".join(str(cause).split())[:200]
    why = "" if cause is None else f" ({type(cause).__name__}: {first})"
    return (f"a Hugging Face hub id (hub online): not in {where} and the hub did not serve it. "
            f"Fix: check the id, log in for a gated model (`hf auth login` or HF_TOKEN), point "
            f"HF_HOME at a cache that holds it, or pass a local model directory{why}")


def _error(name: str, offline: bool, cause: BaseException | None) -> HubError:
    return HubError(f"target {name!r}: {_reason(offline, cause)}")


def snapshot(name: str, patterns: list[str] | None = None) -> Path:
    """The local snapshot directory of hub id `name` holding `patterns` (None: every file)."""
    from huggingface_hub import snapshot_download
    parsed = parse_hub_id(name)
    if parsed is None:
        raise HubError(f"target {name!r}: not a hub id (org/name or org/name@revision)")
    repo, rev = parsed
    offline = hub_offline()
    try:
        path = snapshot_download(repo, revision=rev, cache_dir=str(hub_cache_dir()),
                                 allow_patterns=patterns, local_files_only=offline)
    except Exception as e:   # huggingface_hub's errors are many and multi-line
        raise _error(name, offline, e) from None
    path = Path(path)
    if not (path / "config.json").is_file():
        raise _error(name, offline, FileNotFoundError(f"no config.json in {path}"))
    return path


def _shards(weight_map: dict[str, str], need: str) -> list[str]:
    """The shards `need` reads: all of them for a model, those with the embedding and the
    lm_head for "embedding"."""
    if need == "embedding":
        return sorted({f for k, f in weight_map.items()
                       if k.endswith(("embed_tokens.weight", "lm_head.weight"))})
    return sorted(set(weight_map.values()))


def embedding_snapshot(name: str) -> Path:
    """A snapshot of hub id `name` with config, tokenizer and the safetensors shards holding the
    input embedding and the lm_head (a few GB of a sharded model, not all of it)."""
    path = snapshot(name, CONFIG_FILES + [INDEX_FILE])
    index = path / INDEX_FILE
    if not index.is_file():   # one unsharded file
        return snapshot(name, CONFIG_FILES + ["*.safetensors"])
    shards = _shards(json.loads(index.read_text())["weight_map"], "embedding")
    return snapshot(name, CONFIG_FILES + [INDEX_FILE] + shards)


def _cached_missing(repo: str, rev: str | None, need: str) -> str | None:
    """What of `need` the local cache lacks for `repo` (None: nothing)."""
    from huggingface_hub import try_to_load_from_cache
    cache = str(hub_cache_dir())

    def cached(filename: str) -> str | None:
        got = try_to_load_from_cache(repo, filename, cache_dir=cache, revision=rev)
        return got if isinstance(got, str) else None

    if not cached("config.json"):
        return "config.json"
    if need == "config" or cached("model.safetensors"):
        return None
    index = cached(INDEX_FILE)
    if index is None:
        return "its safetensors weights"
    shards = _shards(json.loads(Path(index).read_text())["weight_map"], need)
    missing = [f for f in shards if not cached(f)]
    return f"{len(missing)} of the {len(shards)} shards {need} reads" if missing else None


def cached_error(name: str, need: str) -> str | None:
    """Why hub id `name` cannot serve `need` ("config", "embedding" or "model") from what is
    reachable now, or None when it can. Offline only the cache is looked at; online a cache
    miss costs one small download (config and tokenizer files), which also proves access."""
    repo, rev = parse_hub_id(name) or (None, None)
    if repo is None:
        return "not a hub id (org/name or org/name@revision)"
    missing = _cached_missing(repo, rev, need)
    if missing is None:
        return None
    if hub_offline():
        return _reason(True).replace("not in the HF cache", f"{missing} not in the HF cache", 1)
    try:
        snapshot(name, CONFIG_FILES)
    except HubError as e:
        return str(e).split(": ", 1)[1]   # drop the "target 'id'" prefix
    return None
