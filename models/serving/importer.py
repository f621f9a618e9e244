"""Read drafters and trainer checkpoints into eyas's names (warm start, re-export, conversion).

Sources:
- exported drafter directories: layout A / SGLang-EAGLE (`midlayer.*`, `eagle_config` with the
  SGLang aux ids, e.g. AQ-MedAI's Kimi-K2 drafter; or yuhuili's EAGLE-3 drafters without aux
  ids), and speculators (`layers.0.*` + a `speculators_config` / `transformer_layer_config`
  config.json);
- trainer checkpoints: a state-dict file, accelerate's DDP `model.safetensors` /
  `pytorch_model.bin`, or a DeepSpeed ZeRO-1/2/3 checkpoint directory, with `eyas.json`.

`import_drafter(dir)` returns (Eagle3Config, state_dict, d2t, t2d) and keeps the source's vocab
mapping exactly (t2d is rebuilt from d2t when absent; a missing d2t with a reduced vocabulary is
an error, never guessed): fine-tuning must keep the mapping the lm_head rows were trained for.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eyas.data.common.checksums import verify_checksums
from eyas.data.common.deps import require_deepspeed
from eyas.data.store.vocab_map import VocabMap
from eyas.models.serving.contract import (ExportError, TensorDir, layout_tensors,
                                          norm_before_fc, read_config, resolve_target_config)

log = logging.getLogger(__name__)

#: checkpoint side files that hold the drafter config and training settings (first found wins)
CHECKPOINT_META = ("eyas.json", "eyas_state.json")
#: source tensors that belong to the target or the training harness, never to the drafter
_FOREIGN = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
_VOCAB_FILES = ("vocab_map.safetensors", "vocab.safetensors")


# ---------------------------------------------------------------------------------------------
# State dicts from files and checkpoint directories
# ---------------------------------------------------------------------------------------------

def load_state_dict_file(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a `.safetensors` / `.bin` / `.pt` file ({"module"|"state_dict": …} unwrapped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such state-dict file")
    if path.suffix == ".safetensors":
        return load_file(path)
    obj = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("module", "state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict) and not torch.is_tensor(
                obj.get(key)):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(torch.is_tensor(v) for v in obj.values()):
        raise ValueError(f"{path} does not hold a flat {{name: tensor}} state dict")
    return dict(obj)


def _deepspeed_tag_dir(path: Path) -> Path | None:
    """The DeepSpeed tag directory (holding *model_states.pt) at or directly under `path`."""
    if any(path.glob("*model_states.pt")):
        return path
    if (path / "latest").is_file():
        tag = path / (path / "latest").read_text().strip()
        if any(tag.glob("*model_states.pt")):
            return tag
    subs = sorted(d for d in path.iterdir() if d.is_dir() and any(d.glob("*model_states.pt")))
    if len(subs) > 1:
        names = [d.name for d in subs]
        if "pytorch_model" in names:  # accelerate's tag for the first model
            return path / "pytorch_model"
        raise ValueError(f"{path} holds several DeepSpeed checkpoints {names}: pass one of them")
    return subs[0] if subs else None


def load_deepspeed_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 state dict of a DeepSpeed ZeRO-1/2/3 checkpoint (partitions gathered)."""
    require_deepspeed(f"reading the DeepSpeed ZeRO checkpoint {tag_dir}",
                      "convert it where deepspeed is installed (`eyas export` there, or "
                      "DeepSpeed's zero_to_fp32.py) and pass the state-dict file")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # zero_to_fp32 reports progress with print()
        sd = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    log.debug("zero_to_fp32: %s", buf.getvalue())
    return dict(sd)


