"""What an output directory already holds, and the producers' refusals of the wrong one.

`eyas prepare` writes a token dataset and removes the shards of its own unfinished earlier run;
`eyas extract` writes a hidden-state dataset and resumes its own unfinished run. Neither may
touch another kind of data: prepare refuses a directory holding a hidden-state dataset or an
unfinished extraction, extract refuses a token dataset (complete or not) and its own input.
Each refusal is one line naming the directory, what it holds and the fix, raised before
anything in the directory is changed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eyas.data.store.format import MANIFEST_NAME, SHARD_GLOB, DatasetError

PLAN_NAME = "extract_plan.json"  # data/produce/extract.py's plan (kept here: extract imports this)
TOKEN_FIELDS = {"input_ids", "loss_mask"}


class WrongDirectory(FileExistsError):
    """A producer's output directory holds data it must not overwrite (exit status 2)."""

    exit_status = 2


def _manifest_kind(out: Path) -> str | None:
    try:
        kind = json.loads((out / MANIFEST_NAME).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return "unknown"
    return str(kind)


def _shard_kinds(out: Path) -> tuple[int, set[str]]:
    """(number of shards, the kinds their headers say: 'tokens', 'hidden' or 'unreadable')."""
    from eyas.data.store.shards import read_shard_meta
    shards = sorted(out.glob(SHARD_GLOB))
    kinds = set()
    for p in shards[:1] + shards[-1:]:
        try:
            fields = set(read_shard_meta(p)["fields"])
        except (OSError, DatasetError, KeyError, TypeError):
            kinds.add("unreadable")
            continue
        kinds.add("tokens" if fields <= TOKEN_FIELDS else "hidden")
    return len(shards), kinds


def holds(out: str | os.PathLike) -> str | None:
    """In words, what `out` holds of eyas's data: None (nothing of it), 'a complete tokens
    dataset', 'an unfinished extraction (...)', ..."""
    out = Path(out)
    if not out.is_dir():
        return None
    if (out / MANIFEST_NAME).exists():
        return f"a complete dataset (kind {_manifest_kind(out)}, {MANIFEST_NAME})"
    n, kinds = _shard_kinds(out)
    if (out / PLAN_NAME).exists():
        return f"an unfinished hidden-state extraction ({PLAN_NAME}, {n} shard(s) written)"
    if not n:
        return None
    if kinds == {"tokens"}:
        return f"an unfinished token dataset ({n} shard(s), no {MANIFEST_NAME})"
    if "hidden" in kinds:
        return f"hidden-state shards without a manifest ({n} shard(s))"
    return f"{n} shard file(s) that are not readable eyas shards"


def check_prepare_out(out: str | os.PathLike) -> None:
    """Refuse an `eyas prepare --out` that holds anything but prepare's own unfinished run."""
    found = holds(out)
    if found is None or found.startswith("an unfinished token dataset"):
        return
    raise WrongDirectory(f"--out {out} already holds {found}; eyas prepare would replace it. "
                         f"Fix: choose another --out (a new directory), or remove {out} "
                         f"yourself if that data is no longer needed")


def check_extract_out(out: str | os.PathLike, tokens: str | os.PathLike) -> None:
    """Refuse an `eyas extract --out` that is its input or holds data extract did not write."""
    out, tokens = Path(out), Path(tokens)
    if out.exists() and out.resolve() == tokens.resolve():
        raise WrongDirectory(f"--out {out} is the --tokens dataset itself ({tokens.resolve()}); "
                             f"eyas extract would overwrite its own input. Fix: choose another "
                             f"--out, e.g. {tokens.resolve()}-hidden")
    found = holds(out)
    if found is None or (out / PLAN_NAME).is_file():
        return  # nothing, or extract's own run: resumed (settings checked against the plan)
    raise WrongDirectory(f"--out {out} already holds {found}, not an extraction; eyas extract "
                         f"would overwrite it. Fix: choose another --out for the hidden states")


def check_import_out(out: str | os.PathLike, src: str | os.PathLike) -> None:
    """Refuse an `eyas import --out` that is its source or holds data (the shards of a killed
    import are rewritten)."""
    out, src = Path(out), Path(src)
    if out.exists() and out.resolve() == src.resolve():
        raise WrongDirectory(f"--out {out} is the directory being imported; choose another "
                             f"--out for the eyas dataset")
    found = holds(out)
    if found is None or found.startswith("hidden-state shards without a manifest"):
        return
    raise WrongDirectory(f"--out {out} already holds {found}; eyas import would overwrite it. "
                         f"Fix: choose another --out (a new directory)")
