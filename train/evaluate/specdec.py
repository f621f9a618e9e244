"""Real speculative decoding with an exported EAGLE-3 drafter: greedy chains verified by the target.

The target is a transformers causal LM; the drafter is the EXPORTED directory loaded the way vLLM
loads it (`models.serving.reference.EngineDrafter`: layout-A names, d2t scatter, the target's embedding).
Batch size 1, one sequence at a time, each with its own KV caches. One request runs:

    prefill   target over the prompt x_0..x_{P-1}            → aux[0..P-1], bonus x_P = argmax
    round     drafter step 0 over the rows the target just processed: row i = (aux[i], x_{i+1}, i)
              (the first round: every prompt row; later: the accepted rows of the last verify)
              K-1 more draft steps from the last row: g = previous PRE-norm output, token = the
              previous draft, position + 1                  → drafts d_1..d_K (target ids)
              target over [x_L, d_1..d_K] at positions L..L+K (x_L = last committed token)
                                                           → argmax y_0..y_K, aux of those rows
              accept n = the longest prefix with d_j == y_{j-1}; emit d_1..d_n and the bonus y_n
              target KV cache: drop the K-n rejected rows; drafter KV cache: its draft entries
              were already rolled back, and the next round's step 0 adds rows L..L+n with the
              target's new aux states paired with x_{L+1}..x_{L+n+1}
              (models/serving/CONTRACT.md §4)

At temperature T > 0 the round is the engines' speculative sampling instead
(`train.evaluate.sampling`), seeded by a `torch.Generator` per request. At T = 0 every emitted
token is a target argmax, so the output equals target-only greedy decoding up to floating
point: a multi-token verify forward and a one-token decode forward use different kernels, and
in bf16 a near-tie can flip (`greedy_decode` records each step's top-2 logit gap so a
divergence can be attributed). In fp32 the sequences are identical.

τ is counted the way the serving engines count their acceptance length:
  * vLLM (v1 `vllm/v1/spec_decode/metrics.py`): each verification step of a request with drafts
    adds 1 to `num_drafts`, its drafted tokens to `num_draft_tokens` and its accepted drafts
    (sampled tokens of the step − 1, counted by the scheduler before stop strings, EOS and
    max_tokens cut the output) to `num_accepted_tokens`, and position i < n to
    `num_accepted_tokens_per_pos[i]`. "Mean acceptance length" = 1 + num_accepted_tokens /
    num_drafts (the 1 is the bonus token); per-position acceptance rate =
    num_accepted_tokens_per_pos[i] / num_drafts; draft acceptance rate = accepted / drafted.
  * SGLang (scheduler `update_spec_metrics`): each verify forward of a batch of bs requests adds
    the accepted drafts of all of them + bs to `spec_num_accepted_tokens` and bs to
    `spec_num_forward_ct`; "accept len" in the decode log, and `avg_spec_accept_length` of
    /get_server_info (over the server's lifetime), is their ratio: again 1 + accepted drafts
    per request verification step, before the output is cut at a stop token or max tokens.
So `tau` = 1 + Σ accepted drafts / rounds = 1 + `mean_accepted_drafts`. The tokens a round adds
to the output can be fewer (the last round is cut by the token cap or a stop token):
`tau_emitted` = emitted decode tokens / rounds keeps that figure.

The result keys (`cond_acc_{j}`, `alive_{j}`, `accepted_drafts_histogram`, `by_context`,
`tau_se`, ...; docs/acceptance.md) come from the `Decoded` counts of each request through
`train.evaluate.specdec_summary.summarize`. Draft position j = 0..K-1 is the TTT step k that
drafts it: `cond_acc_{j}` = accepted[j] / reached[j], the offline `cond_acc_{k}` measured on
real rounds; `alive_{j}` = accepted[j] / rounds (`alive(k, t)` of `models/metrics.py` averaged
over rounds), not the offline `acc_{k}`, which counts step k whether or not the earlier steps
were accepted."""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from eyas.train.evaluate import sampling
from eyas.models.serving.reference import EngineDrafter

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Loading