def find_key(obj: Any, key: str) -> Any:
    """First value of `key` (or a dotted `section.key`) anywhere in a nested dict."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key or k.endswith("." + key):
                return v
        for v in obj.values():
            found = find_key(v, key)
            if found is not None:
                return found
    return None


@dataclass
class TrainerCheckpoint:
    """What a trainer checkpoint directory holds, before any layout conversion."""

    config: dict[str, Any] | None          # the drafter's config dict from eyas.json
    state_dict: dict[str, torch.Tensor]    # raw names (wrappers not yet stripped)
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None
    meta: dict[str, Any] = field(default_factory=dict)  # the whole eyas.json
    source: str = ""                       # which format was read
    meta_dir: Path | None = None           # the directory holding eyas.json (None: a file)


def read_trainer_checkpoint(path: str | Path) -> TrainerCheckpoint:
    """Read a trainer checkpoint: a state-dict file, or a directory (DDP or DeepSpeed + eyas.json).

    A run's `checkpoints/` directory resolves to the checkpoint its `latest` pointer names.
    Keys read from eyas.json (or eyas_state.json): the drafter config under `drafter` (or
    `drafter_config`, `config`; Eagle3Config.to_dict() or a config.json dict), `ttt_steps`
    (anywhere, also as `drafter.ttt_steps`), `vocab_map` (a d2t/t2d safetensors file relative to
    the checkpoint). Without `vocab_map`: `vocab_map.safetensors` / `vocab.safetensors` next to
    it, else the state dict's own `d2t`/`t2d` buffers.
    """
    path = Path(path)
    if path.is_file():
        return TrainerCheckpoint(None, load_state_dict_file(path), None, None, {}, "file")
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    # <run>/checkpoints/latest names step-NNNNNN (a DeepSpeed `latest` names a tag instead)
    pointer = path / "latest"
    if pointer.is_file() and any((path / pointer.read_text().strip() / n).is_file()
                                 for n in CHECKPOINT_META):
        return read_trainer_checkpoint(path / pointer.read_text().strip())
    problems = verify_checksums(path)   # a checkpoint's SHA256SUMS (eyas >= checksums)
    if problems:
        raise ExportError(f"{path} is damaged: {problems[0]}; export another checkpoint")
    meta_dir = path
    tag = _deepspeed_tag_dir(path)
    if tag is not None:
        sd, source = load_deepspeed_state_dict(tag), f"deepspeed:{tag.name}"
        if tag == path:
            meta_dir = path.parent
    elif (path / "model.safetensors").is_file():
        sd, source = load_file(path / "model.safetensors"), "model.safetensors"
    elif (path / "pytorch_model.bin").is_file():
        sd, source = load_state_dict_file(path / "pytorch_model.bin"), "pytorch_model.bin"
    else:
        raise FileNotFoundError(
            f"{path} holds no drafter weights: expected model.safetensors or pytorch_model.bin "
            f"(accelerate DDP) or a DeepSpeed tag directory with *model_states.pt")
    meta_file = next((meta_dir / n for n in CHECKPOINT_META if (meta_dir / n).is_file()), None)
    meta = json.loads(meta_file.read_text()) if meta_file else {}
    config = next((meta[k] for k in ("drafter", "drafter_config", "config") if k in meta), None)
    d2t = t2d = None
    vocab_file = meta.get("vocab_map")
    candidates = [meta_dir / vocab_file] if vocab_file else [meta_dir / f for f in _VOCAB_FILES]
    for f in candidates:
        if f.is_file():
            vm = load_state_dict_file(f)
            d2t, t2d = vm.get("d2t"), vm.get("t2d")
            if d2t is None:
                raise ValueError(f"vocab map {f} has no 'd2t' tensor (keys: {sorted(vm)})")
            break
    else:
        if vocab_file:
            raise FileNotFoundError(f"{meta_file} names vocab_map {vocab_file!r}, which does "
                                    f"not exist in {meta_dir}")
    if config is None and meta_file is not None:
        log.warning("%s has no drafter config ('drafter' entry)", meta_file)
    return TrainerCheckpoint(config, sd, d2t, t2d, meta, source, meta_dir)


# ---------------------------------------------------------------------------------------------
# Exported drafters (layout A / EAGLE / SGLang, speculators)
# ---------------------------------------------------------------------------------------------

def _load_dir_tensors(path: Path) -> dict[str, torch.Tensor]:
    tdir = TensorDir(path)
    if tdir.files:
        return tdir.load_all()
    for name in ("pytorch_model.bin", "model.bin", "model.pt"):
        if (path / name).is_file():
            return load_state_dict_file(path / name)
    raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model.bin drafter weights")


def _aux_ids(src: dict[str, Any], tcfg: dict[str, Any] | None, where: str,
             speculators: bool) -> list[int]:
    """The aux ids in eyas's (vLLM, hidden_states[k]) convention from either spelling."""
    vl = src.get("eagle_aux_hidden_state_layer_ids")
    ec = src.get("eagle_config") if isinstance(src.get("eagle_config"), dict) else {}
    sg = None if speculators else ec.get("eagle_aux_hidden_state_layer_ids")
    if vl is not None and sg is not None and list(vl) != [int(i) + 1 for i in sg]:
        raise ValueError(f"{where}: top-level eagle_aux_hidden_state_layer_ids {vl} (vLLM) and "
                         f"eagle_config's {sg} (SGLang, +1) disagree: one of them is off by one; "
                         f"fix the one the drafter was not trained with before importing")
    if vl is not None:
        return [int(i) for i in vl]
    if sg is not None:
        return [int(i) + 1 for i in sg]
    if tcfg is None:
        raise ValueError(f"{where} names no aux layer ids: pass the target config so the "
                         f"engines' default (2, N//2, N-3) can be used")
    from eyas.data.common.targets import default_aux_layer_ids
    ids = default_aux_layer_ids(tcfg["num_hidden_layers"])
    log.warning("%s names no aux layer ids; assuming the engines' default %s", where, ids)
    return ids


