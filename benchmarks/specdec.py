"""Benchmark real speculative decoding, and check the offline estimate against it.

For each K: every prompt is decoded by target-only greedy decoding and by greedy chain
speculation (train.evaluate.specdec; drafter loaded like vLLM, batch 1), interleaved per prompt so both
see the same machine load. Reported: real τ (1 + accepted drafts per verify forward, the
engines' acceptance length) and the emitted tokens per verify forward, per-position
acceptance, target forwards, tokens/s of both and the speedup, token identity. Then the
target-only answers become a hidden-state dataset (`data.produce.extract`, the training capture path)
and `train.evaluate.offline.offline_eval` computes, on exactly that text, the all-starts τ (what the
trainer logs) and the decoder-walk τ; the table shows their gaps to the real τ.

Without --drafter a random-weight drafter is exported first (τ ≈ 1): the speedup column then
shows the pure cost of drafting and verifying.

Usage:
    python benchmarks/specdec.py [--drafter DIR] [--target smollm2] [--prompts heldout|FILE]
        [--num-prompts 16] [--max-new-tokens 64] [--k 3] [--k 5] [--dtype bf16|fp32]
        [--threads N] [--no-offline] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


from eyas.data.produce.prompts import prompts_path
from eyas.train.evaluate.specdec import decode_prompts, load_engine_drafter, stop_token_ids
from eyas.train.evaluate.specdec_summary import summarize
from eyas.data.common.targets import TARGET_DTYPES, load_target
from eyas.data.common.utils import json_safe
from eyas.train.evaluate.offline import SPECDEC_DTYPES, load_prompts, offline_eval


def random_drafter(model, out: Path, k: int) -> Path:
    """Export a random-weight layout-A drafter for `model` (draft vocab 32000 or the target's)."""
    from eyas.models.config import Eagle3Config
    from eyas.models.drafter import Eagle3Drafter
    from eyas.models.serving.export import export_drafter
    from eyas.data.common.targets import default_aux_layer_ids
    tcfg = model.config.to_dict()
    vd = min(32000, tcfg["vocab_size"])
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=vd,
                                   aux_layer_ids=default_aux_layer_ids(tcfg["num_hidden_layers"]))
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="eager")
    d2t = torch.arange(vd) * 0                                            # the first vd ids
    d.set_vocab_map(d2t)
    return export_drafter(d.state_dict(), cfg, d2t, None, out, target_config=tcfg, ttt_steps=k)


def hidden_dataset(model, target: str, prompts, answers, root: Path) -> Path:
    """prompt + target answer per record → token dataset → hidden-state dataset (extract)."""
    from eyas.data.produce.extract import extract
    from eyas.data.store.shards import write_manifest, write_shard
    samples = [{"input_ids": torch.tensor(p + a),
                "loss_mask": torch.tensor([False] * len(p) + [True] * len(a))}
               for p, a in zip(prompts, answers) if a]
    write_manifest(root / "tokens", {"kind": "tokens"}, [write_shard(root / "tokens", 0, samples)])
    extract(root / "tokens", target, root / "hidden", model=model)
    return root / "hidden"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default=None, help="exported drafter dir (default: random)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--prompts", default="heldout", help="'heldout', 'default' or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, action="append", help="draft tokens per round (repeatable)")
    p.add_argument("--dtype", choices=SPECDEC_DTYPES, default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--no-offline", action="store_true", help="skip the offline comparison")
    p.add_argument("--json", default=None, help="write all results here")
    args = p.parse_args()
    ks = args.k or [3]
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="eyas-specdec-"))
    t0, c0 = time.perf_counter(), time.process_time()
    model, tok = load_target(args.target, dtype=TARGET_DTYPES[args.dtype])
    path = prompts_path(args.prompts) if args.prompts in ("heldout", "default") else args.prompts
    named = load_prompts(path, tok, num_prompts=args.num_prompts)
    names, prompts = [n for n, _ in named], [ids for _, ids in named]
    drafter_dir = Path(args.drafter) if args.drafter else random_drafter(model, tmp / "rand",
                                                                          max(ks))
    emb = model.get_input_embeddings().weight.detach()
    engine, cfg = load_engine_drafter(drafter_dir, emb, dtype=TARGET_DTYPES[args.dtype])
    stop = stop_token_ids(model, tok)
    results, answers = {}, None
    for k in ks:
        pairs = decode_prompts(model, engine, cfg, prompts, k=k, max_new_tokens=args.max_new_tokens,
                               stop_ids=stop, names=names)
        results[k] = summarize(pairs, k)
        answers = answers or [b.tokens for _, b, _ in pairs]
    offline = None
    if not args.no_offline:
        hidden = hidden_dataset(model, args.target, prompts, answers, tmp)
        offline = offline_eval(drafter_dir, hidden, k=max(ks), token_budget=4096,
                               target=args.target)

    print(f"\ntarget {args.target} ({args.dtype}), drafter {drafter_dir}, {len(prompts)} prompts "
          f"x {args.max_new_tokens} new tokens, {torch.get_num_threads()} thread(s)")
    head = (f"{'K':>2} {'tau':>6} {'emit':>6} {'off_all':>8} {'gap':>7} {'off_walk':>9} {'gap':>7} "
            f"{'tgt_fwd':>8} {'tokens':>7} {'tok/s':>7} {'base':>7} {'speedup':>8} {'cpu_x':>6} "
            f"{'same':>5}")
    print(head)
    for k, r in results.items():
        a = w = float("nan")
        if offline is not None:
            a, w = offline["tau_by_k"][k - 1], offline["tau_trajectory_by_k"][k - 1]
        print(f"{k:>2} {r['tau']:>6.3f} {r['tau_emitted']:>6.3f} {a:>8.3f} {(a / r['tau'] - 1) * 100:>6.1f}% {w:>9.3f} "
              f"{(w / r['tau'] - 1) * 100:>6.1f}% {r['target_forwards']:>8} "
              f"{r['tokens_generated']:>7} {r['tokens_per_s']:>7.1f} "
              f"{r['baseline_tokens_per_s']:>7.1f} {r['speedup']:>7.2f}x "
              f"{r['speedup_cpu']:>5.2f}x {str(r['tokens_identical']):>5}")
        print("   cond_acc_{k}, k = 0..K-1: " + " ".join(
            f"{r[f'cond_acc_{j}']:.2f}" for j in range(k)))
    print("(tau: 1 + accepted drafts per round, as vLLM and SGLang count it; emit: emitted tokens "
          "per round, lower where the token cap or a stop token cut a round)")
    print("(tok/s and speedup: wall clock; cpu_x: speedup by process CPU time, the fair figure "
          "on a shared machine)")
    print(f"total wall {time.perf_counter() - t0:.1f} s, CPU {time.process_time() - c0:.1f} s")
    if args.json:
        out = {"args": vars(args), "speculative": {str(k): r for k, r in results.items()},
               "offline": offline}
        Path(args.json).write_text(json.dumps(json_safe(out), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
