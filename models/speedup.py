"""Tokens/s with EAGLE-3 speculation against plain decoding, from acceptance and step costs.

One round at K draft tokens with C sequences in flight: the drafter runs K steps, the target
verifies K + 1 tokens per sequence in one forward, and a sequence gains τ(K) tokens on average,
τ(K) = 1 + a_1 + … + a_K, where a_j is the probability that draft j is accepted in a round
(drafts 1 … j all accepted: vLLM's `spec_decode_num_accepted_tokens_per_pos[j-1]` over its
drafts, eyas's `counts.accepted[j-1]` over its decode rounds). Without speculation one target
step gains one token per sequence, so

    speedup(K, C) = τ(K) · t_target(1, C) / (t_target(K + 1, C) + K · t_draft(C))

The costs come from a measurement (`MeasuredCosts`: an engine sweep, `eyas evaluate --engine
vllm --speedup …`) or, for a deployment not run yet, from `RooflineCosts`: bytes moved and
FLOPs of one step against the hardware's rates. Its assumptions: a step takes the longer of its
bytes over the memory bandwidth and its FLOPs over the peak, each at `efficiency`, plus a fixed
`layer_overhead_s` per layer (kernel launches, tensor-parallel all-reduces); weights are split
evenly over `gpus`; every step reads the weights it uses once — all dense weights, and of a
mixture-of-experts layer the experts its tokens route to, taken as uniform and independent
(E·(1 − (1 − k/E)^tokens) of E experts for top-k routing) — plus each sequence's KV cache.
That last term is why speculation costs a MoE target more than a dense one: verifying K + 1
tokens per sequence touches up to K + 1 times the experts one token does.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence


def tau(accepted: Sequence[float], k: int) -> float:
    """τ(K): 1 + the first K unconditional per-position acceptances (a_j, j = 1 … K)."""
    if k > len(accepted):
        raise ValueError(f"K={k}: acceptance is known for {len(accepted)} positions")
    return 1.0 + sum(accepted[:k])


def speedup(tau_k: float, k: int, t1: float, t_verify: float, t_draft: float) -> float:
    """Tokens/s with speculation over tokens/s without, at one concurrency (module docstring)."""
    return tau_k * t1 / (t_verify + k * t_draft)


@dataclass(frozen=True)
class Hardware:
    """One accelerator: dense bf16 FLOP/s, memory bandwidth (bytes/s), memory (bytes)."""

    name: str
    flops: float
    bandwidth: float
    memory: float


#: datasheet rates (dense bf16 tensor cores, HBM)
HARDWARE = {"h100": Hardware("H100 SXM", 989e12, 3.35e12, 80e9),
            "h200": Hardware("H200", 989e12, 4.8e12, 141e9),
            "b200": Hardware("B200", 2250e12, 8.0e12, 180e9)}


@dataclass(frozen=True)
class TargetShape:
    """What a target step moves and computes: dense parameters (read every step), routed
    expert parameters per expert and MoE layer, experts E and top-k, KV bytes per token."""

    dense_params: float
    expert_params: float = 0.0      # one expert of one layer
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0
    kv_bytes_per_token: float = 0.0
    layers: int = 1

    def active_params(self, tokens: int) -> float:
        """Parameters one forward over `tokens` tokens reads: dense + the experts routed to."""
        if not self.experts:
            return self.dense_params
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)
        return self.dense_params + self.moe_layers * touched * self.expert_params

    @classmethod
    def from_config(cls, cfg: dict[str, Any], kv_bytes: float = 2.0) -> "TargetShape":
        """From a Hugging Face text config: Llama/Qwen-style attention or DeepSeek's MLA,
        dense MLPs, DeepSeek-style MoE (routed + shared experts after `first_k_dense_replace`
        dense layers)."""
        H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
        attn, kv = _attention_params(cfg, kv_bytes)
        experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
        dense_mlp = 3 * H * cfg["intermediate_size"]
        embed = V * H * (1 if cfg.get("tie_word_embeddings") else 2)
        if not experts:
            return cls(dense_params=embed + L * (attn + dense_mlp), kv_bytes_per_token=L * kv,
                       layers=L)
        first = int(cfg.get("first_k_dense_replace", 0))
        moe_i = cfg["moe_intermediate_size"]
        shared = int(cfg.get("n_shared_experts") or 0) * 3 * H * moe_i
        dense = embed + L * attn + first * dense_mlp + (L - first) * (shared + experts * H)
        return cls(dense_params=dense, expert_params=3 * H * moe_i, moe_layers=L - first,
                   experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                   kv_bytes_per_token=L * kv, layers=L)


def _attention_params(cfg: dict[str, Any], kv_bytes: float) -> tuple[float, float]:
    """(attention parameters of one layer, KV-cache bytes per token of one layer)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):                                      # DeepSeek's MLA
        rope, nope, v = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        r, qr = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
        q = (H * qr + qr * nh * (nope + rope)) if qr else H * nh * (nope + rope)
        return q + H * (r + rope) + r * nh * (nope + v) + nh * v * H, (r + rope) * kv_bytes
    hd = cfg.get("head_dim") or H // nh
    nkv = cfg.get("num_key_value_heads") or nh
    return 2 * H * nh * hd + 2 * H * nkv * hd, 2 * nkv * hd * kv_bytes


