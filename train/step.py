"""One training forward: drafter TTT unroll → teacher → fused loss, as a single nn.Module.

Putting the loss inside the module that DDP/DeepSpeed wrap keeps every use of the draft
lm_head inside the wrapped forward (ZeRO-3 gathers parameters per module forward; the
lm_head weight is registered as an external parameter of this module for that reason).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from eyas.kernels.loss import eagle3_loss
from eyas.models.alpha import teacher_rows
from eyas.models.drafter import Eagle3Drafter
from eyas.models.metrics import alpha_counts
from eyas.models.objective import metric_mask, metric_rows, row_objective, row_weights
from eyas.train.choices import Normalisation


@dataclass
class StepOutput:
    loss: Tensor            # 0-dim fp32, already weighted and normalised
    draft_argmax: Tensor    # [K, T] int64 draft-vocabulary ids
    step_loss: Tensor       # [K] fp32 weighted loss of each TTT step (no graph)
    metric_mask: Tensor     # [K, T] bool rows that count for metrics (valid · loss_mask)
    alpha: dict             # `models.metrics.alpha_counts`: expected acceptance per step


class TrainingModule(nn.Module):
    """Drafter + frozen target head rows (the teacher) + the loss configuration.

    loss_cfg: the `loss` group (`train.config.LossConfig`); loss_impl: "triton" or "torch" (as
    `train.resolve.resolve` decides it); ttt_steps: the unroll depth, by default the drafter's
    own (`Eagle3Config.ttt_steps`, its one holder in training). host_embedding
    (`drafter.host_embedding`): take the frozen embedding table out of the drafter and keep it
    where it is now (host memory): the loaders look up each batch's rows there
    (`PackedLoader.attach_embedding`) and `to_device` sends them with the batch. The table is
    then no parameter or buffer, so moving the module, DDP, DeepSpeed and checkpoints leave it
    alone (~1 GiB of GPU memory at Llama-8B, 2.2 at Kimi).
    """

    def __init__(self, drafter: Eagle3Drafter, target_head_rows: Tensor, loss_cfg, *,
                 loss_impl: str, ttt_steps: int | None = None, host_embedding: bool = False):
        super().__init__()
        self.host_embedding: Tensor | None = None
        if host_embedding:
            self.host_embedding = drafter.embed_tokens.weight.detach()
            drafter.embed_tokens = None
        self.drafter = drafter
        # [Vd, tH] target lm_head rows i + d2t[i]: the teacher over the draft vocabulary.
        self.register_buffer("target_head_rows", target_head_rows, persistent=False)
        self.loss_impl = loss_impl
        self.ttt_steps = int(ttt_steps if ttt_steps is not None else drafter.config.ttt_steps)
        self.step_weight = float(loss_cfg.step_weight)
        self.normalisation = Normalisation(loss_cfg.normalisation).value
        self.position_mask = bool(loss_cfg.position_mask)
        self.chunk_size = loss_cfg.chunk_size
        self.objective = row_objective(loss_cfg)

    def register_for_zero3(self) -> None:
        """ZeRO-3: gather, during this module's forward, the weights used outside their own
        module's forward (`Eagle3Drafter.direct_weights`: lm_head, down_proj, q/k/v)."""
        from deepspeed.runtime.zero import register_external_parameter
        for weight in self.drafter.direct_weights():
            register_external_parameter(self, weight)
        # drafter.compile and drafter.embedding_qkv_once are off: the config check refuses them
        # under ZeRO-3 (train/config.py says why)

    def forward(self, input_ids: Tensor, aux: Tensor, doc_ids: Tensor, positions: Tensor,
                loss_mask: Tensor, target_argmax: Tensor, last: Tensor | None = None,
                topk_ids: Tensor | None = None, topk_logits: Tensor | None = None,
                rows: Tensor | None = None, embeds: Tensor | None = None) -> StepOutput:
        """One TTT unroll and its loss. ``rows`` (`models.objective.metric_rows`, optional):
        the only rows whose lm_head GEMMs run; draft_argmax is −1 on the others. ``embeds``:
        the batch's embedding rows (`to_device`; required with host_embedding)."""
        d = self.drafter
        # (the record_function names group GPU kernels in a profile: benchmarks/train_step.py)
        with record_function("eyas.drafter"):
            out = d(input_ids, aux, doc_ids, positions, self.ttt_steps,
                    embeds=embeds)                                            # hidden [K, T, H]
        w = row_weights(out.valid, loss_mask, target_argmax, d.t2d,
                        step_weight=self.step_weight, normalisation=self.normalisation,
                        position_mask=self.position_mask)                     # [K, T] fp32
        with record_function("eyas.loss"):
            # [T, Vd], aligned for the loss kernel: row t holds the target at index t+1
            teacher = teacher_rows(self.target_head_rows, d.t2d_index, last, topk_ids,
                                   topk_logits)
            res = eagle3_loss(out.hidden, d.lm_head.weight, teacher, w, impl=self.loss_impl,
                              chunk_size=self.chunk_size, rows=rows, with_accept=True,
                              objective=self.objective)
        return StepOutput(loss=res.loss, draft_argmax=res.draft_argmax, step_loss=res.step_loss,
                          metric_mask=metric_mask(out.valid, loss_mask),
                          alpha=alpha_counts(res.accept, w))


#: the names TrainingModule.forward takes (read once: `batch_inputs` runs every micro-batch)
_FORWARD_ARGS = frozenset(inspect.signature(TrainingModule.forward).parameters)


def batch_inputs(batch, rows: Tensor | None = None, embeds: Tensor | None = None) -> dict:
    """The keyword arguments of TrainingModule.forward from a data.store.loader.Batch: each of
    its fields that forward names, the loss rows and the embedding rows."""
    return dict({f.name: getattr(batch, f.name) for f in fields(batch) if f.name in _FORWARD_ARGS},
                rows=rows, embeds=embeds)


def to_device(batch, device, ttt_steps: int, skip_masked_rows: bool) -> tuple[Any, dict]:
    """(batch on ``device``, TrainingModule.forward kwargs) for a host batch. With
    ``skip_masked_rows`` the loss rows are listed here, on the host, so the loss skips masked
    rows without a device sync. The batch's embedding rows (``batch.embeds``, filled by its
    loader's threads with `PackedLoader.attach_embedding`) travel with it."""
    rows = None
    if skip_masked_rows:
        rows = send(metric_rows(batch.doc_ids, batch.loss_mask, ttt_steps), device)
    batch = batch.to(device)
    return batch, batch_inputs(batch, rows, batch.embeds)


def send(x: Tensor, device) -> Tensor:
    """A host tensor on ``device`` without blocking the host."""
    if torch.device(device).type == "cuda":
        # a copy from pageable memory would block the host until the GPU drains the stream
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)

