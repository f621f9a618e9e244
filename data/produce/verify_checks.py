"""The comparisons behind `eyas verify`: one stored field of one sample against a fresh capture.

Every check returns a row ``{"field", "ok", "tokens", "tokens_over", "first_token",
"max_abs_err", "cosine_min", "bound"}`` (values that do not apply are None). The bounds are the
storage modes' own (data/store/FORMAT.md, "Verification against the target"); `c` (the compute
tolerance) adds room for the target's own rounding when it runs differently than it did at
extraction. Per element, with f the fresh value in float32 and m the RMS of f's row:

- bf16 ``aux`` / ``last``: ``|s - f| <= 2^-8 |f| + c m``. bf16 keeps 8 significant bits, so
  rounding to nearest moves a value by at most half an ulp, 2^-8 |f|.
- fp8 ``aux``: ``|s - f| <= (2^-4 + 2^-7) |f| + 2^-9 scale + c m`` with scale = max|f_row| / 448:
  e4m3 keeps 4 significant bits (2^-4 |f|), its subnormal step is 2^-9 of the scale, and the read
  rounds q * scale to bf16 once more (2^-8, taken as 2^-7 to cover the product of the two).
- logits (``topk_logits``, the gaps behind ``topk_ids`` and ``target_argmax``):
  ``|s - f| <= (2^-7 + c) |z|``, z = the fresh top-1 logit: two bf16-rounded logits.
"""

from __future__ import annotations

import torch

#: relative storage error of a state, per aux format (the `last` state is always bf16)
STATE_REL = {"bf16": 2.0**-8, "fp8": 2.0**-4 + 2.0**-7}
FP8_SUBNORMAL = 2.0**-9 / 448.0      # times max|row|: e4m3's subnormal step on the row's scale
LOGIT_REL = 2.0**-7


def _row(field: str, *, ok: bool, tokens: int, over: torch.Tensor | None = None,
         max_abs_err: float | None = None, cosine_min: float | None = None,
         bound: str, detail: str | None = None) -> dict:
    n_over = int(over.sum()) if over is not None else (0 if ok else tokens)
    first = int(over.nonzero()[0, 0]) if over is not None and n_over else None
    return {"field": field, "ok": ok, "tokens": tokens, "tokens_over": n_over,
            "first_token": first, "max_abs_err": max_abs_err, "cosine_min": cosine_min,
            "bound": bound, "detail": detail}


def _shape_row(field: str, stored: torch.Tensor, fresh: torch.Tensor, bound: str) -> dict | None:
    if stored.shape == fresh.shape:
        return None
    return _row(field, ok=False, tokens=int(stored.shape[0]), bound=bound,
                detail=f"stored shape {list(stored.shape)}, the target's capture "
                       f"{list(fresh.shape)}")


def ids_check(field: str, stored: torch.Tensor, expected: torch.Tensor) -> dict:
    """Stored ids (or loss mask) equal to the token dataset's, token by token."""
    bad = _shape_row(field, stored, expected, "equal")
    if bad is not None:
        bad["detail"] = (f"stored {stored.shape[0]} tokens, the token dataset's sample "
                         f"{expected.shape[0]}")
        return bad
    over = stored.ne(expected)
    return _row(field, ok=not bool(over.any()), tokens=int(stored.shape[0]), over=over,
                bound="equal")


def state_check(field: str, stored: torch.Tensor, fresh: torch.Tensor, fmt: str,
                c: float) -> dict:
    """A hidden state field ([T, tH] or [T, 3, tH]) within its storage bound of the fresh one."""
    bound = (f"{'fp8 (2^-4+2^-7)|f| + 2^-9 scale' if fmt == 'fp8' else 'bf16 2^-8|f|'}"
             f" + {c:g} rms")
    bad = _shape_row(field, stored, fresh, bound)
    if bad is not None:
        return bad
    s, f = stored.float(), fresh.float()
    err = (s - f).abs()
    lim = STATE_REL[fmt] * f.abs() + c * f.pow(2).mean(-1, keepdim=True).sqrt()
    if fmt == "fp8":
        lim = lim + FP8_SUBNORMAL * f.abs().amax(-1, keepdim=True)
    T = int(s.shape[0])
    over = (err > lim).reshape(T, -1).any(-1)
    cos = torch.nn.functional.cosine_similarity(s, f, dim=-1)
    return _row(field, ok=not bool(over.any()), tokens=T, over=over,
                max_abs_err=float(err.max()), cosine_min=float(cos.min()), bound=bound)


