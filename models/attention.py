"""Attention of the TTT unroll: the mask, a flex-attention path and an eager twin.

The query of row t at step k sees (the mask, defined here; the engines' KV cache holds the same
keys: models/serving/CONTRACT.md §4)
  * the step-0 keys of rows s <= t of the same document (the accepted prefix), and
  * the keys of row t itself at steps 1..k (the chain drafted so far: the "diagonal").
Over a KV of length T·(k+1) laid out step-major ([K_0 | K_1 | … | K_k]) that is the boolean
`ttt_mask(doc_ids, k)`; padding rows (doc -1) are treated as one more document so that no row is
ever fully masked (they are invalid rows, so what they compute is never used).

Two implementations, chosen by name (`ATTENTION_KINDS`):

"flex"  (training on GPU) — splits each step into
            out0, lse0 = flex_attention(q_k, K_0, V_0, step-0 BlockMask)     # causal + document
            s_j        = q_k · K_j[t] · scale           for j = 1..k              # k dot products
            out        = (e^{lse0}·out0 + Σ_j e^{s_j}·V_j[t]) / (e^{lse0} + Σ_j e^{s_j})   # fp32
        The step-0 BlockMask is built ONCE per batch and reused for all K steps (its key set never
        changes); the diagonal costs k·T·heads·d multiply-adds instead of k extra 128×128 blocks per
        row block, and nothing of length T·(k+1) is concatenated or saved for backward. Gradients
        flow through both `out0` and `lse0` (flex supports a gradient on its logsumexp).
        torch has no flex backward on CPU: use "eager" to train there.
"eager" (reference, CPU) — one softmax over the concatenated keys [K_0 | … | K_k] with the dense
        `ttt_mask`, in fp32. O(T²·k) memory: for tests and small CPU runs.
"lse-eager" — the "flex" decomposition with the step-0 part computed densely (out0, lse0 in
        fp32). It is how the merge and its gradients are checked on CPU, where flex has no backward.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch
from torch import Tensor

try:  # torch >= 2.9 spells the lse request this way; older versions use return_lse=True
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

ATTENTION_KINDS = ("flex", "eager", "lse-eager")

_COMPILED: dict[Callable, Callable] = {}


def compiled(fn: Callable, *, dynamic: bool | None = None, recompile_limit: int = 0) -> Callable:
    """torch.compile(fn, dynamic=dynamic), one per function for the whole process. dynamic=None:
    static shapes for the first batch length T, then a symbolic T (torch's automatic dynamic
    shapes: one more compile, not one per length). recompile_limit: dynamo's limit of graphs
    per function, raised to at least this for the calls of fn only (a patch around each call)."""
    if fn not in _COMPILED:
        c = torch.compile(fn, dynamic=dynamic)
        limit = max(torch._dynamo.config.recompile_limit, recompile_limit)
        _COMPILED[fn] = c if not recompile_limit else torch._dynamo.config.patch(
            recompile_limit=limit)(c)
    return _COMPILED[fn]


# ---------------------------------------------------------------------- the mask (definition)
def step0_mask(doc_ids: Tensor) -> Tensor:
    """[T, T] bool: query row q sees step-0 key row kv iff kv <= q and both are in the same document."""
    T = doc_ids.shape[0]
    idx = torch.arange(T, device=doc_ids.device)
    return (idx[None, :] <= idx[:, None]) & (doc_ids[None, :] == doc_ids[:, None])


def ttt_mask(doc_ids: Tensor, step: int) -> Tensor:
    """[T, T·(step+1)] bool: what the queries of step `step` see in the KV [K_0 | K_1 | … | K_step]."""
    T = doc_ids.shape[0]
    eye = torch.eye(T, dtype=torch.bool, device=doc_ids.device)
    return torch.cat([step0_mask(doc_ids)] + [eye] * step, dim=1)


def step0_block_mask(doc_ids: Tensor, block_size: int = 128):
    """flex-attention BlockMask of `step0_mask` (shared by all heads; built once per batch).

    Built from per-block document ranges in a dozen small tensor ops instead of
    `create_block_mask`, which evaluates the mask at all T² points under vmap and costs ~2 ms
    of host time per call at T = 4096, at the start of every step. A block (q block i, kv block
    j <= i) is *full* when every row of both blocks is in one document, *partial* (the mask is
    evaluated inside it) when their document-id ranges overlap, and skipped otherwise. Any key
    a query may see lies in an overlapping block, so the result is exact for any doc_ids; for
    packed documents (each id one contiguous run, padding at the end) it lists the same blocks
    as `create_block_mask` (`reference_block_mask`) when T is a multiple of the block size
    (otherwise the last row block may be listed as full where that one lists it partial)."""
    from torch.nn.attention.flex_attention import BlockMask

    doc = doc_ids
    T = doc.shape[0]
    nb = -(-T // block_size)
    # padding rows (-1) sort last, as at the end of a packed row, so their block's range does
    # not reach back over every earlier document (a renaming: exactness is unchanged)
    ranked = torch.where(doc < 0, torch.iinfo(doc.dtype).max, doc)
    padded = torch.cat([ranked, ranked[-1:].expand(nb * block_size - T)]).view(nb, block_size)
    lo, hi = padded.amin(dim=1), padded.amax(dim=1)
    idx = torch.arange(nb, device=doc.device)
    below = idx[None, :] <= idx[:, None]                                   # kv block j <= q block i
    overlap = below & (lo[None, :] <= hi[:, None]) & (lo[:, None] <= hi[None, :])
    one_doc = lo == hi
    full = (idx[None, :] < idx[:, None]) & one_doc[:, None] & one_doc[None, :] \
        & (lo[:, None] == lo[None, :])
    partial = overlap & ~full

    def ordered(dense: Tensor) -> tuple[Tensor, Tensor]:     # as create_block_mask orders them
        num = dense.sum(dim=-1, dtype=torch.int32)[None, None]
        order = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
        return num, order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size,
                                    mask_mod=_causal_document(doc), seq_lengths=(T, T))


def reference_block_mask(doc_ids: Tensor, block_size: int = 128):
    """`step0_block_mask` through flex attention's own `create_block_mask` (the T² evaluation)."""
    from torch.nn.attention.flex_attention import create_block_mask

    T = doc_ids.shape[0]
    return create_block_mask(_causal_document(doc_ids), None, None, T, T, device=doc_ids.device,
                             BLOCK_SIZE=block_size)