@dataclass(frozen=True)
class RooflineCosts:
    """Step costs from bytes and FLOPs (module docstring), for `gpus` of `hardware`."""

    target: TargetShape
    drafter_params: float
    hardware: Hardware
    gpus: int = 1
    weight_bytes: float = 2.0       # bytes per parameter (bf16 2, fp8 1, int4 0.5)
    context: int = 2048             # tokens of KV cache each sequence reads per step
    efficiency: float = 0.6         # fraction of the datasheet rates a step reaches
    layer_overhead_s: float = 6e-5  # fixed time per layer and forward

    def _time(self, params: float, tokens: int, kv_tokens: int, layers: int) -> float:
        hw = self.hardware
        moved = params * self.weight_bytes + kv_tokens * self.target.kv_bytes_per_token
        rate = self.gpus * self.efficiency
        return max(moved / (hw.bandwidth * rate), 2 * params * tokens / (hw.flops * rate)) \
            + layers * self.layer_overhead_s

    def target_step(self, tokens_per_seq: int, concurrency: int) -> float:
        """Seconds of one target forward over `tokens_per_seq` tokens of each sequence."""
        n = tokens_per_seq * concurrency
        return self._time(self.target.active_params(n), n, concurrency * self.context,
                          self.target.layers)

    def draft_step(self, concurrency: int) -> float:
        """Seconds of one drafter step (its layer and lm_head; KV of its one layer ignored)."""
        return self._time(self.drafter_params, concurrency, 0, 1)

    def speedup(self, tau_k: float, k: int, concurrency: int) -> float:
        return speedup(tau_k, k, self.target_step(1, concurrency),
                       self.target_step(k + 1, concurrency), self.draft_step(concurrency))


@dataclass(frozen=True)
class MeasuredCosts:
    """Step costs read from an engine sweep at one concurrency: `t1`, seconds per target step
    without speculation (C / its tokens/s), and the round time fitted as `base + per_k · K`
    (least squares over the sweep's K; a round's time is C · seconds / drafts)."""

    concurrency: int
    t1: float
    base: float
    per_k: float

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, Any]]) -> "MeasuredCosts":
        """From the sweep rows of one concurrency (`k`, `seconds`, `drafts`, `concurrency`,
        `tokens_per_s_without_speculation`)."""
        c = rows[0]["concurrency"]
        ks = [r["k"] for r in rows]
        times = [c * r["seconds"] / r["drafts"] for r in rows]
        if len(set(ks)) < 2:
            raise ValueError(f"concurrency {c}: the round time is fitted over K, and the sweep "
                             f"has one K ({ks[0]}): sweep two or more (--speedup 1,3,5,7)")
        per_k, base = statistics.linear_regression(ks, times)
        return cls(c, c / rows[0]["tokens_per_s_without_speculation"], base, per_k)

    def speedup(self, tau_k: float, k: int) -> float:
        return tau_k * self.t1 / (self.base + self.per_k * k)
