"""The forwards of an extraction: which samples go into which shard and which forward, and
one forward's captured fields per sample.

`data.produce.extract` runs them over a token dataset; `data.verify` re-runs samples through them and
`data.produce.estimate` times them, so all three capture exactly the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from eyas.data.common.capture import LayerHooks, ExtractError, chunked_argmax_topk

TEACHERS = ("last", "topk", "both")


def plan_shards(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """[[first, end), ...] sample ranges in dataset order, each about `shard_tokens` tokens."""
    ranges, start, acc = [], 0, 0
    for i, n in enumerate(lengths):
        if acc and acc + n > shard_tokens:
            ranges.append([start, i])
            start, acc = i, 0
        acc += int(n)
    if start < len(lengths):
        ranges.append([start, len(lengths)])
    return ranges


def length_groups(lengths: list[int], ids: list[int], batch_tokens: int,
                  pad: bool = False) -> list[list[int]]:
    """Sample ids grouped into forwards: longest first, B samples while B x longest <=
    batch_tokens; only samples of equal length share a forward unless `pad`."""
    order = sorted(ids, key=lambda i: -lengths[i])
    groups, k = [], 0
    while k < len(order):
        m, top = 1, lengths[order[k]]
        while (k + m < len(order) and (m + 1) * top <= batch_tokens
               and (pad or lengths[order[k + m]] == top)):
            m += 1
        groups.append(order[k:k + m])
        k += m
    return groups


def default_shard_tokens(hidden: int, aux_format: str, teacher: str, topk: int,
                         shard_bytes: int) -> int:
    """Tokens per shard when none is given: `shard_bytes` over a planning figure of the bytes
    per token (kept as it is so that existing plans resume; the exact figure is
    data.produce.estimate's)."""
    aux = 6 * hidden if aux_format == "bf16" else 3 * hidden + 12
    last = 2 * hidden if teacher in ("last", "both") else 0
    per = aux + last + 9 + (12 * topk if teacher in ("topk", "both") else 0)
    return max(1, shard_bytes // per)


#: the precisions a target can be extracted in (their names are recorded in the manifest)
DTYPES = ("bfloat16", "float32")


def load_model(target, dtype: str, device=None, device_map=None, max_memory: dict | None = None):
    """The target, in eval mode with frozen parameters, in `dtype` (one of DTYPES) on `device`
    (None: the first GPU if there is one, else the CPU), or spread by `device_map` ("auto", or
    module name -> device) within `max_memory`."""
    from eyas.data.common.targets import (TARGET_DTYPES, default_device, load_target,
                                          resolve_target)
    if dtype not in DTYPES:
        raise ExtractError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    if device_map is None:
        device = device or default_device()
        return load_target(target, dtype=TARGET_DTYPES[dtype], device=device)[0]
    from transformers import AutoModelForCausalLM

    from eyas.data.common.log import quiet_libraries
    quiet_libraries()
    model = AutoModelForCausalLM.from_pretrained(resolve_target(target),
                                                 dtype=TARGET_DTYPES[dtype],
                                                 device_map=device_map,
                                                 max_memory=max_memory).eval()
    return model.requires_grad_(False)


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
def run_batch(text: nn.Module, capture: LayerHooks, head: nn.Module, batch: list[dict], *,
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