#: the fields a source config contributes; everything else in layout A is fixed or derived
_LAYER_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "rope_parameters", "max_position_embeddings", "vocab_size")


def _layout_a_from(src: dict[str, Any], layer: dict[str, Any], aux: list[int],
                   draft_vocab_size: int) -> dict[str, Any]:
    """A layout-A config.json dict from a source's layer fields (`layer`) and EAGLE fields."""
    from eyas.models.config import Eagle3Config
    H = layer["hidden_size"]
    d = {k: layer[k] for k in _LAYER_FIELDS if layer.get(k) is not None}
    d.update(target_hidden_size=src.get("target_hidden_size") or H,
             draft_vocab_size=draft_vocab_size, eagle_aux_hidden_state_layer_ids=list(aux))
    d.update(norm_before_fc=norm_before_fc(layer), fc_norm=bool(layer.get("fc_norm", False)),
             norm_output=bool(layer.get("norm_output", False)))        # the EAGLE-3.1 norms
    unused = sorted(set(layer) - set(_LAYER_FIELDS) - {
        "architectures", "model_type", "num_hidden_layers", "target_hidden_size",
        "draft_vocab_size", "eagle_config", "eagle_aux_hidden_state_layer_ids",
        "norm_before_residual", "tie_word_embeddings", "attention_bias", "mlp_bias",
        "torch_dtype", "dtype", "transformers_version", "_name_or_path", "bos_token_id",
        "norm_before_fc", "fc_norm", "norm_output",
        "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "pretraining_tp",
        "attention_dropout"})
    if unused:
        log.info("source config keys without a layout-A meaning, not carried over: %s", unused)
    return Eagle3Config.from_config_dict(d).to_config_dict()


def _source_layer(src: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """The source's layer fields and format, refusing drafters layout A cannot hold."""
    if "speculators_model_type" in src or "transformer_layer_config" in src:
        if src.get("speculators_model_type") != "eagle3":
            raise ValueError(f"{where}: speculators_model_type "
                             f"{src.get('speculators_model_type')!r} is not an EAGLE-3 drafter")
        if "norm_before_residual" not in src:
            log.warning("%s: norm_before_residual absent; assuming false (speculators' default)",
                        where)
        layer = dict(src["transformer_layer_config"])
        # the EAGLE-3.1 norm flags sit at the top level (vLLM copies them into the layer)
        layer.update({k: src[k] for k in ("norm_before_fc", "fc_norm", "norm_output")
                      if k in src})
        fmt = "speculators"
    else:
        arch = src.get("architectures") or []
        if not any("Eagle" in a for a in arch):
            raise ValueError(f"{where}: architectures {arch} is not an EAGLE drafter")
        layer, fmt = src, "layout-a"
    if src.get("norm_before_residual", False) is not False:
        raise ValueError(f"{where}: norm_before_residual = true: this drafter normalises the "
                         f"residual, which eyas (and SGLang) do not compute; cannot warm-start")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: num_hidden_layers = {layer['num_hidden_layers']}: only "
                         f"one-layer EAGLE-3 drafters are supported")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise ValueError(f"{where}: biases are not part of layout A")
    if layer.get("tie_word_embeddings"):
        raise ValueError(f"{where}: tie_word_embeddings = true: an EAGLE-3 drafter ships its own "
                         f"lm_head over the draft vocabulary")
    return layer, fmt


def _layout_a_state_dict(raw: dict[str, torch.Tensor], wanted: tuple[str, ...], path: Path
                         ) -> dict[str, torch.Tensor]:
    """The source tensors under layout-A names (d2t/t2d kept), foreign ones dropped."""
    sd: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        n = name[len("model."):] if name.startswith("model.") else name
        n = n.replace("layers.0.", "midlayer.", 1) if n.startswith("layers.0.") else n
        if n in _FOREIGN:
            log.info("%s: %s is not a drafter weight (eyas uses the target's); not imported",
                     path, name)
            continue
        if n not in wanted and n not in ("d2t", "t2d"):
            raise ValueError(f"{path}: tensor {name!r} has no place in an eyas drafter (layout A "
                             f"names: {list(wanted)} + d2t, t2d)")
        sd[n] = t
    missing = [n for n in wanted if n not in sd]
    if missing:
        raise ValueError(f"{path}: the drafter lacks {missing}")
    return sd


