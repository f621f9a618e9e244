"""The engine-math reference: an EAGLE-3 drafter run the way vLLM and SGLang run it.

Written independently of the training code (no import from models.drafter / attention / config):
it reads a layout-A config.json dict and the exported tensors by name, exactly as the engines do,
and decodes incrementally with a KV cache, computing models/serving/CONTRACT.md §4 (`prefill`
is step 0 over each processed position, `step` a chain step k ≥ 1; logits are scattered to [V],
-inf outside the draft vocabulary, as vLLM does) with the EAGLE-3.1 flags read from config.json
as both engines read them (vLLM 0.33, SGLang 0.5.23). With norm_output the "prenorm" that
prefill and step return is the final norm's output.

One `EngineDrafter` holds one sequence's KV cache, like one request in an engine: `prefill` and
`step` append to it, `truncate` rolls rejected draft entries back. `serve_packed` replays a packed
training batch through this loop (every start row, every draft step) for parity checks.
Users: tests of the training forward, the export validator, the offline speculative evaluator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from eyas.data.store.vocab_map import VocabMap
from eyas.models.serving.contract import expected_shapes, layout_tensors, norm_before_fc
from eyas.models.serving.engine_rope import EngineRope

#: the EAGLE-3.1 per-state aux norms (module docstring)
FC_NORM_TENSORS = tuple(f"fc_norm.{i}.weight" for i in range(3))


class EngineDrafter:
    """A layout-A drafter decoded the engines' way, one sequence at a time (see module docstring)."""

    def __init__(self, cfg: dict, tensors: dict[str, Tensor], embedding: Tensor,
                 dtype: torch.dtype, engine: str = "vllm", device: str | torch.device = "cpu"):
        self.dtype, self.device = dtype, torch.device(device)
        self.H = int(cfg["hidden_size"])
        self.nh, self.nkv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
        self.hd = int(cfg.get("head_dim") or self.H // self.nh)
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.V = int(cfg["vocab_size"])
        # weights rounded to the serving dtype, held in fp32: every GEMM below is fp32 math on
        # dtype values with the result rounded to dtype, which is what a bf16 cuBLAS GEMM does
        # (fp32 accumulation) and avoids slow bf16 GEMMs on CPU
        self.norm_before_fc = norm_before_fc(cfg)     # eagle_config's value first, as both read it
        self.fc_norm, self.norm_output = bool(cfg.get("fc_norm")), bool(cfg.get("norm_output"))
        keep = layout_tensors(cfg)
        self.w = {k: v.to(self.device).to(dtype).float() for k, v in tensors.items() if k in keep}
        self.Vd = self.w["lm_head.weight"].shape[0]
        d2t = tensors.get("d2t", torch.zeros(self.Vd, dtype=torch.long))
        self.target_ids = VocabMap.from_d2t(d2t.to(torch.long), self.V).target_ids.to(self.device)
        self.embedding = embedding.to(device=self.device, dtype=dtype)
        self.rope = EngineRope(cfg, self.hd, engine)   # engine: whose RoPE where they differ
        self.reset()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_tensors(cls, config_dict: dict, tensors: dict[str, Tensor], target_embedding: Tensor,
                     *, dtype: torch.dtype | None = None, engine: str = "vllm",
                     device: str | torch.device = "cpu") -> EngineDrafter:
        """Load like the engines: layout-A names, d2t offsets, the target's embedding.

        config_dict: the drafter's config.json; tensors: its safetensors by name (no `model.`
        prefix, `midlayer.` layer); target_embedding: the target's input embedding [V, H].
        dtype: compute dtype (default: that of fc.weight; engines serve bf16). engine: "vllm" or
        "sglang", whose RoPE to compute for the types where they differ (models/serving/engine_rope.py).
        device: where the weights, the KV cache and the math live (inputs are moved there;
        draft ids come back on the CPU).
        Raises ValueError naming the tensor/key for anything the engines would reject or
        silently mis-serve (unknown or missing names, wrong shapes, missing d2t with Vd < V).
        """
        cfg = config_dict
        if cfg.get("norm_before_residual"):
            raise ValueError("config.json norm_before_residual=true: SGLang does not implement it")
        for key in ("hidden_size", "target_hidden_size", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "vocab_size"):
            if cfg.get(key) is None:
                raise ValueError(f"config.json: {key!r} is missing or null; both engines need an int")
        names, wanted = set(tensors), layout_tensors(cfg)
        unknown = sorted(names - set(wanted) - {"d2t", "t2d"})
        if unknown:
            raise ValueError(f"tensors not in layout A: {unknown} (vLLM raises on unknown names "
                             f"or drops an EAGLE-3.1 norm its config does not turn on, SGLang "
                             f"drops them; embed_tokens must not be shipped)")
        missing = sorted(set(wanted) - names)
        if missing:
            raise ValueError(f"layout-A tensors missing: {missing}")
        H, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        Vd = int(cfg.get("draft_vocab_size") or V)
        shapes = expected_shapes(dict(cfg, draft_vocab_size=Vd))
        for name in wanted:
            shape = shapes[name]
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, "
                                 f"config.json implies {shape}")
        if tuple(target_embedding.shape) != (V, H):
            raise ValueError(f"target embedding {tuple(target_embedding.shape)} != (vocab_size, "
                             f"hidden_size) = {(V, H)}")
        if Vd < V:
            if "d2t" not in tensors:
                raise ValueError(f"draft_vocab_size {Vd} < vocab_size {V} but no d2t tensor: every "
                                 f"draft id would be read as target id i (acceptance collapses)")
            try:
                VocabMap.from_d2t(tensors["d2t"].to(torch.long).reshape(-1), V).validate(
                    draft_vocab_size=Vd)
            except ValueError as e:
                raise ValueError(f"d2t must be [draft_vocab_size] OFFSETS with i + d2t[i] "
                                 f"strictly increasing within [0, vocab_size): {e}") from None
        return cls(cfg, tensors, target_embedding, dtype or tensors["fc.weight"].dtype, engine,
                   device)

    # ------------------------------------------------------------------ cache
    def reset(self) -> None:
        """Empty the KV cache (a new sequence)."""
        self.k_cache = torch.zeros(0, self.nkv, self.hd, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(0, self.nkv, self.hd, dtype=self.dtype, device=self.device)

    @property
    def cache_len(self) -> int:
        return self.k_cache.shape[0]

    def truncate(self, n: int) -> None:
        """Keep the first n cache entries (roll back draft entries after verification)."""
        self.k_cache, self.v_cache = self.k_cache[:n], self.v_cache[:n]

    # ------------------------------------------------------------------ math
    def _norm(self, x: Tensor, name: str) -> Tensor:
        xf = x.float()
        y = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y.to(self.dtype).float() * self.w[name]).to(self.dtype)

    def _lin(self, x: Tensor, name: str) -> Tensor:
        return (x.float() @ self.w[name].T).to(self.dtype)

    def _scatter(self, draft_logits: Tensor) -> Tensor:
        """vLLM's mapping: [n, Vd] → [n, V], draft logit i at target id i + d2t[i], -inf elsewhere."""
        logits = torch.full((draft_logits.shape[0], self.V), float("-inf"), device=self.device)
        logits[:, self.target_ids] = draft_logits
        return logits

    def _layer(self, g: Tensor, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """n new rows: g [n, H], tokens [n] target ids, positions [n] → (prenorm [n,H], draft logits [n,Vd])."""
        n = g.shape[0]
        e = self._norm(self.embedding[tokens], "midlayer.input_layernorm.weight")
        x = torch.cat([e, self._norm(g, "midlayer.hidden_norm.weight")], dim=-1)   # [n, 2H]
        q = self._lin(x, "midlayer.self_attn.q_proj.weight").view(n, self.nh, self.hd)
        k = self._lin(x, "midlayer.self_attn.k_proj.weight").view(n, self.nkv, self.hd)
        v = self._lin(x, "midlayer.self_attn.v_proj.weight").view(n, self.nkv, self.hd)
        tables = self.rope.tables(positions, self.device)
        q, k = self.rope.rotate(q, tables), self.rope.rotate(k, tables)
        start = self.cache_len
        self.k_cache = torch.cat([self.k_cache, k])                       # [L+n, nkv, hd]
        self.v_cache = torch.cat([self.v_cache, v])
        rep = self.nh // self.nkv                                         # GQA: head h → kv h//rep
        keys = self.k_cache.repeat_interleave(rep, dim=1).float()         # [L+n, nh, hd]
        vals = self.v_cache.repeat_interleave(rep, dim=1).float()
        scores = q.float().transpose(0, 1) @ keys.permute(1, 2, 0) / math.sqrt(self.hd)  # [nh, n, L+n]
        allowed = (torch.arange(self.cache_len, device=self.device)[None, :]
                   <= (start + torch.arange(n, device=self.device))[:, None])
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        attn = (probs @ vals.transpose(0, 1)).transpose(0, 1).reshape(n, self.nh * self.hd)
        h = g + self._lin(attn.to(self.dtype), "midlayer.self_attn.o_proj.weight")
        m = self._norm(h, "midlayer.post_attention_layernorm.weight")
        act = torch.nn.functional.silu(self._lin(m, "midlayer.mlp.gate_proj.weight"))
        p = h + self._lin(act * self._lin(m, "midlayer.mlp.up_proj.weight"),
                          "midlayer.mlp.down_proj.weight")
        normed = self._norm(p, "norm.weight")
        carried = normed if self.norm_output else p       # what the next draft step is fed
        return carried, normed.float() @ self.w["lm_head.weight"].T                  # [n, Vd]

    # ------------------------------------------------------------------ public decoding API
    @torch.no_grad()
    def prefill(self, aux: Tensor, next_tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Step 0 over n newly processed target positions (appended to the cache).

        aux [n, 3·tH] (the target's [h_a|h_b|h_c] at those positions), next_tokens [n] (the token
        at position i+1 for each i), positions [n]. Returns (prenorm [n, H], logits [n, V] fp32).
        """
        x = aux.to(device=self.device, dtype=self.dtype)
        if self.norm_before_fc:                          # vLLM's / SGLang's order: whole row,
            x = self._norm(x, "input_norm.weight")
        if self.fc_norm:                                 # then each aux state
            x = torch.cat([self._norm(c, n) for c, n in zip(x.chunk(3, dim=-1), FC_NORM_TENSORS)],
                          dim=-1)
        p, draft = self._layer(self._lin(x, "fc.weight"), next_tokens.to(self.device).long(),
                               positions.long())
        return p, self._scatter(draft)

    @torch.no_grad()
    def step(self, prev_prenorm: Tensor, token: int | Tensor, position: int | Tensor
             ) -> tuple[Tensor, Tensor]:
        """One draft step: prev_prenorm [H], token (a TARGET id), position → (prenorm [H], logits [V])."""
        p, draft = self._layer(prev_prenorm.to(self.device, self.dtype).view(1, self.H),
                               torch.as_tensor(token, device=self.device).long().view(1),
                               torch.as_tensor(position).long().view(1))
        return p[0], self._scatter(draft)[0]

    def to_draft_vocab(self, logits: Tensor) -> Tensor:
        """Target-vocabulary logits [..., V] → the draft vocabulary's [..., Vd] (row i = id i+d2t[i])."""
        return logits[..., self.target_ids.to(logits.device)]

    def greedy_chain(self, prenorm: Tensor, logits: Tensor, position: int, num_steps: int,
                     *, keep_cache: bool = False) -> Tensor:
        """vLLM's greedy chain from the last processed row: num_steps target ids [num_steps].

        prenorm [H], logits [V], position: outputs/position of that row. The draft entries are
        removed from the cache afterwards unless keep_cache.
        """
        start, out = self.cache_len, []
        for i in range(num_steps):
            tok = torch.argmax(logits)               # stays on the device: no wait per step
            out.append(tok)
            if i + 1 < num_steps:
                prenorm, logits = self.step(prenorm, tok, position + 1 + i)
        if not keep_cache:
            self.truncate(start)
        return torch.stack(out).to("cpu", torch.long)

    def draft_chain(self, aux: Tensor, next_tokens: Tensor, positions: Tensor,
                    num_steps: int) -> Tensor:
        """New sequence: prefill a prefix, then draft num_steps tokens greedily after its last row."""
        self.reset()
        p, logits = self.prefill(aux, next_tokens, positions)
        return self.greedy_chain(p[-1], logits[-1], int(positions[-1]), num_steps)


def serve_packed(engine: EngineDrafter, input_ids: Tensor, aux: Tensor, doc_ids: Tensor,
                 positions: Tensor, ttt_steps: int) -> Tensor:
    """Replay a packed training batch through the serving loop, teacher-forced.

    For every document (contiguous run of one doc id >= 0) and every start row t whose next token
    is in the document: extend the prefix by row t (prefill), then take draft steps k = 1.. while
    token t+1+k is in the document, feeding input_ids[t+1+k] at position positions[t]+k, and roll
    the draft entries back. Returns draft-vocabulary logits [K, T, Vd] fp32, NaN where a (k, t)
    is never reached.
    """
    T = input_ids.shape[0]
    out = torch.full((ttt_steps, T, engine.Vd), float("nan"))
    t = 0
    while t < T:
        end = t
        while end + 1 < T and doc_ids[end + 1] == doc_ids[t]:
            end += 1
        if int(doc_ids[t]) >= 0:
            engine.reset()
            for s in range(t, end):                                       # rows with s+1 <= end
                p, logits = engine.prefill(aux[s:s + 1], input_ids[s + 1:s + 2], positions[s:s + 1])
                out[0, s] = engine.to_draft_vocab(logits[0])
                prefix, p = engine.cache_len, p[0]
                for k in range(1, min(ttt_steps, end - s)):              # needs s+1+k <= end
                    p, logits = engine.step(p, input_ids[s + 1 + k], positions[s] + k)
                    out[k, s] = engine.to_draft_vocab(logits)
                engine.truncate(prefix)
        t = end + 1
    return out
