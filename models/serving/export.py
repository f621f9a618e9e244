"""Export a trained drafter as a directory that vLLM and SGLang load as is ("layout A").

    eyas export CHECKPOINT OUT_DIR [--target-config FILE] [--speculators-config] [--verifier PATH]
    (the command: models/serving/export_cli.py)

CHECKPOINT may be
  (a) a plain state-dict file (`.safetensors`, `.bin`, `.pt`) of the drafter's named tensors,
      possibly wrapped (`module.`, `_orig_mod.`, `drafter.` … prefixes are stripped);
  (b) a trainer checkpoint directory: accelerate's `model.safetensors`/`pytorch_model.bin` (DDP)
      or a DeepSpeed ZeRO-1/2/3 checkpoint (`pytorch_model/` with `*model_states.pt` and the
      optimizer shards; ZeRO-3 partitions are gathered with DeepSpeed's zero_to_fp32),
      next to `eyas.json`/`eyas_state.json` (drafter config + objective) and the vocab map
      (`vocab.safetensors`, or the state dict's `d2t`/`t2d` buffers);
  (c) an exported drafter directory (layout A, or speculators `layers.0.`: re-export/convert).

The output directory, its files and how it is built (in a hidden sibling, checked by the static
validator, renamed into place: a failed export leaves nothing behind): CONTRACT.md §1.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from eyas.data.common.checksums import write_checksums
from eyas.data.common.lock import dir_lock, sibling_lock_path, writes_directory
from eyas.data.common.utils import atomic_write_dir, remove_leftover_dirs, umask_mode
from eyas.data.store.vocab_map import VocabMap
from eyas.models.serving.card import build_provenance, read_provenance, trained_k, write_card
from eyas.models.serving.contract import (CORE_TENSORS, ERROR, OVERWRITE_HINT, ExportError,
                                          TensorDir, all_finite, expected_shapes, layout_tensors,
                                          format_findings, resolve_target_config)
from eyas.models.serving.export_speculators import verifier_reference, write_speculators_export
from eyas.models.serving.importer import (find_key, load_state_dict_file, read_drafter_dir,
                                          read_trainer_checkpoint)
from eyas.models.serving.validate_static import check_config, check_tensors

log = logging.getLogger(__name__)

EXPORT_META = "eyas_export.json"
#: what an export (layout A, or the speculators format beside it) writes into its directory
EXPORT_WRITES = ("config.json", EXPORT_META, "model.safetensors.index.json", "SHA256SUMS",
                 "model*.safetensors", "README.md", "eyas_provenance.json")
_WRAPPERS = ("module.", "_orig_mod.", "_forward_module.", "_fsdp_wrapped_module.")
#: drafter state-dict entries that are deliberately not exported
NOT_EXPORTED = ("embed_tokens.weight",)  # the target's, frozen: engines bring their own


# ---------------------------------------------------------------------------------------------
# Names and config
# ---------------------------------------------------------------------------------------------

def normalise_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drafter tensors under layout-A names: wrapper prefixes stripped, `layers.0.` -> `midlayer.`.

    A wrapper attribute prefix (`drafter.fc.weight`) is detected from the unique `*fc.weight`
    entry; entries outside it belong to the wrapper and are logged, not exported.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        n, changed = name, True
        while changed:
            changed = False
            for w in _WRAPPERS:
                if n.startswith(w):
                    n, changed = n[len(w):], True
        out[n] = t
    if "fc.weight" not in out:
        prefixes = [n[: -len("fc.weight")] for n in out if n.endswith(".fc.weight")]
        if len(prefixes) == 1:
            p = prefixes[0]
            outside = sorted(n for n in out if not n.startswith(p))
            if outside:
                log.info("not part of the drafter (outside %r), not exported: %s", p, outside)
            out = {n[len(p):]: t for n, t in out.items() if n.startswith(p)}
    return {re.sub(r"^layers\.0\.", "midlayer.", n): t for n, t in out.items()}


def _config_dict(config: Any) -> tuple[dict[str, Any], int | None]:
    """(layout-A config.json dict, TTT steps or None) of an Eagle3Config or a config dict.

    A dict is either a config.json dict (has `architectures`/`model_type`) or the field dict of
    an Eagle3Config (`Eagle3Config.to_dict()`, as a trainer checkpoint's eyas.json stores it).
    """
    if isinstance(config, Mapping) and "aux_layer_ids" in config:
        from eyas.models.config import Eagle3Config
        config = Eagle3Config(**dict(config))
    if hasattr(config, "to_config_dict"):
        return dict(config.to_config_dict()), getattr(config, "ttt_steps", None)
    if isinstance(config, Mapping):
        return json.loads(json.dumps(dict(config))), None  # deep copy, JSON-clean
    raise TypeError(f"config must be an Eagle3Config or a config dict, got {type(config)}")


def complete_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill the fields of models/serving/CONTRACT.md §2 that can be derived without guessing.

    Writes `norm_before_residual: false` when absent, the missing spelling of the aux ids
    (vLLM id = SGLang id + 1), `torch_dtype: bfloat16`, and the legacy `rope_theta` /
    `rope_scaling` next to transformers-5 `rope_parameters`. Refuses what would change the
    function (norm_before_residual true).
    """
    cfg = dict(cfg)
    if cfg.get("norm_before_residual", False) is not False:
        raise ExportError("config has norm_before_residual = true: layout A serves the un-normed "
                          "residual (SGLang does not implement the flag); eyas drafters train "
                          "with it false")
    cfg["norm_before_residual"] = False
    ec = dict(cfg.get("eagle_config") or {})
    vl, sg = cfg.get("eagle_aux_hidden_state_layer_ids"), ec.get("eagle_aux_hidden_state_layer_ids")
    if vl is None and sg is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in sg]
    if sg is None and vl is not None:
        ec["eagle_aux_hidden_state_layer_ids"] = [int(i) - 1 for i in vl]
    if ec:
        ec.setdefault("use_aux_hidden_state", True)
        cfg["eagle_config"] = ec
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        cfg.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
        if rp.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rp.items() if k != "rope_theta"})
    return cfg


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def _save_tensors(tensors: dict[str, torch.Tensor], d: Path, max_shard_bytes: int | None) -> None:
    """model.safetensors, or model-0000x-of-0000y.safetensors + index when above the shard size."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if not max_shard_bytes or total <= max_shard_bytes:
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        umask_mode(d / "model.safetensors")
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, d / fname, metadata={"format": "pt"})
        umask_mode(d / fname)
        weight_map.update({n: fname for n in shard})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _vocab_map(sd: dict[str, torch.Tensor], d2t: torch.Tensor | None,
               t2d: torch.Tensor | None, V: int, Vd: int
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d2t, t2d) to ship: explicit arguments win but must agree with the state dict's buffers
    (popped from `sd`); both None when the draft vocabulary is the target's."""
    given = {"d2t": d2t, "t2d": t2d}
    for name, arg in given.items():
        buf = sd.pop(name, None)
        if buf is not None and arg is not None and not torch.equal(buf.long(), arg.long()):
            raise ExportError(f"the checkpoint's {name} buffer differs from the {name} passed "
                              f"in: keep the mapping the drafter was trained with")
        given[name] = arg if arg is not None else buf
    d2t, t2d = given["d2t"], given["t2d"]
    if Vd >= V:
        if d2t is not None and bool(d2t.any()):
            raise ExportError("draft_vocab_size == vocab_size but d2t is not all zero")
        return None, None  # contract: shipped iff Vd < V
    if d2t is None:
        raise ExportError(f"draft_vocab_size {Vd} < vocab_size {V} but no d2t was given or "
                          f"found in the checkpoint: pass the training vocab map")
    try:
        d2t = d2t.to(torch.int64).contiguous()
        vm = VocabMap(d2t, t2d.bool()) if t2d is not None else VocabMap.from_d2t(d2t, V)
        t2d = vm.validate(target_vocab_size=V, draft_vocab_size=Vd).t2d.contiguous()
    except ValueError as e:
        raise ExportError(f"vocab map: {e}") from None
    return d2t, t2d


