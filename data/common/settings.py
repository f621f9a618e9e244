"""The data-side settings the `eyas` subcommands share with the trainer, with their defaults.

The Hydra schema (`train/config.py`) extends these dataclasses, as its `drafter` group extends
`models.config.DrafterShape`, so a Hydra key (`data.max_length`, `target.dtype`, …) and the
matching command-line option (`eyas prepare --max-length`, `eyas extract --dtype`, …) have one
default, defined here. The command-line front ends take their defaults and help from these
fields (`data.common.options.shared`); tests/train/test_cli_defaults.py checks that every option matches.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, List, Optional

from eyas.data.common.options import setting


class AuxFormat(str, Enum):
    bf16 = "bf16"
    fp8 = "fp8"


class TeacherKind(str, Enum):
    last = "last"
    topk = "topk"


class Capture(str, Enum):
    """Who captures the target's hidden states: the target in this process (transformers,
    forward hooks), a vLLM engine run here, or a `vllm serve` started by the user."""
    hf = "hf"
    vllm = "vllm"
    endpoint = "endpoint"


class KVCache(str, Enum):
    dynamic = "dynamic"
    static = "static"


#: precision spellings -> canonical torch dtype names; "auto" is decided per device
#: (`eyas.data.common.targets.target_dtype_name`)
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
#: what `target.dtype` / `--dtype` accept
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)


@dataclass
class SeedSettings:
    seed: int = setting(
        0,
        "Seed of weights, data order and dropout-free randomness (and of sampled generation).")


@dataclass
class TargetSettings:
    name: str = setting(
        "smollm2",
        "Target model: a local Hugging Face model directory, a hub id (org/name[@revision], from "
        "the HF cache, downloaded when the hub is online), or a preset (smollm2, tiny-llama, "
        "tiny-deepseek-v3; llama-3.1-8b, qwen3-8b, deepseek-v3, kimi-k2.5 are config-only: the "
        "target=llama_3_1_8b ... groups name their models' hub ids instead).")
    aux_layer_ids: Optional[List[int]] = setting(
        None,
        "Aux layers as HF `hidden_states[k]` ids (= vLLM ids); null = 2, N//2, N-3.")
    dtype: str = setting(
        "auto",
        "dtype the target runs in for generation and extraction: bfloat16 (bf16), float32 (fp32),"
        " or auto (bfloat16 on CUDA; float32 on CPU, where bf16 matmuls are emulated ~10x "
        "slower).")


@dataclass
class VocabSettings:
    draft_vocab_size: int = setting(
        32000,
        "Rows of the draft lm_head (capped at the target vocabulary).")


@dataclass
class TokenizeSettings:
    max_length: int = setting(2048, 'Longest conversation kept when tokenising (tokens).')


@dataclass
class GenerationSettings:
    """How `data.produce.generate` answers prompts with the target (`eyas prepare --generate`). The
    trainer's embedded default keeps short, partly sampled answers (`train.config.DataConfig`)."""

    max_new_tokens: int = setting(512, 'Length cap of generated assistant turns (tokens).')
    generation_batch_size: int = setting(16, 'Prompts per generate() call.')
    temperature: float = setting(0.0, 'Sampling temperature of the generated answers; 0 = greedy.')
    top_p: float = setting(1.0, 'Nucleus (top-p) cutoff of the sampled answers.')
    generation_cache: KVCache = setting(
        KVCache.dynamic,
        "KV cache of the answers' `generate` calls: dynamic (transformers' default, grown token "
        "by token) or static (allocated once per call; on a GPU transformers compiles its "
        "decoding step for each shape, so every batch is padded to generation_batch_size rows and"
        " its prompts to a multiple of 64 tokens: one compile per 64-token prompt length; batches"
        " run shortest first, so most share one. benchmarks/generate_cache.py, "
        "generate_stage.py).")

    def generate_kwargs(self) -> dict[str, Any]:
        """These settings as `data.produce.generate.generate_conversations` keywords."""
        return dict(max_new_tokens=self.max_new_tokens, batch_size=self.generation_batch_size,
                    temperature=self.temperature, top_p=self.top_p,
                    cache=KVCache(self.generation_cache).value)


@dataclass
class EndpointSettings:
    """How `eyas generate --endpoint` (data.produce.served) talks to an OpenAI-compatible server."""

    endpoint_concurrency: int = setting(8, 'Requests in flight at once to the served target.')


@dataclass
class SynthesisSettings:
    synthetic_temperature: float = setting(
        1.0,
        "Sampling temperature of the prompts the target writes itself (data.produce.synthesize).")
    synthetic_opener_words: int = setting(
        0,
        "0: synthetic prompts come from the chat template alone. N > 0: each starts with the "
        "first N words of a random given prompt and the target writes the rest, so they follow "
        "its style.")
    synthetic_examples: int = setting(
        0,
        "0: off. N > 0: each synthetic prompt is written as the next item of a numbered list of N"
        " random given prompts (plain text, no chat template; it ends at the line break), so it "
        "follows their length and register, not only their first words.")


@dataclass
class ExtractionSettings:
    capture: Capture = setting(
        Capture.hf,
        "Who captures the hidden states: hf (the target in this process, transformers), vllm (a "
        "vLLM engine run here in its own venv, `eyas engines setup --runtime`) or endpoint (a "
        "`vllm serve` started with extract_hidden_states and a connector, at capture_endpoint).")
    capture_endpoint: Optional[str] = setting(
        None,
        "With capture=endpoint: the capturing server's URL (http://HOST:PORT/v1); its "
        "hidden-states files must be readable here.")
    capture_model: Optional[str] = setting(
        None, "With capture=endpoint: the served model name; null = the first it lists.")
    extract_pad_batches: bool = setting(
        False,
        "Extraction pads samples of different lengths into one forward (much faster on a GPU; the"
        " features then differ from unpadded forwards by kernel rounding only).")
    aux_format: AuxFormat = setting(
        AuxFormat.bf16,
        "Storage of aux states when extracting: bf16 or fp8 (e4m3 + per-token scale).")
    teacher: TeacherKind = setting(
        TeacherKind.last,
        "Teacher stored by extraction: the post-norm last hidden state, or top-k logits.")

    def extract_kwargs(self) -> dict[str, Any]:
        """These settings as `data.produce.extract.extract` keywords."""
        return dict(capture=self.capture, endpoint=self.capture_endpoint,
                    served_model=self.capture_model, aux_format=self.aux_format.value,
                    teacher=self.teacher.value, pad_batches=self.extract_pad_batches)


class StreamKeep(str, Enum):
    all = "all"
    none = "none"


@dataclass
class StreamSettings:
    """`data.stream`: capture and train at once (data/produce/stream.py)."""

    enabled: bool = setting(
        False,
        "Train while the target captures (data.capture): no extraction stage; `data.stream=true` "
        "is the short spelling.")
    keep: StreamKeep = setting(
        StreamKeep.all,
        "all: the captured samples become the dataset's shards as they come (data.dataset, or "
        "the embedded default's cache), read by later epochs and runs; none: only a spool, "
        "every epoch captures again.")
    ahead: int = setting(256, "Samples the producer may capture ahead of the loader, per rank.")
    shard_tokens: Optional[int] = setting(
        None, "Tokens per kept shard, as `eyas extract --shard-tokens`; null = about 1 GiB of "
        "features per shard (extract's default).")
    spool_bytes: int = setting(
        8 << 30, "With keep=none: the most bytes the spool holds (checked free at the start).")
