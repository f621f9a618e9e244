"""Reading what EAGLE-3 needs out of one target forward, without materialising logits.

- ``find_text_model``: the decoder stack of a causal LM — the module that owns
  ``embed_tokens``, a ``layers`` ModuleList and a final ``norm`` (Llama, Qwen, DeepSeek-V3/Kimi
  MLA+MoE, and multimodal wrappers whose text model sits under ``language_model``).
- ``Capture``: forward pre-hooks on the aux layers (HF ``hidden_states[k]``: the residual
  stream ENTERING decoder layer k, no norm) and a forward hook on the final norm (what the
  ``lm_head`` consumes); ``output_hidden_states`` is never requested.
- ``chunked_argmax_topk``: the argmax (and top-k) of ``lm_head(h)`` over the full vocabulary in
  row and vocabulary chunks, so ``[T, V]`` logits never exist.

`data.extract` runs these over a token dataset; `models.serving.specdec` uses them while decoding.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

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
    from eyas.data.targets import AUX_IDS_RULE, aux_layer_ids_error, default_aux_layer_ids
    if layers is None:
        return default_aux_layer_ids(num_layers)
    ids = [int(x) for x in layers]
    why = aux_layer_ids_error(ids, num_layers)
    if why is not None:
        raise ExtractError(
            f"aux layer ids {ids} are invalid for a target with {num_layers} decoder layers: "
            f"{why}; expected {AUX_IDS_RULE} (the default is "
            f"{default_aux_layer_ids(num_layers)}); fix the override "
            f"(--layers a,b,c / target.aux_layer_ids)")
    return ids


class Capture:
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


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory, one copy per batch. From a GPU it lands in page-locked memory, which
    PyTorch's host allocator caches and hands out again: a fresh pageable buffer per batch
    costs a page fault per 4 KiB written (at a large target's ~0.5 GB of features per batch,
    a few times the copy itself)."""
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t)


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its weight's device, or, for a module accelerate offloads to
    the CPU under a device map (weights on the meta device, streamed in per forward), the
    device its hook runs it on."""
    hook = getattr(module, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    return next(module.parameters()).device


@torch.no_grad()
def run_batch(text: nn.Module, capture: Capture, head: nn.Module, batch: list[dict], *,
               teacher: str, topk: int, row_chunk: int, vocab_chunk: int,
               logit_tf: tuple) -> list[dict[str, torch.Tensor]]:
    """Forward one batch (right padded with id 0 if lengths differ); per sample its output
    fields as CPU tensors."""
    dev = execution_device(text.embed_tokens)
    lens = [int(s["input_ids"].shape[0]) for s in batch]
    L = max(lens)
    x = torch.zeros(len(batch), L, dtype=torch.long)
    mask = torch.zeros(len(batch), L, dtype=torch.long)
    for b, s in enumerate(batch):
        x[b, :lens[b]] = s["input_ids"]
        mask[b, :lens[b]] = 1
    # no mask when nothing is padded: the same kernels as a plain single-sample forward
    attn = mask.to(dev) if min(lens) < L else None
    text(input_ids=x.to(dev), attention_mask=attn, use_cache=False)
    last = capture.last                                                     # [B, L, tH]
    # under a device map the aux layers may sit on other devices than the final norm
    aux = torch.stack([capture.aux[k].to(last.device) for k in capture.aux_ids], dim=2)
    real = torch.cat([last[b, :n] for b, n in enumerate(lens)]).to(head.weight.device)
    arg, tids, tvals = chunked_argmax_topk(
        real, head, topk=topk if teacher != "last" else 0, row_chunk=row_chunk,
        vocab_chunk=vocab_chunk, logit_scale=logit_tf[0], softcap=logit_tf[1])
    aux, arg = to_host(aux), to_host(arg)
    last = to_host(last) if teacher in ("last", "both") else None
    if teacher in ("topk", "both"):
        tids, tvals = to_host(tids), to_host(tvals)
    out, r = [], 0
    for b, (s, n) in enumerate(zip(batch, lens)):
        o = {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"],
             "aux": aux[b, :n], "target_argmax": arg[r:r + n]}
        if last is not None:
            o["last"] = last[b, :n]
        if teacher in ("topk", "both"):
            o["topk_ids"], o["topk_logits"] = tids[r:r + n], tvals[r:r + n]
        out.append(o)
        r += n
    capture.aux.clear()
    capture.last = None
    return out