def _layout_a_tensors(sd: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The layout-A weights of `sd` in bf16, each its own contiguous storage; refuses unknown,
    missing, mis-shaped or non-finite tensors."""
    shapes = expected_shapes(cfg)
    dropped = [n for n in sd if n in NOT_EXPORTED]
    if dropped:
        log.info("not exported (the engines use the target's): %s", dropped)
    unknown = sorted(n for n in sd if n not in shapes and n not in NOT_EXPORTED)
    if unknown:
        raise ExportError(f"checkpoint tensors outside layout A: {unknown}. Layout A has "
                          f"{list(CORE_TENSORS)}; biases, fused or extra layers cannot be served")
    wanted = layout_tensors(cfg)
    missing = [n for n in wanted if n not in sd]
    if missing:
        raise ExportError(f"checkpoint lacks {missing}: not a complete EAGLE-3 drafter")
    tensors: dict[str, torch.Tensor] = {}
    for n in wanted:
        t = sd[n]
        if shapes[n] is not None and tuple(t.shape) != shapes[n]:
            raise ExportError(f"{n} has shape {list(t.shape)} but the config implies "
                              f"{list(shapes[n])}: config and weights are from different drafters")
        out_t = t.detach().to("cpu", torch.bfloat16).contiguous()
        if out_t.untyped_storage().nbytes() != out_t.numel() * out_t.element_size():
            out_t = out_t.clone()  # a view into a larger storage (a flat buffer): own copy
        if not all_finite(out_t):
            raise ExportError(f"{n} holds NaN/inf values: export a checkpoint from before the "
                              f"loss diverged")
        tensors[n] = out_t
    return tensors


def _write_files(tmp: Path, cfg: dict[str, Any], tcfg: dict | None,
                 tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                 max_shard_bytes: int | None, check: bool,
                 provenance: Mapping[str, Any] | None) -> None:
    """Fill the not-yet-published directory `tmp`: config, weights, metadata, the static check
    (raises on an error finding), the model card and SHA256SUMS."""
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    _save_tensors(tensors, tmp, max_shard_bytes)
    (tmp / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
    findings = None
    if check:
        # values were checked in memory; the files are checked for layout only
        findings = check_config(cfg, tcfg) + check_tensors(TensorDir(tmp), cfg, tcfg,
                                                           check_values=False)
        for f in findings:
            log.warning("export check: %s", f)
        if any(f.severity == ERROR for f in findings):
            raise ExportError("the export breaks the serving contract:\n"
                              + format_findings([f for f in findings if f.severity == ERROR]))
    write_card(tmp, build_provenance(provenance, cfg, meta, findings, where=tmp))
    write_checksums(tmp)   # SHA256SUMS, checked by `eyas validate`


def prepare_out(out: Path, *, overwrite: bool) -> None:
    """Before an export into `out` (its lock held, beside it: the directory is renamed into place):
    remove killed exports' leftovers; refuse a `--overwrite` that would delete what an export did
    not write."""
    remove_leftover_dirs(out)
    if not overwrite or not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} is a file, not an export directory: --overwrite replaces "
                          f"an earlier export only. Fix: choose another OUT_DIR")
    foreign = sorted(p.name for p in out.iterdir()
                     if not (p.is_file() and any(fnmatch.fnmatchcase(p.name, pat)
                                                 for pat in EXPORT_WRITES)))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f", … ({len(foreign)} in all)" if len(foreign) > 5
                                          else "")
        raise ExportError(f"--overwrite would delete {out}, which holds entries an export does "
                          f"not write ({shown}). Fix: move them out of {out}, or export to "
                          f"another OUT_DIR")


@writes_directory("out_dir", what="export", sibling=True)
def export_drafter(state_dict_or_checkpoint: Mapping[str, torch.Tensor] | str | Path,
                   config: Any, d2t: torch.Tensor | None, t2d: torch.Tensor | None,
                   out_dir: str | Path, *, target_config: dict | str | Path | None = None,
                   ttt_steps: int | None = None, training: dict[str, Any] | None = None,
                   speculators: bool = False, verifier: str | None = None,
                   num_speculative_tokens: int | None = None, overwrite: bool = False,
                   max_shard_bytes: int | None = None, check: bool = True,
                   provenance: Mapping[str, Any] | None = None) -> Path:
    """Write the layout-A directory `out_dir` for a drafter and return its path.

    `state_dict_or_checkpoint`: the drafter's tensors (names as in models.drafter, wrappers
    allowed) or a path to a state-dict file. `config`: an Eagle3Config or its config.json dict.
    `d2t` [Vd] int64 offsets / `t2d` [V] bool: the training vocab map (None: taken from the state
    dict's buffers; t2d is rebuilt from d2t when absent). `target_config` enables the target-
    dependent checks. `ttt_steps`/`training` go to eyas_export.json. `speculators=True` also
    writes `<out_dir>-speculators/` (vLLM-only speculators format; needs `verifier`).
    `check=False` skips the static validation of the result (not recommended). `provenance`:
    the run record (train/provenance.py) the model card `README.md` and `eyas_provenance.json`
    are built from (models/serving/card.py); None: a card of what the export itself knows.
    """
    if speculators and not verifier:
        raise ExportError("a speculators-format export names its verifier (the target model path "
                          "or hub id vLLM serves): pass verifier=… (--verifier PATH)")
    verifier = verifier_reference(verifier) if speculators else verifier
    out = Path(out_dir)
    spec = Path(f"{out}-speculators") if speculators else None
    with contextlib.ExitStack() as stack:
        if spec is not None:   # both halves are checked and locked before either is built
            stack.enter_context(dir_lock(spec, what="export", path=sibling_lock_path(spec)))
        for d in (out, spec) if spec is not None else (out,):
            prepare_out(d, overwrite=overwrite)
            if d.exists() and not overwrite:
                raise FileExistsError(f"{d} already exists: {OVERWRITE_HINT}")
        existed = out.exists()
        cfg, tensors, meta, tcfg = _export_parts(state_dict_or_checkpoint, config, d2t, t2d,
                                                 target_config, ttt_steps, training)

        def build(tmp: Path) -> None:
            _write_files(tmp, cfg, tcfg, tensors, meta, max_shard_bytes=max_shard_bytes,
                         check=check, provenance=provenance)

        out = atomic_write_dir(out, build, if_exists="replace" if overwrite else "error",
                               exists_hint=OVERWRITE_HINT,  # and a full disk: DiskFullError
                               need_bytes=sum(t.nbytes for t in tensors.values()))
        log.info("exported drafter to %s", out)
        if spec is not None:
            try:
                write_speculators_export(
                    out, spec, verifier=verifier, target_config=tcfg, overwrite=overwrite,
                    num_speculative_tokens=num_speculative_tokens or meta["ttt_steps"] or 3)
            except BaseException:
                if not existed:          # a failed export leaves no half of the pair behind
                    shutil.rmtree(out, ignore_errors=True)
                raise
    return out


def _export_parts(state_dict_or_checkpoint, config, d2t, t2d, target_config, ttt_steps,
                  training) -> tuple[dict, dict, dict, dict | None]:
    """(layout-A config dict, tensors, eyas_export.json record, target config) of an export."""
    if isinstance(state_dict_or_checkpoint, (str, Path)):
        state_dict = load_state_dict_file(Path(state_dict_or_checkpoint))
    else:
        state_dict = dict(state_dict_or_checkpoint)
    cfg, cfg_ttt = _config_dict(config)
    cfg = complete_config(cfg)
    ttt_steps = ttt_steps if ttt_steps is not None else cfg_ttt
    tcfg = resolve_target_config(target_config)
    # a trainer's state dict may live on an accelerator: everything below works on CPU copies
    sd = {k: v.detach().cpu() if torch.is_tensor(v) else v
          for k, v in normalise_names(state_dict).items()}
    d2t = d2t.detach().cpu() if torch.is_tensor(d2t) else d2t
    t2d = t2d.detach().cpu() if torch.is_tensor(t2d) else t2d
    V, Vd = cfg.get("vocab_size"), cfg.get("draft_vocab_size")
    if not isinstance(V, int) or not isinstance(Vd, int):
        raise ExportError(f"config needs int vocab_size and draft_vocab_size, got {V!r}, {Vd!r}")

    d2t, t2d = _vocab_map(sd, d2t, t2d, V, Vd)
    tensors = _layout_a_tensors(sd, cfg)
    if d2t is not None:
        tensors["d2t"], tensors["t2d"] = d2t.clone(), t2d.clone()

    meta = {"format": "eyas-export", "version": 1, "ttt_steps": ttt_steps,
            "aux_layer_ids": cfg.get("eagle_aux_hidden_state_layer_ids"),
            "draft_vocab_size": Vd, "vocab_size": V,
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "training": training or {}}
    return cfg, tensors, meta, tcfg


# ---------------------------------------------------------------------------------------------
# Checkpoint -> export, and the CLI
# ---------------------------------------------------------------------------------------------

def _provenance(d: Path) -> dict[str, Any] | None:
    """The run record a trainer checkpoint (or an export) carries, for the export's card."""
    try:
        return read_provenance(d)
    except ValueError as e:
        raise ExportError(str(e)) from None


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *,
                      config: Any = None, target_config: dict | str | Path | None = None,
                      **kwargs: Any) -> Path:
    """Export a trainer checkpoint (file or directory) or re-export an exported drafter directory.

    The drafter config comes from the checkpoint's eyas.json (or the exported config.json), or
    from `config` (required for a bare state-dict file). Keyword arguments go to export_drafter.
    """
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir() and (checkpoint / "config.json").is_file():  # (c) exported drafter
        cfg, sd, d2t, t2d, fmt = read_drafter_dir(checkpoint, target_config)
        meta_file = checkpoint / EXPORT_META
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        kwargs.setdefault("provenance", _provenance(checkpoint))
        kwargs.setdefault("ttt_steps", trained_k(meta, kwargs["provenance"], checkpoint))
        kwargs.setdefault("training", dict(meta.get("training") or {}, source_format=fmt))
        return export_drafter(sd, config if config is not None else cfg, d2t, t2d, out_dir,
                              target_config=target_config, **kwargs)
    ck = read_trainer_checkpoint(checkpoint)  # (a) file, (b) DDP / DeepSpeed directory
    cfg = config if config is not None else ck.config
    if cfg is None:
        raise ExportError(f"{checkpoint}: no drafter config (no eyas.json with a 'drafter' "
                          f"entry): pass config=… (the drafter's Eagle3Config or config dict)")
    kwargs.setdefault("ttt_steps", find_key(ck.meta, "ttt_steps"))
    training = {k: v for k, v in ck.meta.items() if k not in ("drafter", "drafter_config",
                                                              "config")}
    kwargs.setdefault("training", dict(training, checkpoint=str(checkpoint), source=ck.source))
    kwargs.setdefault("provenance", None if ck.meta_dir is None else _provenance(ck.meta_dir))
    return export_drafter(ck.state_dict, cfg, ck.d2t, ck.t2d, out_dir,
                          target_config=target_config, **kwargs)
