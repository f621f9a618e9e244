"""The vocabulary-mapping rules of the serving contract (serving-contract.md §3): d2t and t2d.

`check_vocab_map` reads the dtypes from the safetensors headers and loads the two (small)
mapping tensors; `validate_static.check_tensors` runs it after the name, shape and dtype rules.
"""

from __future__ import annotations

from typing import Any

import torch

from eyas.models.serving.contract import ERROR, WARNING, Finding, TensorDir, config_dims, finding

#: every code `check_vocab_map` can emit -> the severity it is emitted with
VOCAB_CODES = {
    "D2T_MISSING": ERROR, "D2T_DTYPE": ERROR, "D2T_ABSOLUTE": ERROR, "D2T_RANGE": ERROR,
    "D2T_ORDER": ERROR, "D2T_IDENTITY": WARNING, "T2D_MISMATCH": ERROR, "T2D_DTYPE": WARNING,
}


def check_vocab_map(tdir: TensorDir, canon: dict[str, str], cfg: dict[str, Any],
                    V: int | None) -> list[Finding]:
    """d2t (offsets, int64, strictly increasing targets within [0, V)) and t2d = {i + d2t[i]}.

    canon: layout-A name -> name in the file; V: the target vocabulary size (None if unknown).
    """
    out: list[Finding] = []

    def add(code, msg, why, fix):
        out.append(finding(code, VOCAB_CODES[code], msg, why, fix))

    Vd = config_dims(cfg)["Vd"]
    if Vd is None and "lm_head.weight" in canon:
        Vd = tdir.shape(canon["lm_head.weight"])[0]
    d2t_name, t2d_name = canon.get("d2t"), canon.get("t2d")
    if d2t_name is None:
        if Vd is not None and V is not None and Vd < V:
            add("D2T_MISSING", f"draft_vocab_size {Vd} < vocab_size {V} but no d2t is shipped",
                "both engines then read lm_head row i as target token i: loads fine, acceptance "
                "collapses silently", "ship d2t (offsets: target_id = i + d2t[i]) from training")
        return out
    if tdir.dtype(d2t_name) != "I64":
        add("D2T_DTYPE", f"d2t is {tdir.dtype(d2t_name)}; expected I64 (int64)",
            "engines copy it into an int64 buffer; another dtype means the mapping was written "
            "by another tool and may carry absolute ids or overflow",
            "write d2t as int64 offsets")
        if tdir.dtype(d2t_name) not in ("I32", "I16", "U8", "I8"):
            return out
    d2t = tdir.load(d2t_name).long()
    if d2t.dim() != 1:
        return out  # SHAPE already reported
    idx = torch.arange(d2t.numel())
    targets = idx + d2t
    t2d = tdir.load(t2d_name) if t2d_name is not None else None
    if t2d is not None and tdir.dtype(t2d_name) != "BOOL":
        add("T2D_DTYPE", f"t2d is {tdir.dtype(t2d_name)}; expected BOOL",
            "neither engine reads t2d, but eyas tools and importers do",
            "write t2d as a bool mask over the target vocabulary")
    sel = t2d.bool().nonzero().flatten() if t2d is not None and t2d.dim() == 1 else None
    strictly_up = d2t.numel() > 1 and bool((d2t[1:] > d2t[:-1]).all())
    in_range = V is not None and d2t.numel() > 0 and int(d2t.min()) >= 0 and int(d2t.max()) < V
    as_offsets_ok = (sel is not None and sel.numel() == targets.numel()  # same set of ids
                     and torch.equal(sel, targets.sort().values))
    as_absolute = sel is not None and sel.numel() == d2t.numel() and torch.equal(sel, d2t)
    if as_absolute or (strictly_up and in_range and not as_offsets_ok):
        add("D2T_ABSOLUTE", "d2t holds absolute target ids, not offsets"
            + (" (it equals t2d's selected ids)" if as_absolute else
               " (its values strictly increase, which offsets of a frequency-chosen vocabulary "
               "almost never do)"),
            "engines compute target_id = i + d2t[i]: every draft token is mapped to a wrong id; "
            "loads fine, acceptance collapses silently",
            "store d2t[i] = id_i - i (eyas export does this from the vocab map)")
        return out
    if V is not None and bool(((targets < 0) | (targets >= V)).any()):
        n = int(((targets < 0) | (targets >= V)).sum())
        add("D2T_RANGE", f"{n} entries of i + d2t[i] fall outside [0, {V})",
            "index errors at the first draft (vLLM scatter, SGLang hot_token_id lookup)",
            "rebuild d2t from the training vocab map")
    if bool((targets[1:] <= targets[:-1]).any()):
        add("D2T_ORDER", "i + d2t[i] is not strictly increasing",
            "lm_head row i must map to the i-th smallest selected target id; a permuted or "
            "rebuilt mapping loads fine and maps rows to the wrong tokens",
            "keep the mapping the drafter was trained with (sorted ascending)")
    if V is not None and Vd is not None and Vd < V and d2t.numel() and not bool(d2t.any()):
        add("D2T_IDENTITY", "d2t is all zero although draft_vocab_size < vocab_size",
            "the draft vocabulary is then the first Vd target ids, which a frequency-chosen "
            "vocabulary never is: usually a placeholder d2t",
            "ship the d2t produced with the training vocab map")
    if sel is not None and not as_offsets_ok:
        add("T2D_MISMATCH", f"t2d selects {sel.numel()} ids that differ from "
            f"{{i + d2t[i]}} ({targets.numel()} ids)",
            "the two halves of the mapping disagree: one of them was rebuilt or edited; "
            "engines use d2t only, so a rebuilt d2t maps rows to wrong tokens",
            "re-export both from the training vocab map")
    return out
