"""Convert hidden states written by other trainers into an eyas hidden-state dataset.

No target forward pass is re-run: the stored tensors are re-laid out (and the speculators last
state is normalised). Supported sources, as their own code writes them:

SpecForge (`scripts/prepare_hidden_states.py`, offline mode): one `torch.save` dict per sample,
`<out>/rows_<a>-<b>/data_<idx>.ckpt`, with
    input_ids [T] int64, loss_mask [T],
    aux_hidden_state [1, T, 3*tH]   the three aux states concatenated in ascending layer order,
    hidden_state [1, T, tH]         the target's last hidden state after its final norm.
  The renamed in-memory layout of its offline dataset (`hidden_state` = the aux concatenation,
  `target` = the last state) is accepted too. SpecForge captures HF `hidden_states[2, N//2, N-3]`
  by default (it passes SGLang ids k-1); pass `--layers` (HF ids) if the run used others.

speculators (vLLM hidden-state extraction): `<datapath>/hidden_states/hs_<i>.safetensors` with
    token_ids [T], hidden_states [T, 4, tH]   the 3 aux states, then the last layer's output
  BEFORE the target's final norm. The loss mask lives in the preprocessed dataset at
  `<datapath>` (Hugging Face `datasets` format, row i <-> hs_<i>); it is read with `datasets` if
  installed, or replaced by all-ones with `loss_mask="all"` (recorded in the manifest). The last
  state is normalised with the target's final RMSNorm (weight read from the target's
  safetensors) unless `keep_prenorm=True` (then the manifest says teacher.last = "pre_norm").
  The older per-sample `.pt` layout (input_ids, loss_mask, hidden_states = list of [T, tH] with
  the last entry the final layer) is read as well.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.data.store.format import DatasetError
from eyas.data.common.lock import writes_directory
from eyas.data.produce.outdir import check_import_out
from eyas.data.common.options import option, shared
from eyas.data.common.settings import ExtractionSettings, TargetSettings
from eyas.data.store.shards import write_manifest, write_shard
from eyas.data.common.utils import progress

log = logging.getLogger(__name__)

SOURCES = ("specforge", "speculators")


def _torch_load(f: Path) -> Any:
    return torch.load(f, map_location="cpu", weights_only=True)


def _natural_key(p: Path) -> tuple:
    nums = re.findall(r"\d+", p.stem)
    return (int(nums[-1]) if nums else -1, str(p))


def _target_info(target: str | os.PathLike, layers: list[int] | None) -> dict[str, Any]:
    from eyas.data.common.capture import check_aux_layers
    from eyas.data.common.targets import load_target_config, text_config

    cfg = load_target_config(target)
    tc = text_config(cfg)
    n = int(tc["num_hidden_layers"])
    ids = check_aux_layers(layers or None, n)    # the rule extraction and training apply
    return {"config": cfg, "text": tc, "hidden": int(tc["hidden_size"]), "layers": n,
            "vocab": int(tc["vocab_size"]), "aux_ids": ids}


def _check_sample(path: Path, ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor | None,
                  mask: torch.Tensor, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Shape-check one converted sample and return it in eyas field layout."""
    T, tH = ids.shape[0], info["hidden"]
    if aux.shape != (T, 3 * tH):
        raise DatasetError(f"aux states have shape {list(aux.shape)}, expected [{T}, 3*{tH}] "
                           f"(T from input_ids, tH = the target's hidden_size); wrong --target?",
                           path=path)
    if last is not None and last.shape != (T, tH):
        raise DatasetError(f"last hidden state has shape {list(last.shape)}, expected "
                           f"[{T}, {tH}]", path=path)
    if mask.shape != (T,):
        raise DatasetError(f"loss_mask has shape {list(mask.shape)}, expected [{T}]", path=path)
    if ids.numel() and int(ids.max()) >= info["vocab"]:
        raise DatasetError(f"token id {int(ids.max())} >= the target's vocab_size "
                           f"{info['vocab']}; wrong --target?", path=path)
    out = {"input_ids": ids.long(), "loss_mask": mask.bool(),
           "aux": aux.to(torch.bfloat16).reshape(T, 3, tH)}
    if last is not None:
        out["last"] = last.to(torch.bfloat16)
    return out


