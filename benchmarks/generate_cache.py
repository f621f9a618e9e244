"""Answer generation at SmolLM2-135M's shape: transformers' dynamic KV cache against its static one.

The embedded datasets answer tens of thousands of prompts with `model.generate` at batch 4096
(`data.produce.generate`, dynamic cache). This times that call on a random-weight Llama of SmolLM2-135M's
shape (30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 49152) in bf16 on the GPU, with
left-padded prompts of 40-159 tokens and a fixed answer length (`min_new_tokens` = the cap, so
every row decodes the same number of steps and the figures compare per step). Runs, in order:

    dynamic  B = 256 x 16 tokens (warm-up), B = 1024 and B = 4096 x --new tokens
    static   B = 4096 x --new tokens, twice: `cache_implementation="static"` makes transformers
             compile the decoding step on CUDA, so the first call holds the compile and the
             second shows the steady rate at that shape (a new batch or cache length compiles
             again)

    python benchmarks/generate_cache.py --out generate_cache.json          # H200, ~2.5 min

Prints one line per run (seconds, tokens/s, peak GiB) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def smollm2_shaped() -> LlamaForCausalLM:
    """A random-weight Llama of SmolLM2-135M-Instruct's shape, bf16, on the GPU."""
    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                      tie_word_embeddings=True, max_position_embeddings=8192)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def time_generate(model, batch: int, new: int, **kwargs) -> dict:
    """One greedy generate() of `batch` left-padded prompts, exactly `new` tokens each."""
    lens = torch.randint(40, 160, (batch,))
    width = int(lens.max())
    ids = torch.randint(0, model.config.vocab_size, (batch, width))
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        mask[i, width - n:] = 1
    ids, mask = ids.cuda(), mask.cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, **kwargs)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return dict(batch=batch, new_tokens=new, cache=kwargs.get("cache_implementation", "dynamic"),
                seconds=round(dt, 2), tokens_per_s=round(batch * new / dt),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=192, help="answer tokens per prompt")
    ap.add_argument("--out", help="write the runs here as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("generate_cache.py times CUDA generation; no GPU is visible")
    model = smollm2_shaped()
    plan = [(256, 16, {}), (1024, args.new, {}), (4096, args.new, {}),
            (4096, args.new, {"cache_implementation": "static"}),
            (4096, args.new, {"cache_implementation": "static"})]
    runs = []
    for batch, new, kwargs in plan:
        runs.append(time_generate(model, batch, new, **kwargs))
        r = runs[-1]
        print(f"{r['cache']:>8}  B {batch:>5} x {new:>3}  {r['seconds']:7.2f} s  "
              f"{r['tokens_per_s']:>7} tok/s  {r['peak_gib']:5.1f} GiB", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
