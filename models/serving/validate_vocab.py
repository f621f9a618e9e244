"""The vocabulary-mapping rules of the serving contract (models/serving/CONTRACT.md §3): d2t
and t2d.

`check_vocab_map` reads the dtypes from the safetensors headers and loads the two (small)
mapping tensors; `validate_static.check_tensors` runs it after the name, shape and dtype rules.
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.models.serving.contract import (ERROR, WARNING, Finding, Findings, TensorDir,
                                          config_dims)

#: every code `check_vocab_map` can emit -> the severity it is emitted with
VOCAB_CODES = {
    "D2T_MISSING": ERROR, "D2T_DTYPE": ERROR, "D2T_ABSOLUTE": ERROR, "D2T_RANGE": ERROR,
    "D2T_ORDER": ERROR, "D2T_IDENTITY": WARNING, "T2D_MISMATCH": ERROR, "T2D_DTYPE": WARNING,
}


def _load_d2t(out: Findings, tdir: TensorDir, name: str) -> torch.Tensor | None:
    """d2t as a 1-D int64 tensor after its dtype rule; None when it cannot be checked further."""
    if tdir.dtype(name) != "I64":
        out.add("D2T_DTYPE", f"d2t is {tdir.dtype(name)}; expected I64 (int64)",
                "engines copy it into an int64 buffer; another dtype means the mapping was written "
                "by another tool and may carry absolute ids or overflow",
                "write d2t as int64 offsets")
        if tdir.dtype(name) not in ("I32", "I16", "U8", "I8"):
            return None
    d2t = tdir.load(name).long()
    if d2t.dim() != 1:
        return None  # SHAPE already reported
    return d2t


def _t2d_selection(out: Findings, tdir: TensorDir, name: str | None
                   ) -> torch.Tensor | None:
    """The target ids t2d selects (None without a 1-D t2d), after its dtype rule."""
    t2d = tdir.load(name) if name is not None else None
    if t2d is not None and tdir.dtype(name) != "BOOL":
        out.add("T2D_DTYPE", f"t2d is {tdir.dtype(name)}; expected BOOL",
                "neither engine reads t2d, but eyas tools and importers do",
                "write t2d as a bool mask over the target vocabulary")
    return t2d.bool().nonzero().flatten() if t2d is not None and t2d.dim() == 1 else None


def _check_absolute(out: Findings, d2t: torch.Tensor, sel: torch.Tensor | None,
                    V: int | None, as_offsets_ok: bool) -> bool:
    """D2T_ABSOLUTE: d2t holds target ids instead of offsets; True when it does."""
    strictly_up = d2t.numel() > 1 and bool((d2t[1:] > d2t[:-1]).all())
    in_range = V is not None and d2t.numel() > 0 and int(d2t.min()) >= 0 and int(d2t.max()) < V
    as_absolute = sel is not None and sel.numel() == d2t.numel() and torch.equal(sel, d2t)
    if as_absolute or (strictly_up and in_range and not as_offsets_ok):
        out.add("D2T_ABSOLUTE", "d2t holds absolute target ids, not offsets"
                + (" (it equals t2d's selected ids)" if as_absolute else
                   " (its values strictly increase, which offsets of a frequency-chosen vocabulary "
                   "almost never do)"),
                "engines compute target_id = i + d2t[i]: every draft token is mapped to a wrong "
                "id; loads fine, acceptance collapses silently",
                "store d2t[i] = id_i - i (eyas export does this from the vocab map)")
        return True
    return False


def _check_targets(out: Findings, d2t: torch.Tensor, targets: torch.Tensor,
                   V: int | None, Vd: int | None) -> None:
    """The target ids i + d2t[i]: within [0, V), strictly increasing, not a placeholder d2t."""
    if V is not None and bool(((targets < 0) | (targets >= V)).any()):
        n = int(((targets < 0) | (targets >= V)).sum())
        out.add("D2T_RANGE", f"{n} entries of i + d2t[i] fall outside [0, {V})",
                "index errors at the first draft (vLLM scatter, SGLang hot_token_id lookup)",
                "rebuild d2t from the training vocab map")
    if bool((targets[1:] <= targets[:-1]).any()):
        out.add("D2T_ORDER", "i + d2t[i] is not strictly increasing",
                "lm_head row i must map to the i-th smallest selected target id; a permuted or "
                "rebuilt mapping loads fine and maps rows to the wrong tokens",
                "keep the mapping the drafter was trained with (sorted ascending)")
    if V is not None and Vd is not None and Vd < V and d2t.numel() and not bool(d2t.any()):
        out.add("D2T_IDENTITY", "d2t is all zero although draft_vocab_size < vocab_size",
                "the draft vocabulary is then the first Vd target ids, which a frequency-chosen "
                "vocabulary never is: usually a placeholder d2t",
                "ship the d2t produced with the training vocab map")


def check_vocab_map(tdir: TensorDir, canon: dict[str, str], cfg: dict[str, Any],
                    V: int | None) -> list[Finding]:
    """d2t (offsets, int64, strictly increasing targets within [0, V)) and t2d = {i + d2t[i]}.

    canon: layout-A name -> name in the file; V: the target vocabulary size (None if unknown).
    """
    out = Findings(VOCAB_CODES)
    Vd = config_dims(cfg)["Vd"]                         # else lm_head's rows, if shipped
    if Vd is None and "lm_head.weight" in canon:
        Vd = tdir.shape(canon["lm_head.weight"])[0]
    d2t_name, t2d_name = canon.get("d2t"), canon.get("t2d")
    if d2t_name is None:
        if Vd is not None and V is not None and Vd < V:
            out.add("D2T_MISSING",
                    f"draft_vocab_size {Vd} < vocab_size {V} but no d2t is shipped",
                    "both engines then read lm_head row i as target token i: loads fine, "
                    "acceptance collapses silently",
                    "ship d2t (offsets: target_id = i + d2t[i]) from training")
        return out
    d2t = _load_d2t(out, tdir, d2t_name)
    if d2t is None:
        return out
    targets = torch.arange(d2t.numel()) + d2t
    sel = _t2d_selection(out, tdir, t2d_name)
    as_offsets_ok = (sel is not None and sel.numel() == targets.numel()  # same set of ids
                     and torch.equal(sel, targets.sort().values))
    if _check_absolute(out, d2t, sel, V, as_offsets_ok):
        return out
    _check_targets(out, d2t, targets, V, Vd)
    if sel is not None and not as_offsets_ok:
        out.add("T2D_MISMATCH", f"t2d selects {sel.numel()} ids that differ from "
                f"{{i + d2t[i]}} ({targets.numel()} ids)",
                "the two halves of the mapping disagree: one of them was rebuilt or edited; "
                "engines use d2t only, so a rebuilt d2t maps rows to wrong tokens",
                "re-export both from the training vocab map")
    return out
