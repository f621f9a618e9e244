"""The closed choices of the configuration schema (`train.config`): each Enum is a field's set
of accepted values, which Hydra checks at composition time."""

from __future__ import annotations

from enum import Enum


def _choices(name: str, values: str) -> type[Enum]:
    """A str Enum whose members are named after their values (space-separated in `values`)."""
    return Enum(name, [(v, v) for v in values.split()], type=str, module=__name__)


AttentionImpl = _choices("AttentionImpl", "auto flex eager")
FP8Recipe = _choices("FP8Recipe", "off tensorwise rowwise")
LossImpl = _choices("LossImpl", "auto triton torch")
Normalisation = _choices("Normalisation", "valid specforge")
LossObjective = _choices("LossObjective", "soft_ce tv lk_alpha lk_lambda mix")
Moments = _choices("Moments", "fp32 bf16")
OptimName = _choices("OptimName", "adamw muon")
MuonAdjustLR = _choices("MuonAdjustLR", "match_rms_adamw original")
Schedule = _choices("Schedule", "cosine linear constant")
DistBackend = _choices("DistBackend", "ddp deepspeed")
ExportSelect = _choices("ExportSelect", "best last")
ParamDtype = _choices("ParamDtype", "auto bf16 fp32")
WandbMode = _choices("WandbMode", "online offline disabled")

#: accelerate's trackers (`accelerate.utils.LoggerType`) -> the distributions that provide them
TRACKER_PACKAGES = {"wandb": ("wandb",), "tensorboard": ("tensorboard", "tensorboardX"),
                    "mlflow": ("mlflow", "mlflow-skinny"), "aim": ("aim",),
                    "comet_ml": ("comet-ml", "comet_ml"), "clearml": ("clearml",),
                    "dvclive": ("dvclive",), "swanlab": ("swanlab",), "trackio": ("trackio",)}
