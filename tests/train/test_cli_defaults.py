"""Every `eyas` subcommand option that the trainer also configures defaults to the schema's value.

Each parser is parsed with the fewest arguments it accepts and every default is compared with
the schema (`train.config.EyasConfig`, whose data-side groups extend `data.common.settings`). An option
named like a schema field must be mapped here or listed, with its reason, as deliberately
different, so a new literal default fails this test.
"""

from dataclasses import fields, is_dataclass
from enum import Enum

import pytest

from eyas.data.common.options import parse
from eyas.data.common.settings import GenerationSettings
from eyas.train.cli import COMMANDS
from eyas.train.config import EyasConfig

# subcommand -> the fewest arguments it accepts
ARGV = {
    "prepare": ["--input", "i", "--target", "t", "--out", "o"],
    "generate": ["--endpoint", "u", "--prompts", "p", "--out", "o"],
    "synthesize": ["--target", "t", "--n", "1", "--out", "o"],
    "extract": ["--tokens", "i", "--target", "t", "--out", "o"],
    "import": ["specforge", "s", "--out", "o", "--target", "t"],
    "vocab": ["--data", "d", "--out", "o"],
    "export": ["ckpt", "out"],
    "validate": ["d", "--target-config", "t"],
    "doctor": ["d", "--target-config", "t"],
    "engines check": ["d", "--target-config", "t"],
    "evaluate": ["--drafter", "d", "--data", "x", "--k", "3", "--out", "o"],
}

# (subcommand, option dest) -> the schema key whose default it must have
SHARED = {
    ("prepare", "max_length"): "data.max_length",
    ("prepare", "batch_size"): "data.generation_batch_size",
    ("prepare", "seed"): "train.seed",
    ("prepare", "dtype"): "target.dtype",
    ("generate", "concurrency"): "data.endpoint_concurrency",
    ("generate", "samples_per_prompt"): "data.samples_per_prompt",
    ("synthesize", "temperature"): "data.synthetic_temperature",
    ("synthesize", "seed"): "train.seed",
    ("synthesize", "dtype"): "target.dtype",
    ("extract", "layers"): "target.aux_layer_ids",
    ("extract", "aux_format"): "data.aux_format",
    ("extract", "teacher"): "data.teacher",
    ("extract", "pad_batches"): "data.extract_pad_batches",
    ("extract", "dtype"): "target.dtype",
    ("extract", "capture"): "data.capture",
    ("extract", "capture_endpoint"): "data.capture_endpoint",
    ("extract", "capture_model"): "data.capture_model",
    ("import", "layers"): "target.aux_layer_ids",
    ("import", "aux_format"): "data.aux_format",
    ("vocab", "size"): "drafter.draft_vocab_size",
    ("export", "speculators_config"): "export.speculators_config",
    ("evaluate", "max_new_tokens"): "eval.max_new_tokens",
    ("evaluate", "token_budget"): "data.token_budget",
    ("evaluate", "context_buckets"): "eval.context_buckets",
    ("evaluate", "processes"): "eval.processes",
}

# `eyas prepare --generate` answers like data.produce.generate (`data.common.settings.GenerationSettings`); the
# trainer's embedded default overrides these three for its short, partly sampled answers
GENERATOR = {("prepare", "max_new_tokens"), ("prepare", "temperature"), ("prepare", "top_p"),
             ("generate", "temperature"), ("generate", "top_p")}