def _load_dict(f: Path, load: Callable[[Path], Any], what: str) -> dict[str, Any]:
    """`load(f)` as a dict; an unreadable file or another object is a one-line DatasetError."""
    try:
        d = load(f)
    except Exception as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise DatasetError(f"unreadable {what} file ({why}); re-create it, or move it out of the "
                           f"folder to import the others", path=f) from None
    if not isinstance(d, dict):
        raise DatasetError(f"holds a {type(d).__name__}, expected a dict of tensors ({what})",
                           path=f)
    return d


def _need_keys(f: Path, d: dict[str, Any], need: tuple[str, ...], layout: str, *,
               exact: bool = False) -> None:
    """A one-line DatasetError naming the keys found and expected unless `d` has all of `need`
    (`exact`: and no other key)."""
    missing = [k for k in need if k not in d]
    if missing or (exact and len(d) != len(need)):
        lack = f"lack {missing}" if missing else f"are not exactly {list(need)}"
        raise DatasetError(f"keys {sorted(d)} {lack}: expected {layout}; check the source type "
                           f"and folder, or re-create the file with that tool", path=f)


# ---- SpecForge ---------------------------------------------------------------------------

_SPECFORGE_LAYOUT = ("input_ids, loss_mask and aux_hidden_state (+ hidden_state), or input_ids, "
                     "loss_mask, hidden_state and target (SpecForge offline hidden states)")


def _specforge_samples(src: Path, info: dict[str, Any]) -> Iterator[tuple[Path, dict]]:
    files = sorted(src.rglob("*.ckpt"), key=_natural_key)
    if not files:
        raise DatasetError("no *.ckpt files (SpecForge offline hidden states) below this "
                           "directory", path=src)
    for f in progress(files, desc="importing SpecForge", unit="sample"):
        d = _load_dict(f, _torch_load, "torch.save")
        if "aux_hidden_state" in d:             # on-disk layout of prepare_hidden_states.py
            _need_keys(f, d, ("input_ids", "loss_mask"), _SPECFORGE_LAYOUT)
            aux, last = d["aux_hidden_state"], d.get("hidden_state")
        else:                                   # the offline dataset's renamed layout
            _need_keys(f, d, ("input_ids", "loss_mask", "hidden_state", "target"),
                       _SPECFORGE_LAYOUT)
            aux, last = d["hidden_state"], d["target"]
        ids = d["input_ids"].reshape(-1)
        aux = aux.reshape(-1, aux.shape[-1])
        last = None if last is None else last.reshape(-1, last.shape[-1])
        yield f, _check_sample(f, ids, aux, last, d["loss_mask"].reshape(-1), info)


# ---- speculators -------------------------------------------------------------------------

def final_norm_weight(target: str | os.PathLike) -> torch.Tensor:
    """The target's final RMSNorm weight [tH], read from its safetensors (no model is built)."""
    from eyas.data.common.capture import WeightFiles
    from eyas.data.common.targets import resolve_target

    root = resolve_target(target)
    weights = WeightFiles(root) if any(root.glob("*.safetensors")) else None
    for name in ("model.norm.weight", "language_model.model.norm.weight", "norm.weight"):
        if weights is not None and name in weights.where:
            return weights.get(name)
    raise FileNotFoundError(f"no final norm weight (model.norm.weight) in the safetensors of "
                            f"{root}; pass keep_prenorm=True / --keep-prenorm to store the "
                            f"pre-norm state instead")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama/Qwen/DeepSeek RMSNorm as transformers computes it (fp32 math, weight last)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _read_loss_masks(src: Path) -> Callable[[int, torch.Tensor], torch.Tensor]:
    try:
        from datasets import load_from_disk
    except ImportError:
        raise DatasetError("the loss masks of a speculators dataset live in its preprocessed "
                           "`datasets` folder: `pip install datasets`, or pass loss_mask='all' "
                           "(--loss-mask all) to train on every token", path=src) from None
    data = load_from_disk(str(src)).with_format("torch")

    def get(i: int, token_ids: torch.Tensor) -> torch.Tensor:
        row = data[i]
        if not torch.equal(row["input_ids"].reshape(-1), token_ids):
            raise DatasetError(f"hs_{i}: token_ids differ from row {i} of the preprocessed "
                               f"dataset; the folders do not belong together", path=src)
        return row["loss_mask"].reshape(-1)
    return get


