"""Reading what EAGLE-3 needs out of one target forward, without materialising logits.

- ``find_text_model``: the decoder stack of a causal LM — the module that owns
  ``embed_tokens``, a ``layers`` ModuleList and a final ``norm`` (Llama, Qwen, DeepSeek-V3/Kimi
  MLA+MoE, and multimodal wrappers whose text model sits under ``language_model``).
- ``LayerHooks``: forward pre-hooks on the aux layers (HF ``hidden_states[k]``: the residual
  stream ENTERING decoder layer k, no norm) and a forward hook on the final norm (what the
  ``lm_head`` consumes); ``output_hidden_states`` is never requested.
- ``chunked_argmax_topk``: the argmax (and top-k) of ``lm_head(h)`` over the full vocabulary in
  row and vocabulary chunks, so ``[T, V]`` logits never exist.
- ``target_fingerprint``: a hash of a sample of the target's weights, recorded in the manifest so
  a dataset names the exact weights it came from (`eyas verify` compares it);
  ``files_fingerprint`` the same hash read from the checkpoint files (engine capture).

`data.produce.extract` runs these over a token dataset; `train.evaluate.specdec` uses them while decoding.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from eyas.data.common.targets import (AUX_IDS_RULE, WeightFiles, aux_layer_ids_error,
                                      default_aux_layer_ids)

log = logging.getLogger(__name__)


class ExtractError(ValueError):
    """A bad target, layer choice, dataset or output directory; the message says how to fix it."""


# ---------------------------------------------------------------------------------------------
# Finding the pieces of the target


def find_text_model(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module]:
    """(text model, its decoder layers, its final norm, the lm_head) of a causal LM.

    The text model is the module owning ``embed_tokens``, a ``layers`` ModuleList and ``norm``;
    when several qualify (multimodal wrappers), the one under ``language_model``/``text_model``.
    """
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(getattr(m, "layers", None), nn.ModuleList)
             and isinstance(getattr(m, "norm", None), nn.Module)
             and isinstance(getattr(m, "embed_tokens", None), nn.Module)]
    if len(found) > 1:
        text = [(n, m) for n, m in found if "language_model" in n or "text_model" in n]
        found = text or found
    if len(found) != 1:
        names = [n or "<root>" for n, _ in found]
        raise ExtractError(
            f"cannot find the decoder stack of {type(model).__name__}: expected exactly one "
            f"submodule with `embed_tokens`, a `layers` ModuleList and a final `norm`, found "
            f"{names or 'none'}")
    _, text = found[0]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(head, "weight"):
        raise ExtractError(f"{type(model).__name__} has no output embedding (lm_head) to compute "
                           f"the target's logits")
    return text, text.layers, text.norm, head


def check_aux_layers(layers: list[int] | tuple[int, ...] | None, num_layers: int) -> list[int]:
    """The aux layer ids (HF hidden_states indices): `layers` validated, or the default."""
    if layers is None:
        return default_aux_layer_ids(num_layers)
    ids = [int(x) for x in layers]
    why = aux_layer_ids_error(ids, num_layers)
    if why is not None:
        try:
            default = f"the default is {default_aux_layer_ids(num_layers)}"
        except ValueError:
            default = "a target this shallow has no default"
        raise ExtractError(
            f"aux layer ids {ids} are invalid for a target with {num_layers} decoder layers: "
            f"{why}; expected {AUX_IDS_RULE} ({default}); fix the override "
            f"(--layers a,b,c / target.aux_layer_ids)")
    return ids


class LayerHooks:
    """Forward hooks that keep the inputs of the aux layers and the output of the final norm."""

    def __init__(self, layers: nn.ModuleList, aux_ids: list[int], norm: nn.Module):
        self.aux: dict[int, torch.Tensor] = {}
        self.last: torch.Tensor | None = None
        self.handles = [layers[k].register_forward_pre_hook(self._pre(k), with_kwargs=True)
                        for k in aux_ids]
        self.handles.append(norm.register_forward_hook(self._norm))
        self.aux_ids = aux_ids

    def _pre(self, k: int):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self.aux[k] = h.detach().clone()        # [B, L, tH], the residual entering layer k
        return hook

    def _norm(self, module, args, output):
        self.last = (output[0] if isinstance(output, tuple) else output).detach()   # [B, L, tH]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def target_fingerprint(model: nn.Module, values: int = 64, read=None) -> str:
    """'sha256:<hex>' over every parameter's name, shape and first `values` values (as float32).

    Cheap for any size (a few KiB read per tensor, nothing moved but those values) and
    independent of the precision the target runs in when its checkpoint holds bf16 weights.
    Parameters on the meta device (offloaded) contribute their name and shape only, unless
    `read(name, p, values)` gives their first values (`files_fingerprint`).
    """
    import hashlib
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        h.update(f"{name}:{list(p.shape)};".encode())
        if p.device.type != "meta":
            h.update(p.detach().reshape(-1)[:values].float().cpu().numpy().tobytes())
        elif read is not None:
            h.update(read(name, p, values).float().numpy().tobytes())
    return "sha256:" + h.hexdigest()


def files_fingerprint(meta_model: nn.Module, weights: WeightFiles, values: int = 64
                      ) -> str | None:
    """`target_fingerprint` of the model a checkpoint loads into, read from its safetensors files:
    `meta_model` (built on the meta device in the dtype the target runs in) gives the names and
    shapes, the files the first values of each (the few rows that hold them). None when a
    parameter has no tensor of its name in the files (transformers converts some layouts on
    load, e.g. per-expert MoE weights into one fused tensor): the manifest then records none."""
    names = {n for n, _ in meta_model.named_parameters()}
    missing = sorted(names - set(weights.where))
    if missing:
        log.info("no weight fingerprint: %d parameter(s) have no tensor of their name in the "
                 "checkpoint (first: %s)", len(missing), missing[0])
        return None

    def read(name: str, p: torch.Tensor, n: int) -> torch.Tensor:
        rows = n if p.dim() < 2 else -(-n // max(1, p[0].numel()))
        return weights.first_rows(name, rows).to(p.dtype).reshape(-1)[:n]
    return target_fingerprint(meta_model, values, read)


# ---------------------------------------------------------------------------------------------
# Teacher: argmax (and top-k) over the full vocabulary without [T, V] logits


def logit_transform(config) -> tuple[float | None, float | None]:
    """(logit_scale, final_logit_softcapping) of a config (None where it has none)."""
    text = getattr(config, "get_text_config", lambda: config)()
    return getattr(text, "logit_scale", None), getattr(text, "final_logit_softcapping", None)


@torch.no_grad()
def chunked_argmax_topk(h: torch.Tensor, head: nn.Module, *, topk: int = 0,
                        row_chunk: int = 1024, vocab_chunk: int = 65536,
                        logit_scale: float | None = None, softcap: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """argmax [N] (and top-k ids [N, k] int64, logits [N, k] float32) of ``head(h)``, h [N, tH].

    Peak memory is row_chunk x vocab_chunk logits. Ties resolve to the lowest id, like
    ``logits.argmax(-1)``. With vocab_chunk >= V the head module itself is called.
    """
    W = head.weight                                   # [V, tH]
    bias = getattr(head, "bias", None)
    V = W.shape[0]
    arg = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
    ids = torch.empty(h.shape[0], topk, dtype=torch.long, device=h.device) if topk else None
    vals = torch.empty(h.shape[0], topk, dtype=torch.float32, device=h.device) if topk else None
    for r0 in range(0, h.shape[0], row_chunk):
        x = h[r0:r0 + row_chunk]
        best_v = best_i = top_v = top_i = None
        for v0 in range(0, V, vocab_chunk):
            if vocab_chunk >= V:
                logits = head(x)                                            # [n, V]
            else:
                logits = nn.functional.linear(
                    x, W[v0:v0 + vocab_chunk], None if bias is None else bias[v0:v0 + vocab_chunk])
            m, i = logits.max(dim=-1)                                       # first max in chunk
            i = i + v0
            if best_v is None:
                best_v, best_i = m, i
            else:
                better = m > best_v                         # strict: the lower id wins ties
                best_v, best_i = torch.where(better, m, best_v), torch.where(better, i, best_i)
            if topk:
                lf = logits.float()
                if logit_scale is not None:
                    lf = lf * logit_scale
                if softcap is not None:
                    lf = torch.tanh(lf / softcap) * softcap
                cv, ci = lf.topk(min(topk, lf.shape[-1]), dim=-1)
                ci = ci + v0
                if top_v is not None:
                    cv, j = torch.cat([top_v, cv], -1).topk(topk, dim=-1)
                    ci = torch.cat([top_i, ci], -1).gather(-1, j)
                top_v, top_i = cv, ci
        arg[r0:r0 + row_chunk] = best_i
        if topk:   # order: value descending, ties by ascending id (top-1 == argmax)
            o = top_i.argsort(dim=-1)
            top_v, top_i = top_v.gather(-1, o), top_i.gather(-1, o)
            o = top_v.argsort(dim=-1, descending=True, stable=True)
            vals[r0:r0 + row_chunk] = top_v.gather(-1, o)
            ids[r0:r0 + row_chunk] = top_i.gather(-1, o)
    return arg, ids, vals