# options named like a schema field that mean something else, and why
DIFFERENT = {
    ("synthesize", "top_p"): "the prompt sampler's cutoff; the trainer samples prompts at 1.0 too "
                             "(synthesize_prompts' default), data.top_p is for answers",
    ("synthesize", "max_new_tokens"): "longest synthetic prompt, not an answer length",
    ("evaluate", "num_prompts"): "default all prompts of --prompts; eval.num_prompts picks from "
                                 "the shipped held-out file",
    ("evaluate", "dtype"): "the drafter's compute dtype in evaluation, not the target's",
    ("evaluate", "seed"): "unset = the train.seed the drafter's export records, else train.seed's "
                          "default (test_scored_samples_default_to_the_training_split)",
    ("evaluate", "eval_fraction"): "unset = the trainer's held-out split when --data is the "
                                   "drafter's training set; set = that split fraction",
    ("evaluate", "temperature"): "the speculative-sampling temperature of the evaluation "
                                 "(0 = greedy); data.temperature is the answer generator's",
    ("extract", "tokens"): "the required token dataset to capture; data.tokens null = the "
                           "embedded default's (a streamed run's source)",
    ("vocab", "cache_dir"): "unset = data.common.targets.DEFAULT_CACHE_DIR, data.cache_dir's default",
    ("evaluate", "prompts"): "required choice of mode, no default",
    ("evaluate", "cache_dir"): "unset = data.common.targets.DEFAULT_CACHE_DIR, data.cache_dir's default "
                               "(test_unset_cache_dir_is_the_schema_default)",
    ("doctor", "data"): "the dataset the drafter was trained on; none means no data checks",
    ("validate", "engines"): "engine names to load with; eval.engines is an on/off switch",
    ("engines check", "engines"): "engine names to load with; eval.engines is an on/off switch",
    ("generate", "endpoint"): "the required server URL; data.endpoint null = local answers",
    ("generate", "prompts"): "the required prompts file; data.prompts null = the shipped ones",
    ("generate", "seed"): "unset = no seed sent (the server's own randomness); the main job "
                          "sends train.seed",
    ("export", "overwrite"): "replaces an export directory; train.overwrite replaces a run "
                             "directory",
}


def _schema_value(key: str):
    group, name = key.split(".")
    value = getattr(getattr(EyasConfig(output_dir="x"), group), name)
    return value.value if isinstance(value, Enum) else value


def _schema_field_names() -> set[str]:
    cfg = EyasConfig(output_dir="x")
    return {f.name for g in fields(cfg) if is_dataclass(getattr(cfg, g.name))
            for f in fields(getattr(cfg, g.name))}


@pytest.mark.parametrize("name", sorted(ARGV))
def test_cli_defaults_are_the_schema_defaults(name):
    command, _, sub = name.partition(" ")
    target = COMMANDS[command][0]()
    args = vars(parse((target[sub] if sub else target)[0], f"eyas {name}", ARGV[name]))
    for (cli, dest), key in SHARED.items():
        if cli == name:
            assert args[dest] == _schema_value(key), f"eyas {name} --{dest}: not {key}'s default"
    for cli, dest in GENERATOR:
        if cli == name:
            field = "generation_batch_size" if dest == "batch_size" else dest
            assert args[dest] == getattr(GenerationSettings, field), f"eyas {name} --{dest}"
    unmapped = sorted(d for d in args if d in _schema_field_names() and (name, d) not in SHARED
                      and (name, d) not in GENERATOR and (name, d) not in DIFFERENT)
    assert not unmapped, (f"eyas {name}: options named like schema fields {unmapped}: map them "
                          f"in SHARED (and take the default from the schema) or list in DIFFERENT")


def test_embedded_default_overrides_only_the_answer_shape():
    """data.* differs from `eyas prepare --generate` only where the embedded default says so."""
    data = EyasConfig(output_dir="x").data
    differ = {f.name for f in fields(GenerationSettings)
              if getattr(data, f.name) != getattr(GenerationSettings, f.name)}
    assert differ == {"max_new_tokens", "temperature", "top_p"}


def test_unset_cache_dir_is_the_schema_default():
    from pathlib import Path

    from eyas.data.common.targets import DEFAULT_CACHE_DIR
    assert DEFAULT_CACHE_DIR == Path(EyasConfig(output_dir="x").data.cache_dir).expanduser()