def _speculators_samples(src: Path, info: dict[str, Any], loss_mask: str,
                         norm: Callable | None) -> Iterator[tuple[Path, dict]]:
    from safetensors.torch import load_file

    hs_dir = src / "hidden_states" if (src / "hidden_states").is_dir() else src
    files = sorted(hs_dir.glob("hs_*.safetensors"), key=_natural_key)
    pt_files = [] if files else sorted(src.rglob("*.pt"), key=_natural_key)
    if not files and not pt_files:
        raise DatasetError("no hs_*.safetensors (or per-sample .pt) files found", path=src)
    masks = (_read_loss_masks(src) if files and loss_mask == "dataset" else None)
    for f in progress(files or pt_files, desc="importing speculators", unit="sample"):
        if files:
            d = _load_dict(f, lambda p: load_file(str(p)), "safetensors")
            _need_keys(f, d, ("token_ids", "hidden_states"),
                       "token_ids and hidden_states (speculators hs_<i>.safetensors)", exact=True)
            ids, hs = d["token_ids"].reshape(-1), d["hidden_states"]
            if hs.dim() != 3 or hs.shape[1] not in (3, 4):
                raise DatasetError(f"hidden_states has shape {list(hs.shape)}, expected "
                                   f"[T, 4, tH] (3 aux layers + the last layer)", path=f)
            aux = hs[:, :3].reshape(hs.shape[0], -1)                 # [T, 3*tH], ascending
            last = hs[:, 3] if hs.shape[1] == 4 else None             # [T, tH], pre-norm
            mask = (masks(_natural_key(f)[0], ids) if masks is not None
                    else torch.ones_like(ids, dtype=torch.bool))
        else:
            d = _load_dict(f, _torch_load, "torch.save")
            _need_keys(f, d, ("input_ids", "loss_mask", "hidden_states"),
                       "input_ids, loss_mask and hidden_states (speculators per-sample .pt)")
            states = list(d["hidden_states"])
            if len(states) != 4:
                raise DatasetError(f"hidden_states holds {len(states)} tensors, expected 4 "
                                   f"(3 aux layers + the last layer)", path=f)
            ids, mask = d["input_ids"].reshape(-1), d["loss_mask"].reshape(-1)
            aux, last = torch.cat(states[:3], dim=-1), states[3]
        if last is not None and norm is not None:
            last = norm(last)
        yield f, _check_sample(f, ids, aux, last, mask, info)


# ---- driver ------------------------------------------------------------------------------