def _fresh_logit_of(ids: torch.Tensor, fresh_ids: torch.Tensor, fresh_vals: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(found [T, k], fresh logit [T, k]) of each id of ids [T, k] among the fresh top-K."""
    match = ids[:, :, None] == fresh_ids[:, None, :]                       # [T, k, K]
    found = match.any(-1)
    vals = torch.where(match, fresh_vals[:, None, :], torch.zeros(())).sum(-1)
    return found, vals


def topk_checks(stored_ids: torch.Tensor, stored_vals: torch.Tensor, fresh_ids: torch.Tensor,
                fresh_vals: torch.Tensor, c: float) -> list[dict]:
    """`topk_logits`: the stored values against the fresh k largest; `topk_ids`: each stored id's
    fresh logit equals its stored logit, or (absent from the fresh top-K, K > k) it sits at most
    a bound above the fresh K-th logit: a near tie at the edge."""
    bound = f"(2^-7 + {c:g})|z1|"
    rows = []
    k = int(stored_vals.shape[-1]) if stored_vals.dim() == 2 else 0
    for field, st in (("topk_logits", stored_vals), ("topk_ids", stored_ids)):
        bad = _shape_row(field, st, fresh_vals[:, :k], bound)
        if bad is not None:
            rows.append(bad)
    if rows:
        return rows
    T = int(stored_vals.shape[0])
    tol = (LOGIT_REL + c) * fresh_vals[:, :1].abs()                          # [T, 1]
    s = stored_vals.float()
    err = (s - fresh_vals[:, :k]).abs()
    over = (err > tol).any(-1)
    cos = torch.nn.functional.cosine_similarity(s, fresh_vals[:, :k], dim=-1)
    rows.append(_row("topk_logits", ok=not bool(over.any()), tokens=T, over=over,
                     max_abs_err=float(err.max()), cosine_min=float(cos.min()), bound=bound))
    found, fv = _fresh_logit_of(stored_ids, fresh_ids, fresh_vals)
    ok = torch.where(found, (s - fv).abs() <= tol, s <= fresh_vals[:, -1:] + tol)
    over = ~ok.all(-1)
    rows.append(_row("topk_ids", ok=not bool(over.any()), tokens=T, over=over, bound=bound,
                     detail=f"{int((~found).sum())} stored ids outside the fresh top-"
                            f"{fresh_ids.shape[-1]}" if bool((~found).any()) else None))
    return rows


def argmax_check(stored: torch.Tensor, fresh_ids: torch.Tensor, fresh_vals: torch.Tensor,
                 c: float) -> dict:
    """The stored argmax is the fresh one, or a near tie of it (fresh logit gap within the
    bound)."""
    bound = f"equal or gap <= (2^-7 + {c:g})|z1|"
    bad = _shape_row("target_argmax", stored, fresh_ids[:, 0], bound)
    if bad is not None:
        return bad
    found, fv = _fresh_logit_of(stored[:, None], fresh_ids, fresh_vals)
    gap = fresh_vals[:, 0] - fv[:, 0]
    near = found[:, 0] & (gap <= (LOGIT_REL + c) * fresh_vals[:, 0].abs())
    over = stored.ne(fresh_ids[:, 0]) & ~near
    return _row("target_argmax", ok=not bool(over.any()), tokens=int(stored.shape[0]),
                over=over, bound=bound)
