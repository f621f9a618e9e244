"""The directory an export is written to: its lock, the leftovers of killed exports, and what
`--overwrite` may replace.

An export is built in a temporary sibling and renamed into place (data/common/utils.py
`atomic_write_dir`), so its lock lives beside it, `<parent>/.<name>.lock` (data/common/lock.py): the
exported directory itself holds only what the engines load. Holding that lock, the exporter
removes the temporary siblings a killed export left (`.tmp-<name>.*`), and refuses to replace
an existing directory that holds files an export does not write: `--overwrite` replaces an
earlier export, never someone's other files.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from eyas.data.common.utils import remove_leftover_dirs
from eyas.models.serving.contract import ExportError

#: what an export (layout A, or the speculators format beside it) writes into its directory
EXPORT_WRITES = ("config.json", "eyas_export.json", "model.safetensors.index.json", "SHA256SUMS",
                 "model*.safetensors", "README.md", "eyas_provenance.json")


def foreign_entries(out: Path) -> list[str]:
    """The entries of the directory `out` that no export writes."""
    return sorted(p.name for p in out.iterdir()
                  if not (p.is_file() and any(fnmatch.fnmatchcase(p.name, pat)
                                              for pat in EXPORT_WRITES)))


def prepare_out(out: Path, *, overwrite: bool) -> None:
    """Before an export into `out` (its lock held): remove killed exports' leftovers; refuse a
    `--overwrite` that would delete what an export did not write."""
    remove_leftover_dirs(out)
    if not overwrite or not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} is a file, not an export directory: --overwrite replaces "
                          f"an earlier export only. Fix: choose another OUT_DIR")
    foreign = foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f", … ({len(foreign)} in all)" if len(foreign) > 5
                                          else "")
        raise ExportError(f"--overwrite would delete {out}, which holds entries an export does "
                          f"not write ({shown}). Fix: move them out of {out}, or export to "
                          f"another OUT_DIR")