def _vocab_mapping(src: dict[str, Any], layer: dict[str, Any], sd: dict[str, torch.Tensor],
                   path: Path, where: str) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """(d2t int64, t2d bool, draft vocab size) popped from `sd`; a missing t2d comes from d2t."""
    d2t, t2d = sd.pop("d2t", None), sd.pop("t2d", None)
    V = layer.get("vocab_size")
    Vd = src.get("draft_vocab_size") or layer.get("draft_vocab_size") \
        or sd["lm_head.weight"].shape[0]
    if not isinstance(V, int):
        raise ValueError(f"{where}: no int vocab_size")
    if Vd < V and d2t is None:
        raise ValueError(f"{path}: draft_vocab_size {Vd} < vocab_size {V} but the drafter ships "
                         f"no d2t{' (only t2d)' if t2d is not None else ''}: its lm_head rows "
                         f"cannot be mapped to target tokens without the mapping it was trained "
                         f"with")
    if d2t is not None:
        if d2t.dtype != torch.int64:
            log.info("%s: d2t stored as %s; converted to int64 (values unchanged)", path, d2t.dtype)
            d2t = d2t.to(torch.int64)
        if t2d is None:
            t2d = VocabMap.from_d2t(d2t, V).t2d
        elif t2d.dtype != torch.bool:
            t2d = t2d.bool()
    return d2t, t2d, Vd


def read_drafter_dir(path: str | Path, target_config: dict | str | Path | None = None
                     ) -> tuple[dict[str, Any], dict[str, torch.Tensor], torch.Tensor | None,
                                torch.Tensor | None, str]:
    """(layout-A config dict, layout-A state dict, d2t, t2d, source format) of an exported dir."""
    path = Path(path)
    src = read_config(path)
    tcfg = resolve_target_config(target_config)
    where = str(path / "config.json")
    raw = _load_dir_tensors(path)
    layer, fmt = _source_layer(src, where)
    wanted = layout_tensors(layer)
    sd = _layout_a_state_dict(raw, wanted, path)
    d2t, t2d, Vd = _vocab_mapping(src, layer, sd, path, where)
    aux = _aux_ids(src, tcfg, where, fmt == "speculators")
    cfg = _layout_a_from(src, layer, aux, int(Vd))
    return cfg, sd, d2t, t2d, fmt


@dataclass
class ImportedDrafter:
    """Unpacks as (config, state_dict, d2t, t2d); also carries the config dict and the format."""

    config: Any                           # models.config.Eagle3Config
    state_dict: dict[str, torch.Tensor]   # layout-A / eyas parameter names, source dtypes
    d2t: torch.Tensor | None              # [Vd] int64 offsets, exactly as shipped
    t2d: torch.Tensor | None              # [V] bool
    config_dict: dict[str, Any] = field(default_factory=dict)
    source_format: str = ""

    def __iter__(self):
        return iter((self.config, self.state_dict, self.d2t, self.t2d))


def import_drafter(path: str | Path, target_config: dict | str | Path | None = None
                   ) -> ImportedDrafter:
    """Warm-start source: an existing drafter mapped onto eyas's names, its vocab map kept.

    `target_config` is needed only when the source names no aux layer ids (then the engines'
    default 2, N//2, N-3 is assumed, with a warning).
    """
    from eyas.models.config import Eagle3Config
    cfg, sd, d2t, t2d, fmt = read_drafter_dir(path, target_config)
    # training-only fields (ttt_steps) keep Eagle3Config's defaults; the trainer sets them
    return ImportedDrafter(Eagle3Config.from_config_dict(cfg), sd, d2t, t2d, cfg, fmt)


def load_training_drafter(drafter_dir: str | Path, target: str | Path, *,
                          cache_dir: str | Path | None = None, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu", attention: str | None = None):
    """An exported drafter directory imported into the training module `Eagle3Drafter`.

    target: preset or directory whose input embedding the drafter uses (memory-mapped).
    attention: TTT attention kind (default: "flex" on CUDA, "lse-eager" on CPU).
    """
    from eyas.data.common.targets import fast_device, load_embedding_and_head
    from eyas.data.store.vocab_map import VocabMap
    from eyas.models.drafter import Eagle3Drafter
    dev = torch.device(device)
    imp = import_drafter(drafter_dir)
    cfg = imp.config
    fast = fast_device(dev)   # evaluation has no backward: "lse-eager" is flex's math, densely
    attention = attention or ("flex" if fast else "lse-eager")
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg, attention=attention, compile_flex=fast)
    embed, _ = load_embedding_and_head(target, cache_dir)
    if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"{drafter_dir}: the drafter needs a target embedding [vocab_size, "
                         f"hidden_size] = {[cfg.vocab_size, cfg.hidden_size]}, target {target} "
                         f"has {list(embed.shape)}: wrong --target?")
    d2t = imp.d2t if imp.d2t is not None else torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    t2d = imp.t2d if imp.t2d is not None else VocabMap.from_d2t(d2t, cfg.vocab_size).t2d
    state = dict(imp.state_dict, **{"embed_tokens.weight": embed, "d2t": d2t, "t2d": t2d})
    drafter.load_state_dict(state, strict=True, assign=True)
    return drafter.to(device=dev, dtype=dtype).eval()