def _causal_document(doc: Tensor) -> Callable:
    """flex mask_mod of `step0_mask`: the key is not after the query, in the same document."""
    def causal_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])
    return causal_document


# ---------------------------------------------------------------------- step-0 kernels: (out, lse)
def _flex_fn(compile_flex: bool, on_cuda: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    if not (compile_flex and on_cuda):
        return flex_attention  # CPU: the unfused implementation (same math)
    return compiled(flex_attention, dynamic=False)


def flex_step0(q: Tensor, k0: Tensor, v0: Tensor, block_mask, scale: float,
               compile_flex: bool = True) -> tuple[Tensor, Tensor]:
    """Attention of queries q [nh,T,d] over step-0 keys/values [nkv,T,d] → (out [nh,T,d], lse [nh,T] fp32)."""
    fn = _flex_fn(compile_flex, q.is_cuda)
    args = (q.unsqueeze(0), k0.unsqueeze(0), v0.unsqueeze(0))          # [1, heads, T, d]
    gqa = q.shape[0] != k0.shape[0]
    with warnings.catch_warnings():  # uncompiled (CPU) flex warns that it is unfused: intended here
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        if AuxRequest is not None:
            out, aux = fn(*args, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                          return_aux=AuxRequest(lse=True))
            lse = aux.lse
        else:  # pragma: no cover
            out, lse = fn(*args, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                          return_lse=True)
    return out[0], lse[0].float()


def dense_step0(q: Tensor, k0: Tensor, v0: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Eager twin of `flex_step0` (mask = `step0_mask`): (out [nh,T,d] fp32, lse [nh,T] fp32)."""
    nkv, T, d = k0.shape
    g = q.shape[0] // nkv
    qf = q.float().view(nkv, g, T, d)
    scores = torch.einsum("ngtd,nsd->ngts", qf, k0.float()) * scale      # [nkv, g, T, T]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                 # [nkv, g, T]
    out = torch.einsum("ngts,nsd->ngtd", torch.exp(scores - lse[..., None]), v0.float())
    return out.reshape(nkv * g, T, d), lse.reshape(nkv * g, T)


def merge_lists(out0: Tensor, lse0: Tensor, q: Tensor, ks: list[Tensor], vs: list[Tensor],
                scale: float) -> Tensor:
    """Add the diagonal keys of steps 1..k to a step-0 attention result by log-sum-exp (fp32).

    out0 [nh,T,d], lse0 [nh,T]: attention over the step-0 keys; q [nh,T,d]; ks, vs: k >= 1
    tensors [nkv,T,d] (row t's own keys at steps 1..k). Returns out [nh,T,d] fp32.

    Written as products and sums over d (no einsum): compiled, the whole merge is element-wise
    work plus small reductions that fuse into a few kernels, and its backward keeps only the
    bf16 inputs (already alive for the other steps), not stacked or fp32 copies of them."""
    nkv, T, d = ks[0].shape
    g = q.shape[0] // nkv
    qf = q.float().view(nkv, g, T, d)
    s = [(qf * k.float().view(nkv, 1, T, d)).sum(-1) * scale for k in ks]   # k × [nkv, g, T]
    l0 = lse0.float().view(nkv, g, T)
    lse = torch.logsumexp(torch.stack([l0] + s), dim=0)                      # [nkv, g, T]
    out = torch.exp(l0 - lse)[..., None] * out0.float().view(nkv, g, T, d)
    for sj, v in zip(s, vs):
        out = out + torch.exp(sj - lse)[..., None] * v.float().view(nkv, 1, T, d)
    return out.reshape(nkv * g, T, d)


def _merge_and_cast(out0: Tensor, lse0: Tensor, q: Tensor, ks: list[Tensor], vs: list[Tensor],
                    scale: float) -> Tensor:
    return merge_lists(out0, lse0, q, ks, vs, scale).to(q.dtype)


def compiled_merge() -> Callable:
    """torch.compile of the merge (+ cast to q's dtype): one graph per step k (list length)."""
    # K - 1 list lengths, each static and then symbolic in T: more than dynamo's default
    # eight entries per function when K = 7 and batch lengths vary
    return compiled(_merge_and_cast, recompile_limit=32)


def eager_ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], mask: Tensor,
                        scale: float) -> Tensor:
    """One fp32 softmax over [K_0 | … | K_k] (each [nkv,T,d]) with mask [T, T·(k+1)] → [nh,T,d] fp32."""
    nkv, T, d = keys[0].shape
    g = q.shape[0] // nkv
    kk = torch.cat(keys, dim=1).float()                                   # [nkv, T(k+1), d]
    vv = torch.cat(values, dim=1).float()
    scores = torch.einsum("ngtd,nsd->ngts", q.float().view(nkv, g, T, d), kk) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("ngts,nsd->ngtd", probs, vv).reshape(nkv * g, T, d)


# ---------------------------------------------------------------------- per-batch state
class TTTAttention:
    """Attention state of one TTT unroll: built once per batch, called once per step in order.

    `__call__(q [nh,T,d], k [nkv,T,d], v [nkv,T,d])` at step s (0, 1, … in call order) stores
    the new keys (step 0: the prefix keys; later: row-local diagonal keys) and returns
    [nh,T,d] in q's dtype. RoPE must already be applied.
    """

    def __init__(self, doc_ids: Tensor, kind: str = "flex", *, head_dim: int,
                 compile_flex: bool = True, block_size: int = 128, compile_merge: bool = False):
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"attention={kind!r}; choose one of {ATTENTION_KINDS}")
        self.kind, self.doc_ids, self.compile_flex = kind, doc_ids, compile_flex
        self.compile_merge = compile_merge
        self.scale = 1.0 / math.sqrt(head_dim)
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.block_mask = step0_block_mask(doc_ids, block_size) if kind == "flex" else None
        self.mask0 = step0_mask(doc_ids) if kind != "flex" else None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.keys.append(k)
        self.values.append(v)
        step = len(self.keys) - 1
        if self.kind == "eager":
            mask = torch.cat([self.mask0] + [torch.eye(q.shape[1], dtype=torch.bool,
                                                       device=q.device)] * step, dim=1)
            return eager_ttt_attention(q, self.keys, self.values, mask, self.scale).to(q.dtype)
        if self.kind == "flex":
            if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
                raise NotImplementedError(
                    "torch's flex_attention has no backward on CPU; train on CPU with "
                    "attention='eager' (same math) or run the flex path under torch.no_grad()")
            out0, lse0 = flex_step0(q, self.keys[0], self.values[0], self.block_mask,
                                    self.scale, self.compile_flex)
        else:
            out0, lse0 = dense_step0(q, self.keys[0], self.values[0], self.mask0, self.scale)
        if step == 0:                                # no diagonal yet: out0 is the attention
            return out0.to(q.dtype)
        merge = compiled_merge() if self.compile_merge else merge_lists   # compiled: fused, cast
        return merge(out0, lse0, q, self.keys[1:], self.values[1:], self.scale).to(q.dtype)
