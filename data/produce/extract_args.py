"""`eyas extract`'s options (defaults shared with training come from `data.common.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.data.produce.forward import TEACHERS
from eyas.data.common.capture import ExtractError
from eyas.data.common.options import option, shared
from eyas.data.common.settings import DTYPE_CHOICES, ExtractionSettings, TargetSettings


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


@dataclass(kw_only=True)
class ExtractOptions:
    """Run the target over a token dataset and store the EAGLE-3 training features (aux states,
    teacher, target argmax). Resumable; launch with `accelerate launch --num_processes G` for
    data parallel over G GPUs."""

    renamed = {"--engine": "--capture {}",
               "--endpoint": "--capture endpoint --capture-endpoint {}"}

    tokens: str = option(help="token dataset (from eyas prepare)")
    target: str = option(help="model directory, hub id (org/name[@revision]) or preset name")
    out: str | None = option(
        None, "output hidden-state dataset directory (none with --estimate, required otherwise; "
        "locked while written; resumes its own run, refuses other data and --tokens itself)",
        needed="out")
    layers: str | None = shared(TargetSettings, "aux_layer_ids", "target.aux_layer_ids",
                                metavar="A,B,C")
    aux_format: str = shared(ExtractionSettings, "aux_format", "data.aux_format")
    teacher: str = shared(ExtractionSettings, "teacher", "data.teacher", "both: the two.",
                          choices=TEACHERS)
    topk: int = option(32, "k of the top-k teacher")
    max_samples: int | None = option(
        None, "use only the first N samples of the token dataset (default: all)")
    batch_tokens: int = option(8192, "tokens per forward (a longer sample runs alone)")
    pad_batches: bool = shared(ExtractionSettings, "extract_pad_batches",
                               "data.extract_pad_batches")
    dtype: str = shared(TargetSettings, "dtype", "target.dtype",
                        "Match the precision the target is served in.", choices=DTYPE_CHOICES)
    shard_tokens: int | None = option(
        None, "tokens per output shard (default: about 1 GiB of features per shard)")
    device: str = option("auto", "auto (cuda:<local rank> if available), cpu, cuda:0, ...")
    device_map: str | None = option(
        None, "'auto': one large target across GPUs (default: none, the whole target on --device)")
    max_memory: str | None = option(
        None, "(none: no cap) with --device-map, the most memory per device, e.g. "
        "0=60GiB,cpu=200GiB; what does not fit the GPUs stays in host memory",
        metavar="DEV=SIZE,...")
    capture: str = shared(ExtractionSettings, "capture", "data.capture")
    capture_endpoint: str | None = shared(
        ExtractionSettings, "capture_endpoint", "data.capture_endpoint",
        "docs/engine.md has the server's command.", metavar="URL")
    capture_model: str | None = shared(ExtractionSettings, "capture_model", "data.capture_model",
                                       metavar="NAME")
    finalize_only: bool = option(False, "only write the manifest from the shards present")
    estimate: bool = option(
        False, "capture nothing: print the bytes on disk of every storage mode and the expected "
        "time (a few timed forwards of the target on this device)", needed="out")
    estimate_batches: int = option(3, "with --estimate: forwards timed after one warm-up",
                                   metavar="N")
    tokens_per_s: float | None = option(
        None, "with --estimate: a stated capture rate instead of timing the target (default: "
        "none, the target is loaded and timed)", metavar="RATE")

