"""The evaluation record of many real speculative decodes: `summarize` aggregates the
(name, target-only, speculative) `Decoded` pairs of `train.evaluate.specdec.decode_prompts`
into the result keys of docs/acceptance.md (tau, tau_emitted, cond_acc_{j} and alive_{j} as
that module's docstring counts them, by_context, tau_se, tau_se_prompts, speed and token
identity)."""

from __future__ import annotations

from typing import Any

from eyas.models.context import DEFAULT_EDGES, ratio, rounds_table
from eyas.models.expected_tau import ratio_se_of
from eyas.train.evaluate import sampling


def _mismatches(pairs: list[tuple[str, Any, Any]]) -> list[dict]:
    """Per prompt whose speculative output differs from target-only greedy: the first index
    that differs, both tokens there and the target's top-2 logit gap at it."""
    out = []
    for name, b, s in pairs:
        if b.tokens != s.tokens:
            j = next((i for i, (x, y) in enumerate(zip(b.tokens, s.tokens)) if x != y),
                     min(len(b.tokens), len(s.tokens)))
            out.append({"prompt": name, "index": j,
                        "target_only": b.tokens[j] if j < len(b.tokens) else None,
                        "speculative": s.tokens[j] if j < len(s.tokens) else None,
                        "target_top2_logit_gap": b.top2_gap[j] if j < len(b.top2_gap) else None})
    return out


def summarize(pairs: list[tuple[str, Any, Any]], k: int, *,
              context_buckets=DEFAULT_EDGES, temperature: float = 0.0) -> dict:
    """The evaluation JSON fields of `pairs` (module docstring).

    At temperature > 0 both runs are samples: `tokens_identical` is None (not comparable token
    for token). `tau_se` is the standard error of τ over rounds either way; `tau_se_prompts` over
    prompts (rounds of one answer are not independent: the figure to compare with an offline
    estimate's `tau_trajectory_se`)."""
    rounds = sum(s.rounds for _, _, s in pairs)
    decode_tokens = sum(s.decode_tokens for _, _, s in pairs)
    reached = [sum(s.reached[j] for _, _, s in pairs) for j in range(k)]
    accepted = [sum(s.accepted[j] for _, _, s in pairs) for j in range(k)]
    histogram = [sum(s.histogram[j] for _, _, s in pairs) for j in range(k + 1)]
    gen = sum(len(s.tokens) for _, _, s in pairs)
    base_gen = sum(len(b.tokens) for _, b, _ in pairs)
    t_spec = sum(s.seconds for _, _, s in pairs)
    t_base = sum(b.seconds for _, b, _ in pairs)
    c_spec = sum(s.cpu_seconds for _, _, s in pairs)
    c_base = sum(b.cpu_seconds for _, b, _ in pairs)
    t_verify = sum(s.target_seconds for _, _, s in pairs)
    mismatches = _mismatches(pairs) if temperature == 0 else []
    spec_tps, base_tps = ratio(gen, t_spec), ratio(base_gen, t_base)
    return {
        "mode": "speculative", "k": k, "num_prompts": len(pairs),
        # the engines' acceptance length: 1 + accepted drafts per verification round
        "tau": 1 + ratio(sum(accepted), rounds),
        "tau_emitted": ratio(decode_tokens, rounds),
        **{f"cond_acc_{j}": ratio(a, r) for j, (a, r) in enumerate(zip(accepted, reached))},
        # alive_{j}, not acc_{j}: drafts 0..j all accepted, per round (module docstring)
        **{f"alive_{j}": ratio(a, rounds) for j, a in enumerate(accepted)},
        "mean_accepted_drafts": ratio(sum(accepted), rounds),
        "temperature": temperature, "tau_se": sampling.round_lengths_se(histogram),
        "tau_se_prompts": ratio_se_of([(sum(s.accepted), s.rounds) for _, _, s in pairs]),
        "tokens_identical": not mismatches if temperature == 0 else None,
        "mismatches": mismatches,
        "tokens_generated": gen, "decode_rounds": rounds, "decode_tokens": decode_tokens,
        "target_forwards": sum(s.target_forwards for _, _, s in pairs),
        "drafter_forwards": sum(s.drafter_forwards for _, _, s in pairs),
        "baseline_tokens_generated": base_gen,
        "baseline_target_forwards": sum(b.target_forwards for _, b, _ in pairs),
        "tokens_per_target_forward": gen / max(1, sum(s.target_forwards for _, _, s in pairs)),
        "tokens_per_s": spec_tps, "baseline_tokens_per_s": base_tps,
        "speedup": ratio(spec_tps, base_tps),
        "seconds": t_spec, "baseline_seconds": t_base,
        # of those seconds, the prompt forwards (to the first token)
        "prefill_seconds": sum(s.prefill_seconds for _, _, s in pairs),
        "baseline_prefill_seconds": sum(b.prefill_seconds for _, b, _ in pairs),
        # mean seconds of one step, as the decoding waited for it (models.speedup's costs): a
        # target-only decode step, a verify forward and a drafter step
        "step_seconds": {"target": ratio(sum(b.target_seconds for _, b, _ in pairs),
                                         sum(b.target_forwards - 1 for _, b, _ in pairs)),
                         "verify": ratio(t_verify, rounds),
                         "draft": ratio(sum(s.draft_seconds for _, _, s in pairs),
                                        sum(s.drafter_forwards for _, _, s in pairs))},
        # process CPU time: the fair comparison on a shared machine (with one torch thread)
        "cpu_seconds": c_spec, "baseline_cpu_seconds": c_base,
        "speedup_cpu": ratio(ratio(gen, c_spec), ratio(base_gen, c_base)),
        "counts": {"reached": reached, "accepted": accepted},
        "accepted_drafts_histogram": histogram,    # rounds that accepted 0..K drafts (no bonus)
        "context_buckets": list(context_buckets),
        "by_context": rounds_table([r for _, _, s in pairs for r in s.round_log], k,
                                   context_buckets),
        "per_prompt": [{"prompt": n, "tokens": len(s.tokens), "rounds": s.rounds,
                        "accepted": sum(s.accepted),
                        "decode_tokens": s.decode_tokens,
                        "tau": 1 + ratio(sum(s.accepted), s.rounds),
                        "tau_emitted": ratio(s.decode_tokens, s.rounds),
                        "identical": b.tokens == s.tokens} for n, b, s in pairs],
    }
