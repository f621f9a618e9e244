"""The three producers of a hidden-state dataset behind one interface.

`open_capturer(Capture.X, tokens, ...)` gives a context manager with `plan_fields()` (what the
extraction plan and manifest record of the target and the capture) and `capture(indices)`: the
stored fields of those token-dataset samples, keyed by index. `eyas extract`
(data/produce/extract.py) writes them shard by shard; a streamed training (data/produce/stream.py)
asks for them in the order its loader reads them. Which producer:

- ``hf``: the target in this process (transformers, forward hooks; data/produce/forward.py;
  batched as data/produce/extract.py says).
- ``vllm``: the target in a vLLM worker process here (data/engine/runner.py), with its
  ``extract_hidden_states`` method (data/produce/engine_capture.py).
- ``endpoint``: a ``vllm serve`` a user started with that method and a hidden-states connector.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from eyas.data.common.capture import (ExtractError, LayerHooks, check_aux_layers, find_text_model,
                                      logit_transform, target_fingerprint)
from eyas.data.common.settings import Capture

log = logging.getLogger(__name__)


class HFCapturer:
    """`Capture.hf`: the target loaded here (or `model`, already loaded)."""

    kind = Capture.hf

    def __init__(self, tokens, tokens_dir, target, *, layers, teacher: str, topk: int,
                 dtype: str, device=None, device_map=None, max_memory=None, model=None,
                 batch_tokens: int = 8192, pad_batches: bool = False, row_chunk: int = 1024,
                 vocab_chunk: int = 65536):
        import transformers

        from eyas.data.produce.forward import load_model
        if model is None:
            model = load_model(target, dtype, device, device_map, max_memory)
        self.model, self.tokens, self.tokens_dir = model, tokens, tokens_dir
        self.text, dec_layers, self.norm, self.head = find_text_model(model)
        self.num_layers = min(len(dec_layers),
                              getattr(self.text.config, "num_hidden_layers", len(dec_layers)))
        self.aux_ids = check_aux_layers(layers, self.num_layers)
        self.vocab = int(self.head.weight.shape[0])
        self.teacher, self.topk = teacher, topk
        self.batch_tokens, self.pad_batches = batch_tokens, pad_batches
        self.chunks = (row_chunk, vocab_chunk)
        self.logit_tf = logit_transform(model.config)
        self.target_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.record = {"source": "hf", "transformers": transformers.__version__,
                       "dtype": self.target_dtype, "layers": "pre-hooks on layers[k] (HF "
                       "hidden_states[k]); last: the final norm's output"}
        self.hooks = LayerHooks(dec_layers, self.aux_ids, self.norm)
        self.lengths = [int(x) for x in tokens.sample_lengths]    # once, not per capture
        self.device = next(self.text.parameters()).device

    def plan_fields(self) -> dict[str, Any]:
        return {"target_config": json.loads(self.model.config.to_json_string()),
                "fingerprint": target_fingerprint(self.model), "target_dtype": self.target_dtype,
                "capture": self.record, "aux_ids": self.aux_ids,
                "hidden": int(self.head.weight.shape[1]), "vocab": self.vocab,
                "num_layers": self.num_layers}

    def capture(self, indices: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        from eyas.data.produce.forward import length_groups, run_batch
        out: dict[int, dict[str, torch.Tensor]] = {}
        for idx in length_groups(self.lengths, list(indices), self.batch_tokens,
                                 self.pad_batches):
            batch = [self.tokens.sample(i, fields=("input_ids", "loss_mask")) for i in idx]
            top = max(int(s["input_ids"].max()) for s in batch)
            if top >= self.vocab:
                raise ExtractError(f"{self.tokens_dir}: token id {top} in samples {idx} is "
                                   f"outside the target's vocabulary ({self.vocab}); was the "
                                   f"dataset prepared with another tokenizer?")
            outs = run_batch(self.text, self.hooks, self.head, batch, teacher=self.teacher,
                             topk=self.topk, row_chunk=self.chunks[0],
                             vocab_chunk=self.chunks[1], logit_tf=self.logit_tf)
            out.update(zip(idx, outs))
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.remove()


class EngineCapturer:
    """`Capture.vllm` (a worker here) or `Capture.endpoint` (a running `vllm serve`): the
    engine's per-request files become the stored fields through the target's own final norm
    and lm_head (`engine_capture.sample_features`)."""

    def __init__(self, tokens, tokens_dir, target, *, kind: Capture, storage: Path,
                 layers, teacher: str, topk: int, dtype: str, endpoint: str | None = None,
                 served_model: str | None = None, batch_samples: int = 32, log_path: Path | None = None):
        from eyas.data.produce.engine_capture import (EndpointSource, TargetHead, WorkerSource,
                                                    capture_source)
        from eyas.data.common.targets import resolve_target
        if kind == Capture.endpoint and not endpoint:
            raise ExtractError("capture=endpoint needs the capturing server's URL "
                               "(--capture-endpoint URL, data.capture_endpoint=URL)")
        self.kind, self.tokens, self.tokens_dir = kind, tokens, tokens_dir
        target_dir = resolve_target(target)
        self.head = TargetHead(target_dir, dtype)
        self.aux_ids = check_aux_layers(layers, self.head.num_layers)
        engine_ids = [*self.aux_ids, self.head.num_layers]
        self.teacher, self.topk, self.dtype = teacher, topk, dtype
        self.batch_samples = batch_samples
        self.storage = Path(storage)
        shutil.rmtree(self.storage, ignore_errors=True)     # a killed run's files: recomputed
        max_len = int(max(tokens.sample_lengths)) + 8
        self.source = (EndpointSource(endpoint, served_model) if kind == Capture.endpoint else
                       WorkerSource(target_dir, engine_ids, self.storage, dtype, max_len,
                                    log_path or self.storage.parent / "engine.log"))
        self.source.__enter__()
        self.record = capture_source(self.source, engine_ids, self.head.num_layers, dtype)
        self.where = (f"the server at {endpoint}" if kind == Capture.endpoint
                      else "the engine worker here")

    def plan_fields(self) -> dict[str, Any]:
        return {"target_config": json.loads(self.head.config.to_json_string()),
                "fingerprint": self.head.fingerprint(), "target_dtype": self.dtype,
                "capture": self.record, "aux_ids": self.aux_ids,
                "hidden": int(self.head.head.weight.shape[1]),
                "vocab": int(self.head.head.weight.shape[0]), "num_layers": self.head.num_layers}

    def capture(self, indices: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        from eyas.data.produce.engine_capture import sample_features, take_states
        out: dict[int, dict[str, torch.Tensor]] = {}
        indices = list(indices)
        for c in range(0, len(indices), self.batch_samples):
            chunk = indices[c:c + self.batch_samples]
            samples = {i: self.tokens.sample(i, fields=("input_ids", "loss_mask")) for i in chunk}
            files = self.source.capture([(i, samples[i]["input_ids"].tolist()) for i in chunk])
            for i in chunk:
                states = take_states(files[i], f"sample {i} of {self.tokens_dir}, captured by "
                                               f"{self.where}")
                out[i] = sample_features(states, samples[i], self.head,
                                         name=f"{self.tokens_dir} sample {i}",
                                         n_aux=len(self.aux_ids), teacher=self.teacher,
                                         topk=self.topk)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.source.__exit__(*exc)
        finally:
            shutil.rmtree(self.storage, ignore_errors=True)


def open_capturer(kind: Capture | str, tokens, tokens_dir, target, *, storage: Path,
                  layers=None, teacher: str, topk: int, dtype: str, endpoint: str | None = None,
                  served_model: str | None = None, log_path: Path | None = None, **hf: Any):
    """The producer `kind` over the token dataset `tokens` (opened from `tokens_dir`).
    storage: where an engine writes its per-request files (removed on exit), log_path: its log
    (default: engine.log beside `storage`); hf: the
    transformers capturer's own keywords (device, device_map, max_memory, model,
    batch_tokens, pad_batches, row_chunk, vocab_chunk)."""
    kind = Capture(kind)
    if kind == Capture.hf:
        return HFCapturer(tokens, tokens_dir, target, layers=layers, teacher=teacher, topk=topk,
                          dtype=dtype, **hf)
    return EngineCapturer(tokens, tokens_dir, target, kind=kind, storage=storage, layers=layers,
                          teacher=teacher, topk=topk, dtype=dtype, endpoint=endpoint,
                          served_model=served_model, log_path=log_path)
