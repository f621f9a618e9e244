"""Integrity rules of `eyas validate`: the export's files are the ones written, its weights are
plausible for their role.

`checksum_findings(dir)`: every file named in the export's `SHA256SUMS` (written by `eyas
export`, data.common.checksums) is present with the same SHA-256; a safetensors or JSON file the list
does not name is reported too (engines load every *.safetensors). An export without SHA256SUMS
(older eyas, other tools) gets no finding here.

`magnitude_findings(tdir, canon)`: the largest |w| and the RMS of each float tensor against a
bound for its role. The numeric check compares the export with itself, so values that corrupted
bytes turned into 1e4 or 1e38 pass it; these bounds catch them. d2t/t2d (integers) are checked
exactly by validate_vocab.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from eyas.data.common.checksums import CHECKSUMS_NAME, ChecksumError, unlisted, verify_checksums
from eyas.models.serving.contract import ERROR, WARNING, Finding, TensorDir

INTEGRITY_CODES = {"CHECKSUM_MISMATCH": ERROR, "CHECKSUM_MISSING_FILE": ERROR,
                   "CHECKSUM_UNLISTED": WARNING, "WEIGHTS_UNREADABLE": ERROR,
                   "MAGNITUDE": ERROR}

# Bounds per role: (max |w|, max RMS). A drafter is trained in bf16 from small inits:
# projections (fc, q/k/v/o, gate/up/down) from N(0, 0.02); lm_head from the target's head rows
# (|w| < 1 in the Llama-3, Qwen3 and DeepSeek heads). AdamW moves a value by about lr (<= 1e-3)
# per step and weight decay pulls it back, so trained drafters and the targets they copy from
# keep |w| below ~2 and RMS below ~0.1; 32 and 1 leave a margin of 10x and more. Norm gains
# start at 1 and stay O(1) (the largest gains of released targets are a few tens): 256 / 64.
# A flipped exponent bit in bf16 multiplies a value by 2^(2^k); 256 corrupted bytes of an
# lm_head turned ~0.1 into 27136, far outside every bound.
ROLE_BOUNDS = {
    "projection": (32.0, 1.0),
    "lm_head": (32.0, 1.0),
    "norm": (256.0, 64.0),
}
_FIX = "re-export from the checkpoint (or restore the file from a good copy)"


def role(name: str) -> str | None:
    """The role of a layout-A tensor name (None: not a float weight with a bound)."""
    if name == "lm_head.weight":
        return "lm_head"
    if re.search(r"norm(\.\d+)?\.weight$", name):          # fc_norm.{0,1,2}.weight too
        return "norm"
    if re.fullmatch(r"fc\.weight|midlayer\.(self_attn|mlp)\.\w+_proj\.weight", name):
        return "projection"
    return None


def checksum_findings(path: str | Path) -> list[Finding]:
    """Findings on the export's files against its SHA256SUMS (none when it has none)."""
    path = Path(path)
    try:
        problems = verify_checksums(path)
    except ChecksumError as e:
        return [Finding("CHECKSUM_MISMATCH", ERROR, str(e), "the files cannot be checked",
                        _FIX)]
    if problems is None:
        return []
    out = []
    for p in problems:
        code = "CHECKSUM_MISSING_FILE" if p.kind == "missing" else "CHECKSUM_MISMATCH"
        out.append(Finding(code, ERROR, str(p),
                           "the engines would load other bytes than were exported: corrupted "
                           "weights load without an error and serve garbage drafts", _FIX))
    extra = [p.name for p in unlisted(path)
             if p.suffix in (".safetensors", ".json") and p.parent == path]
    if extra:
        out.append(Finding("CHECKSUM_UNLISTED", WARNING,
                           f"{extra} are not listed in {path / CHECKSUMS_NAME}",
                           "engines load every *.safetensors file: files added after the export "
                           "change what is served", "remove them, or re-export"))
    return out


def open_tensors(path: str | Path) -> tuple[TensorDir | None, list[Finding]]:
    """The export's TensorDir, or a WEIGHTS_UNREADABLE finding naming the damaged file."""
    try:
        return TensorDir(path), []
    except Exception as e:  # safetensors raises its own error type; the file is named below
        bad = _unreadable_file(Path(path))
        return None, [Finding(
            "WEIGHTS_UNREADABLE", ERROR,
            f"{bad or path}: not a readable safetensors file ({' '.join(str(e).split())[:200]})",
            "both engines fail to load it (a truncated or damaged file)", _FIX)]


def _unreadable_file(path: Path) -> Path | None:
    from safetensors import safe_open
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(f, framework="pt") as st:
                st.keys()
        except Exception:
            return f
    return None


def _scan(tdir: TensorDir, name: str) -> tuple[float, tuple[int, ...], float, int, float]:
    """(max |w|, its position, RMS, count of |w| > bound, bound) of tensor `name`."""
    bound = ROLE_BOUNDS[role(name) or "projection"][0]
    shape = tdir.shape(name)
    best, where, sq, n, over, row = -1.0, 0, 0.0, 0, 0, 0
    for chunk in tdir.chunks(name):
        a = chunk.float().abs().reshape(-1)
        if a.numel():
            i = int(a.argmax())
            if float(a[i]) > best:
                best, where = float(a[i]), row + i
            sq += float((a.double() ** 2).sum())
            n += a.numel()
            over += int((a > bound).sum())
        row += a.numel()
    pos = tuple(int(x) for x in torch.unravel_index(torch.tensor(where), shape)) if shape else ()
    return best, pos, (sq / max(1, n)) ** 0.5, over, bound


def magnitude_findings(tdir: TensorDir, canon: dict[str, str]) -> list[Finding]:
    """MAGNITUDE findings: tensors whose largest |w| or RMS is implausible for their role.

    canon: layout-A name -> name in the file. Non-finite tensors are NONFINITE's, not these."""
    out = []
    for c, name in sorted(canon.items()):
        r = role(c)
        if r is None or not tdir.dtype(name).startswith(("BF16", "F16", "F32", "F64")):
            continue
        top, pos, rms, over, bound = _scan(tdir, name)
        max_rms = ROLE_BOUNDS[r][1]
        if not (top == top and rms == rms) or top == float("inf"):
            continue   # NaN/inf: reported as NONFINITE
        if top > bound or rms > max_rms:
            out.append(Finding(
                "MAGNITUDE", ERROR,
                f"{name}{list(pos)} = {top:.6g} ({over} value(s) with |w| > {bound:g}; RMS "
                f"{rms:.3g}, bound {max_rms:g}): implausible for a trained {r} weight",
                "corrupted bytes (bit rot, a damaged copy) load without an error and serve "
                "wrong drafts; the numeric check cannot see them (it compares the file with "
                "itself)", _FIX))
    return out