def drafter_aux_layer_ids(cfg: dict, num_target_layers: int) -> list[int]:
    """The aux layers (HF hidden_states ids) a layout-A config asks for, read as vLLM reads them:
    top-level `eagle_aux_hidden_state_layer_ids`, else SGLang's `eagle_config` ids + 1, else the
    engines' default (2, N//2, N-3)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(cfg.get("eagle_config"), dict):
        sg = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        ids = None if sg is None else [int(i) + 1 for i in sg]
    if ids is None:
        from eyas.data.common.targets import default_aux_layer_ids
        ids = default_aux_layer_ids(num_target_layers)
        log.warning("drafter config names no aux layer ids; using the engines' default %s", ids)
    ids = [int(i) for i in ids]
    if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"drafter aux layer ids {ids} do not fit a target with "
                         f"{num_target_layers} layers (need three HF hidden_states ids < N)")
    return ids


def load_engine_drafter(drafter_dir: str | Path, target_embedding: Tensor,
                        dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
                        ) -> tuple[EngineDrafter, dict]:
    """(EngineDrafter, config.json dict) of an exported drafter directory, loaded like vLLM.

    target_embedding: the target's input embedding [V, H]; device: where the drafter computes.
    Errors name the directory.
    """
    from eyas.models.serving.contract import TensorDir
    from eyas.models.serving.validate import served_config
    path = Path(drafter_dir)
    cfg = served_config(path)
    tdir = TensorDir(path)
    if not tdir.files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (an exported drafter holds "
                                f"model.safetensors or shards)")
    try:
        engine = EngineDrafter.from_tensors(cfg, tdir.load_all(), target_embedding, dtype=dtype,
                                            device=device)
    except ValueError as e:
        raise ValueError(f"{path}: the engines would not load this drafter: {e}") from None
    return engine, cfg


# ---------------------------------------------------------------------------------------------
# The target as a verifier


class TargetRunner:
    """A transformers causal LM run on one sequence with a KV cache; returns argmax (+ aux) rows.

    aux_layer_ids: HF hidden_states ids to capture (pre-hooks on those decoder layers, the same
    hooks `data.produce.extract` uses to build training data); None captures nothing (plain decoding).
    """

    def __init__(self, model, aux_layer_ids: list[int] | None = None):
        from eyas.data.common.capture import LayerHooks, find_text_model
        self.model = model
        self.text, layers, norm, self.head = find_text_model(model)
        self.capture = LayerHooks(layers, list(aux_layer_ids), norm) if aux_layer_ids else None
        self.device = self.head.weight.device
        self.cache = None
        self.forwards = 0
        # transformers 5.2x renamed the KV-cache argument (past_key_values -> cache); an unknown
        # name would be swallowed by **kwargs and silently decode without a cache
        params = inspect.signature(self.text.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def reset(self) -> None:
        """A new sequence (empty KV cache)."""
        from transformers import DynamicCache
        self.cache = DynamicCache(config=self.model.config)

    @property
    def length(self) -> int:
        """Positions held in the KV cache."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def crop(self, n: int) -> None:
        """Drop the last n positions of the KV cache (rejected drafts)."""
        if n > 0:
            self.cache.crop(-n)

    @torch.inference_mode()
    def forward(self, tokens: list[int], *, last_only: bool = False, all_logits: bool = False
                ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Process `tokens` at the next positions. Returns (argmax [n] int64 CPU, aux [n, 3·tH]
        or None, logits of the last row [V] fp32, or of every row [n, V] with all_logits);
        last_only computes the head on that row only."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.text(input_ids=ids, use_cache=True, **{self._cache_arg: self.cache})
        self.forwards += 1
        h = out.last_hidden_state[0]                                      # [n, tH] post-norm
        logits = self.head(h[-1:] if last_only else h).float()            # [n or 1, V]
        aux = None
        if self.capture is not None:
            aux = torch.cat([self.capture.aux[k][0] for k in self.capture.aux_ids], dim=-1)
            self.capture.aux.clear()
        return logits.argmax(-1).cpu(), aux, logits.cpu() if all_logits else logits[-1]

    def close(self) -> None:
        if self.capture is not None:
            self.capture.remove()


# ---------------------------------------------------------------------------------------------
# Decoding


@dataclass
class Decoded:
    """One request's output and counts."""

    tokens: list[int]                        # generated ids (stop token included, if hit)
    seconds: float                           # wall time: prefill + decode
    cpu_seconds: float                       # process CPU time over the same span
    target_forwards: int                     # prefill included
    rounds: int = 0                          # decode forwards of the target (= verify forwards)
    decode_tokens: int = 0                   # tokens emitted by decode rounds (all but the first)
    reached: list[int] = field(default_factory=list)    # [K] rounds whose draft j was verified
    accepted: list[int] = field(default_factory=list)   # [K] rounds that accepted draft j
    histogram: list[int] = field(default_factory=list)  # [K+1] rounds that accepted n drafts
    # per round: (verified position L, accepted drafts n, tokens emitted)
    round_log: list[tuple[int, int, int]] = field(default_factory=list)
    drafter_forwards: int = 0
    top2_gap: list[float] = field(default_factory=list)  # greedy only: logit gap per token
    prefill_seconds: float = 0.0             # wall time to the first token (the prompt forward)
    target_seconds: float = 0.0              # in the target's decode forwards (after the prefill)
    draft_seconds: float = 0.0               # in the drafter's forwards (K per round)


def _finish(out: list[int], new: list[int], max_new: int, stop: set[int]) -> tuple[int, bool]:
    """Append `new` to `out`, cut at max_new and after a stop token. (appended, finished)."""
    n = 0
    for t in new:
        if len(out) >= max_new:
            return n, True
        out.append(t)
        n += 1
        if t in stop:
            return n, True
    return n, len(out) >= max_new


def greedy_decode(target: TargetRunner, prompt: list[int], *, max_new_tokens: int,
                  stop_ids: set[int], temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> Decoded:
    """Target-only decoding, one token per forward (the reference and the baseline): greedy,
    or with temperature > 0 sampled from softmax(logits / T) with `generator`."""
    if not prompt:
        raise ValueError("empty prompt: nothing to condition on")
    t0, c0 = time.perf_counter(), time.process_time()
    target.reset()
    start = target.forwards
    arg, _, logits = target.forward(prompt, last_only=True)
    out: list[int] = []
    gaps = [float(torch.topk(logits, 2).values.diff().abs())]
    _, done = _finish(out, [_next(arg, logits, temperature, generator)], max_new_tokens, stop_ids)
    prefill, stepping = time.perf_counter() - t0, 0.0
    while not done:
        t = time.perf_counter()
        arg, _, logits = target.forward(out[-1:], last_only=True)      # synchronised: CPU argmax
        stepping += time.perf_counter() - t
        gaps.append(float(torch.topk(logits, 2).values.diff().abs()))
        _, done = _finish(out, [_next(arg, logits, temperature, generator)], max_new_tokens,
                          stop_ids)
    return Decoded(out, time.perf_counter() - t0, time.process_time() - c0,
                   target.forwards - start, top2_gap=gaps, prefill_seconds=prefill,
                   target_seconds=stepping)


def _next(arg: Tensor, logits: Tensor, temperature: float, generator) -> int:
    """The target's next token: the argmax (T = 0) or a sample at temperature T."""
    if temperature == 0:
        return int(arg[-1])
    return int(sampling.sample(sampling.probs(logits.cpu(), temperature), generator))


def _round(target: TargetRunner, drafter: EngineDrafter, res: Decoded, seq: list[int],
           aux: Tensor, row0: int, *, k: int, max_new_tokens: int, stop_ids: set[int],
           temperature: float, draft: str, generator) -> tuple[bool, Tensor, int]:
    """One speculation round: the drafter takes in the newly verified rows (aux from row0) and
    proposes K tokens, the target verifies them in one forward, the accepted tokens and one of
    the target's are appended to `seq` and `res`. Returns (finished, aux of the rows now
    verified, their first position)."""
    sampled = temperature > 0
    # drafter step 0 over the newly verified rows: (aux[i], x_{i+1}, position i)
    t = time.perf_counter()
    n = aux.shape[0]
    pos = torch.arange(row0, row0 + n)
    nxt = torch.tensor(seq[row0 + 1:row0 + n + 1])
    prenorm, logits = drafter.prefill(aux, nxt, pos)        # moved to the drafter's device
    if sampled:
        drafts, q = sampling.draft_chain(drafter, prenorm[-1], logits[-1], row0 + n - 1, k,
                                         temperature=temperature, draft=draft,
                                         generator=generator)
    else:
        drafts = drafter.greedy_chain(prenorm[-1], logits[-1], row0 + n - 1, k).tolist()
    res.drafter_forwards += k
    res.draft_seconds += time.perf_counter() - t                    # the drafts are on the CPU
    # verify: the last committed token and the K drafts, at positions L..L+K
    L = len(seq) - 1
    if target.length != L:
        raise RuntimeError(f"target KV cache holds {target.length} positions, expected {L}")
    t = time.perf_counter()
    y, aux_v, v_logits = target.forward([seq[-1]] + drafts, all_logits=sampled)  # y [K+1]
    res.target_seconds += time.perf_counter() - t
    res.rounds += 1
    if sampled:
        acc, emitted = sampling.verify(drafts, q, sampling.probs(v_logits, temperature),
                                       generator)
    else:
        acc = 0
        while acc < k and drafts[acc] == int(y[acc]):
            acc += 1
        emitted = drafts[:acc] + [int(y[acc])]
    for j in range(min(acc + 1, k)):
        res.reached[j] += 1
        res.accepted[j] += j < acc
    res.histogram[acc] += 1
    target.crop(k - acc)
    n_new, done = _finish(res.tokens, emitted, max_new_tokens, stop_ids)
    res.decode_tokens += n_new
    res.round_log.append((L, acc, n_new))
    seq += emitted[:n_new]
    return done, aux_v[:acc + 1], L                                  # rows L..L+acc verified


def speculative_decode(target: TargetRunner, drafter: EngineDrafter, prompt: list[int], *, k: int,
                       max_new_tokens: int, stop_ids: set[int], temperature: float = 0.0,
                       draft: str = "argmax", generator: torch.Generator | None = None
                       ) -> Decoded:
    """Chain speculation with K drafts per round (see the module docstring): greedy at
    temperature 0; at T > 0 the engines' rejection sampling (`train.evaluate.sampling`,
    draft "argmax" or "sample"), seeded by `generator`."""
    if k < 1:
        raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
    if not prompt:
        raise ValueError("empty prompt: nothing to condition on")
    if target.capture is None:
        raise ValueError("the target runner captures no aux states: build it with the "
                         "drafter's aux layer ids")
    t0, c0 = time.perf_counter(), time.process_time()
    target.reset()
    drafter.reset()
    start = target.forwards
    res = Decoded([], 0.0, 0.0, 0, reached=[0] * k, accepted=[0] * k, histogram=[0] * (k + 1))
    sampling.check_sampling(temperature, draft)
    sampled = temperature > 0
    if sampled and generator is None:
        raise ValueError("sampling at temperature > 0 needs a seeded torch.Generator")
    arg, aux, last = target.forward(prompt, last_only=True)               # aux [P, 3·tH]
    seq = list(prompt)
    _, done = _finish(res.tokens, [_next(arg, last, temperature, generator)], max_new_tokens,
                      stop_ids)
    seq += res.tokens
    res.prefill_seconds = time.perf_counter() - t0
    row0 = 0                                  # first position whose aux the drafter has not seen
    while not done:
        done, aux, row0 = _round(target, drafter, res, seq, aux, row0, k=k,
                                 max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                 temperature=temperature, draft=draft, generator=generator)
    res.seconds, res.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    res.target_forwards = target.forwards - start
    return res


# ---------------------------------------------------------------------------------------------
# Many prompts: spec vs target-only, token identity, aggregate figures


def stop_token_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids: the generation config's and the tokenizer's."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = set() if ids is None else {ids} if isinstance(ids, int) else set(ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def decode_prompts(model, drafter: EngineDrafter, drafter_cfg: dict, prompts: list[list[int]], *,
                   k: int, max_new_tokens: int, stop_ids: set[int], names: list[str] | None = None,
                   progress: bool = True, temperature: float = 0.0, draft: str = "argmax",
                   seed: int = 0) -> list[tuple[str, Decoded, Decoded]]:
    """Decode every prompt twice, interleaved: target-only, then speculative (greedy, or at
    temperature > 0 sampled; prompt i's two runs use generators seeded seed + i).

    prompts: token id lists (chat template already applied). Returns [(name, greedy, spec)].
    A short warm-up of both paths runs first (first calls allocate and pick kernels).
    """
    from eyas.data.common.utils import progress as bar
    n_layers = int(model.config.get_text_config().num_hidden_layers)
    aux_ids = drafter_aux_layer_ids(drafter_cfg, n_layers)
    plain, verifier = TargetRunner(model), TargetRunner(model, aux_ids)
    names = names or [str(i) for i in range(len(prompts))]
    try:
        warm = prompts[0][: min(8, len(prompts[0]))]
        sample = dict(temperature=temperature)
        gen = (lambda i: {"generator": torch.Generator().manual_seed(seed + i)}) \
            if temperature > 0 else (lambda i: {})
        greedy_decode(plain, warm, max_new_tokens=2, stop_ids=set(), **sample, **gen(0))
        speculative_decode(verifier, drafter, warm, k=k, max_new_tokens=2, stop_ids=set(),
                           draft=draft, **sample, **gen(0))
        pairs, every = [], max(1, len(prompts) // 8)
        for i, (name, prompt) in enumerate(bar(list(zip(names, prompts)), desc="specdec",
                                               unit="prompt", disable=None if progress else True)):
            base = greedy_decode(plain, prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                 **sample, **gen(i))
            spec = speculative_decode(verifier, drafter, prompt, k=k, draft=draft,
                                      max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                      **sample, **gen(i))
            pairs.append((name, base, spec))
            if progress and len(pairs) % every == 0:     # a log line too: bars are off in logs
                done = [s for _, _, s in pairs]
                log.info("specdec: %d/%d prompts, %d tokens, tau so far %.3f", len(pairs),
                         len(prompts), sum(len(s.tokens) for s in done),
                         1 + sum(sum(s.accepted) for s in done)
                         / max(1, sum(s.rounds for s in done)))
    finally:
        plain.close()
        verifier.close()
    return pairs
