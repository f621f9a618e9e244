"""The closed choices of the configuration schema (`train.config`): each Enum is a field's set
of accepted values, which Hydra checks at composition time."""

from __future__ import annotations

from enum import Enum


class AttentionImpl(str, Enum):
    auto = "auto"
    flex = "flex"
    eager = "eager"


class FP8Recipe(str, Enum):
    off = "off"
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class LossImpl(str, Enum):
    auto = "auto"
    triton = "triton"
    torch = "torch"


class Normalisation(str, Enum):
    valid = "valid"
    specforge = "specforge"


class Moments(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Schedule(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class DistBackend(str, Enum):
    ddp = "ddp"
    deepspeed = "deepspeed"


class ExportSelect(str, Enum):
    best = "best"
    last = "last"


class ParamDtype(str, Enum):
    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"


#: accelerate's trackers (`accelerate.utils.LoggerType`) -> the distributions that provide them
TRACKER_PACKAGES = {"wandb": ("wandb",), "tensorboard": ("tensorboard", "tensorboardX"),
                    "mlflow": ("mlflow", "mlflow-skinny"), "aim": ("aim",),
                    "comet_ml": ("comet-ml", "comet_ml"), "clearml": ("clearml",),
                    "dvclive": ("dvclive",), "swanlab": ("swanlab",), "trackio": ("trackio",)}


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"
