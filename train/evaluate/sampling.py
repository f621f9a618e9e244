"""Speculative SAMPLING at temperature T > 0: the rejection rule of the engines, seeded.

A round verifies K drafts d_1..d_K with the target's distributions p_0..p_K at temperature T
(p_j = softmax(target logits / T) of the verify row that predicts draft j+1; p_K the bonus row):

    accept d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j))         (u ~ U[0,1): u < ratio)
    on the first rejection emit a token of the residual  max(0, p_{j-1} - q_j) / Σ (and stop)
    if all K are accepted, emit the bonus token sampled from p_K

Whatever q is, the emitted tokens are distributed exactly as sampling from the target alone
(Leviathan et al. 2023, Chen et al. 2023); q only changes how many drafts are accepted.

Two proposals q (`DRAFT_MODES`):
  * "argmax" (the default: what both engines serve by default). vLLM's EAGLE proposer drafts
    by argmax (`speculative_config.draft_sample_method`, default "greedy") and hands the
    rejection sampler no draft probabilities (`draft_probs=None`, the path it shares with
    n-gram drafting): q is then one-hot on the draft, so a draft is accepted with probability
    p(d) and a rejection resamples from p with d's mass removed. SGLang's chain
    (topk=1) proposes the drafter's top token too and verifies with
    `tree_speculative_sampling_target_only`, which is given all-zero draft probabilities: it
    accepts d when u <= p(d) (default thresholds 1) and, after a rejection, samples from the
    target's probabilities with the rejected token taken out, the same rule. Both apply the
    request's temperature (and top-k/top-p, which this module does not implement) to the
    TARGET logits only; the drafter's logits get no temperature.
  * "sample": drafts sampled from q = softmax(drafter logits / T) over the draft vocabulary
    (mapped to target ids, zero elsewhere): the textbook speculative sampling, and vLLM's
    `draft_sample_method: "probabilistic"`, whose proposer (`compute_probs_and_sample_next_token`)
    divides the draft logits by the request's temperature (no top-k/top-p), samples, and keeps
    those probabilities for the rejection sampler's `draft_probs` path.

Randomness: every call takes a `torch.Generator` and draws a fixed amount from it per round
(one multinomial per draft in "sample" mode, K uniforms, K residual draws and one bonus draw),
so a seed reproduces a run exactly. T = 0 never comes here: greedy decoding keeps its argmax
path (`train.evaluate.specdec`).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: how drafts are proposed at T > 0 (module docstring)
DRAFT_MODES = ("argmax", "sample")


def check_sampling(temperature: float, draft: str) -> None:
    """Refuse a temperature < 0 or an unknown draft mode, naming the value."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if draft not in DRAFT_MODES:
        raise ValueError(f"draft mode must be one of {list(DRAFT_MODES)}, got {draft!r}")


def probs(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / T) in fp32 over the last dim (−inf logits get probability 0)."""
    if temperature <= 0:
        raise ValueError(f"sampling needs a temperature > 0, got {temperature}")
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(p: Tensor, generator: torch.Generator) -> Tensor:
    """One token id per row of p [..., V] (int64 [...])."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])


def accept_or_resample(drafts: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                       generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The per-row rejection rule, vectorised over N independent rows.

    drafts [N] int64 target ids, draft_probs [N, V] (None: q one-hot on the draft, the
    engines' argmax proposal), target_probs [N, V]. Returns (accepted [N] bool, token [N]):
    the draft where accepted, else a sample of the normalised residual max(0, p − q).
    """
    n = drafts.shape[0]
    rows = torch.arange(n)
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    p_d = target_probs[rows, drafts].double()
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        residual = target_probs.clone()
        residual[rows, drafts] = 0.0
    else:
        q_d = draft_probs[rows, drafts].double()
        residual = (target_probs - draft_probs).clamp_min(0.0)
    accepted = (q_d > 0) & (u * q_d < p_d)
    # a row with no residual mass (p <= q everywhere, i.e. p == q) is always accepted; give
    # multinomial a valid row anyway so the draw count, and so the stream, stays fixed
    empty = residual.sum(-1) <= 0
    residual[empty] = target_probs[empty]
    resampled = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return accepted, torch.where(accepted, drafts, resampled)


def verify(drafts: list[int], draft_probs: Tensor | None, target_probs: Tensor,
           generator: torch.Generator) -> tuple[int, list[int]]:
    """One round: (drafts accepted n, emitted tokens d_1..d_n + one target token).

    drafts: K target ids; draft_probs [K, V] or None (argmax proposal); target_probs [K+1, V]
    (row j: the target at temperature T after the committed token and drafts 1..j).
    """
    k = len(drafts)
    accepted, tokens = accept_or_resample(torch.tensor(drafts, dtype=torch.long), draft_probs,
                                          target_probs[:k], generator)
    bonus = int(sample(target_probs[k], generator))
    rejected = (~accepted).nonzero()
    n = int(rejected[0]) if rejected.numel() else k
    return n, drafts[:n] + [int(tokens[n]) if n < k else bonus]


def draft_chain(drafter, prenorm: Tensor, logits: Tensor, position: int, num_steps: int, *,
                temperature: float, draft: str, generator: torch.Generator
                ) -> tuple[list[int], Tensor | None]:
    """K drafts from the drafter's last processed row: (target ids, q [K, V] or None).

    "argmax": the drafter's greedy chain (`EngineDrafter.greedy_chain`), q = None (one-hot);
    "sample": each draft sampled from softmax(logits / T) of its step (scattered to target
    ids, so ids outside the draft vocabulary have q = 0) and fed to the next step. The
    drafter's KV cache is rolled back afterwards either way.
    """
    if draft == "argmax":
        return drafter.greedy_chain(prenorm, logits, position, num_steps).tolist(), None
    start, out, qs = drafter.cache_len, [], []
    for i in range(num_steps):
        q = probs(logits.cpu(), temperature)           # the generator is a CPU one
        tok = int(sample(q, generator))
        out.append(tok)
        qs.append(q)
        if i + 1 < num_steps:
            prenorm, logits = drafter.step(prenorm, tok, position + 1 + i)
    drafter.truncate(start)
    return out, torch.stack(qs)


def round_lengths_se(histogram: list[int]) -> float:
    """Standard error of τ = mean(1 + accepted drafts) over rounds, from the histogram of
    accepted drafts per round (sample standard deviation / √rounds; NaN below 2 rounds)."""
    counts = torch.tensor(histogram, dtype=torch.float64)
    rounds = float(counts.sum())
    if rounds < 2:
        return float("nan")
    n = torch.arange(len(histogram), dtype=torch.float64)
    mean = float((counts * n).sum()) / rounds
    var = float((counts * (n - mean) ** 2).sum()) / (rounds - 1)
    return (var / rounds) ** 0.5
