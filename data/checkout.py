"""Keep a source checkout of eyas after the installed packages on `sys.path`.

eyas's top-level folders (data/, models/, kernels/, train/, conf/) are imported as `eyas.*`
(pyproject.toml maps them). The checkout root itself on `sys.path`, which `python -m ...` and
`python -m pytest` put first when run from it, only makes the same folders importable under
their bare names, and there `kernels/` stands in for Hugging Face's `kernels` package, which
transformers imports (a dependency from transformers 5.25 on) when it loads a model.
`keep_checkout_last` moves the root to the end of `sys.path`: `kernels` is then the installed
package, and the checkout's own `tests` and `benchmarks` stay importable. eyas.data calls it
when it is imported, and eyas.models and eyas.train import eyas.data first.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: the checkout root, when eyas runs from one (an installed wheel has no pyproject.toml there)
ROOT = Path(__file__).resolve().parents[1]


def keep_checkout_last() -> None:
    """Move every `sys.path` entry that is this checkout's root (e.g. "" for the working
    directory) to one entry at the end; nothing when eyas is not a checkout or it is last."""
    if not (ROOT / "pyproject.toml").is_file():
        return
    ours = [p for p in sys.path if _is_root(p)]
    if not ours or (len(ours) == 1 and _is_root(sys.path[-1])):
        return
    sys.path[:] = [p for p in sys.path if not _is_root(p)] + [str(ROOT)]


def _is_root(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == ROOT
    except OSError:            # an entry that cannot be resolved is not this checkout
        return False
