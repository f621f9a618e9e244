"""Loss kernels: the fused EAGLE-3 loss and the teacher distributions it consumes.

- ``eagle3_loss``: lm_head + soft cross-entropy + argmax (+ acceptance) for all TTT steps in one
  call (``impl="triton"`` fused, ``impl="torch"`` twin); see ``kernels/loss.py``.
- ``teacher_probs`` / ``teacher_from_topk``: the [N, Vd] teacher, once per batch.
"""

import importlib.util

from eyas.kernels.loss import LossOutput, auto_chunk_size, eagle3_loss
from eyas.kernels.teacher import teacher_from_topk, teacher_probs

__all__ = ["LossOutput", "auto_chunk_size", "eagle3_loss", "teacher_from_topk", "teacher_probs",
           "triton_available"]


def triton_available() -> bool:
    """Whether Triton is installed (the fused kernels need it; their torch twins do not)."""
    return importlib.util.find_spec("triton") is not None