@writes_directory("out", what="hidden-state dataset")
def import_hidden_states(source: str, src: str | os.PathLike, out: str | os.PathLike, *,
                         target: str | os.PathLike, layers: list[int] | None = None,
                         aux_format: str = ExtractionSettings.aux_format.value,
                         loss_mask: str = "dataset",
                         keep_prenorm: bool = False, shard_bytes: int = 1 << 30
                         ) -> dict[str, Any]:
    """Convert `src` (a SpecForge or speculators output folder) into an eyas dataset at `out`.

    Args:
        source: "specforge" or "speculators".
        target: the target the states came from (preset or directory): gives hidden size,
            layer count, vocabulary and, for speculators, the final norm weight.
        layers: aux layer ids in the HF hidden_states convention (default 2, N//2, N-3).
        loss_mask: speculators only: "dataset" (read the preprocessed dataset) or "all".
        keep_prenorm: speculators only: store the last state as-is (pre final norm).
        shard_bytes: approximate payload per output shard.
    Returns the manifest written.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if loss_mask not in ("dataset", "all"):
        raise ValueError(f"loss_mask must be 'dataset' or 'all', got {loss_mask!r}")
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    check_import_out(out, src)
    info = _target_info(target, layers)
    last_conv = "post_norm"
    if source == "specforge":
        samples = _specforge_samples(src, info)
    else:
        norm = None
        if keep_prenorm:
            last_conv = "pre_norm"
        else:
            w = final_norm_weight(target)
            eps = float(info["text"].get("rms_norm_eps", 1e-6))
            norm = lambda x: rms_norm(x, w.to(x.dtype), eps)  # noqa: E731
        samples = _speculators_samples(src, info, loss_mask, norm)
    metas: list[dict[str, Any]] = []
    pending, size = [], 0           # the shard being filled and its payload bytes
    n, has_last = 0, None
    for path, s in samples:
        if has_last is None:
            has_last = "last" in s
        elif has_last != ("last" in s):
            raise DatasetError("some files carry a last hidden state and others do not", path=path)
        pending.append(s)
        size += sum(t.numel() * t.element_size() for t in s.values())
        n += 1
        if size >= shard_bytes:
            metas.append(write_shard(out, len(metas), pending, aux_format=aux_format))
            pending, size = [], 0
    if pending:
        metas.append(write_shard(out, len(metas), pending, aux_format=aux_format))
    teacher = {"kind": "last" if has_last else None, "last": last_conv if has_last else None,
               "topk": None, "target_argmax": False}
    manifest = {
        "kind": "hidden", "target": str(target), "target_config": info["config"],
        "aux_layer_ids": info["aux_ids"], "convention": "hf_hidden_states",
        "hidden_size": info["hidden"], "num_layers": info["layers"], "vocab_size": info["vocab"],
        "teacher": teacher,
        "import": {"source": source, "path": str(src), "files": n,
                   "loss_mask": "all_ones" if (source == "speculators" and loss_mask == "all")
                   else "source"},
    }
    if source == "speculators" and loss_mask == "all":
        log.warning("speculators import without loss masks: every token is marked trainable")
    return write_manifest(out, manifest, metas)


@dataclass(kw_only=True)
class ImportOptions:
    """Convert hidden states written by SpecForge (offline .ckpt files) or speculators
    (hs_*.safetensors) into an eyas dataset, without running the target again."""

    source: str = option(positional=True, choices=SOURCES)
    src: str = option(help="the tool's output directory", positional=True)
    out: str = option(help="new eyas dataset directory")
    target: str = option(help="the target model (directory, hub id or preset)")
    layers: str | None = shared(TargetSettings, "aux_layer_ids", "target.aux_layer_ids",
                                "SGLang ids + 1.", metavar="A,B,C")
    aux_format: str = shared(ExtractionSettings, "aux_format", "data.aux_format")
    loss_mask: str = option("dataset", "speculators: read masks from the preprocessed dataset, "
                            "or all ones", choices=("dataset", "all"))
    keep_prenorm: bool = option(False, "speculators: keep the pre-norm last state (default: "
                                "apply the target's final norm, as eyas expects)")
    shard_mb: int = option(1024, "payload per shard (MiB)")


def main(args: ImportOptions) -> int:
    """`eyas import {specforge,speculators} SRC --out DIR --target MODEL [--layers a,b,c]`."""
    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    m = import_hidden_states(args.source, args.src, args.out, target=args.target, layers=layers,
                             aux_format=args.aux_format, loss_mask=args.loss_mask,
                             keep_prenorm=args.keep_prenorm, shard_bytes=args.shard_mb << 20)
    print(f"imported {m['n_samples']} samples ({m['n_tokens']} tokens) into {args.out} "
          f"in {m['n_shards']} shard(s)")
    return 0

