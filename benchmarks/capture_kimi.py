"""Capture at the seed's scale: `eyas extract` on a Kimi-K2.5-shaped target against the plain
HF forward, per storage mode, plus a forced CPU/GPU split of a large target (GPU only).

The target is Kimi-K2.5's text model (DeepSeek-V3 modelling: hidden 7168, MLA, 64 heads, 384
routed experts / 8 active, moe_intermediate 2048, vocabulary 163840) cut to a few layers
(the leading layers dense, the rest MoE), random bf16 weights built on the GPU. On
the same token batches it times, alternating:
  plain    `model(input_ids)` (full-vocabulary logits, nothing stored);
  extract  `data.produce.extract.extract(model=...)`: the real hooks, chunked argmax, copies to the
           host and shard writing to local disk, for each storage mode (bf16 aux + last
           state; fp8 aux + last; fp8 aux + top-32 teacher).
Per-layer CUDA-event times of the plain forward give the projection to 61 layers; the writer's
own rate is timed by writing one captured shard again. `--split` then saves a smaller-expert
variant of the same shape to disk and loads it twice through the path large targets take
(`device_map`): all on the GPU, and with the embedding and the first layers on the CPU; it
reports both rates and the largest difference between the two captures.

    python benchmarks/capture_kimi.py --out capture.json [--layers 4] [--samples 64] [--split]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eyas.data.common.capture import LayerHooks, find_text_model, logit_transform
from eyas.data.produce.estimate import estimate_bytes
from eyas.data.produce.extract import extract
from eyas.data.produce.forward import run_batch
from eyas.data.common.log import setup_logging
from eyas.data.store.shards import open_dataset, write_manifest, write_shard
from eyas.data.common.targets import load_target_config, text_config

AUX = [2, 3, 4]
MODES = {"bf16+last": ("bf16", "last"), "fp8+last": ("fp8", "last"), "fp8+top32": ("fp8", "topk")}
SEED_BYTES, SEED_CONVS = 828e9, 10_000      # the seed run: hidden states for 10k conversations


def kimi_config(layers: int, dense: int, experts: int | None = None):
    from transformers import DeepseekV3Config
    cfg = dict(text_config(load_target_config("kimi-k2.5")))
    for k in ("architectures", "model_type", "torch_dtype"):
        cfg.pop(k, None)
    # Kimi-K2's routing groups; `dense` leading dense layers (the full model has one)
    cfg.update(num_hidden_layers=layers, first_k_dense_replace=dense, n_group=1, topk_group=1)
    if experts:
        cfg["n_routed_experts"] = experts
    return DeepseekV3Config(**cfg)


def build_model(cfg, device="cuda"):
    from transformers import DeepseekV3ForCausalLM
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = DeepseekV3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def token_dataset(out: Path, samples: int, length: int, vocab: int) -> Path:
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, vocab, (length,), generator=g, dtype=torch.int32),
             "loss_mask": torch.ones(length, dtype=torch.bool)} for _ in range(samples)]
    metas = [write_shard(out, 0, rows)]
    write_manifest(out, {"kind": "tokens", "target": "kimi-k2.5-shaped", "tokenizer": None}, metas)
    return out


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.no_grad()
def plain(model, batches) -> float:
    return _sync_time(lambda: [model(input_ids=x, use_cache=False) for x in batches])


@torch.no_grad()
def layer_times(model, x) -> list[float]:
    """ms per decoder layer for one batch, from CUDA events around each layer."""
    layers = model.model.layers
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in layers]
    hs = [m.register_forward_pre_hook(lambda m, a, i=i: ev[i][0].record()) for i, m in
          enumerate(layers)] + [m.register_forward_hook(lambda m, a, o, i=i: ev[i][1].record())
                                for i, m in enumerate(layers)]
    model(input_ids=x, use_cache=False)
    torch.cuda.synchronize()
    for h in hs:
        h.remove()
    return [a.elapsed_time(b) for a, b in ev]


def hooks_only(model, ds, batch: int, teacher: str) -> float:
    """Seconds for the capture without storage: the hooked forward, the chunked argmax (and
    top-k) and the copies to the host, as `extract` runs them, for every batch."""
    text, layers, norm, head = find_text_model(model)
    cap = LayerHooks(layers, AUX, norm)
    rows = [ds.sample(i, fields=("input_ids", "loss_mask")) for i in range(len(ds))]
    tf = logit_transform(model.config)
    try:
        return _sync_time(lambda: [run_batch(text, cap, head, rows[i:i + batch], teacher=teacher,
                                             topk=32, row_chunk=1024, vocab_chunk=65536,
                                             logit_tf=tf) for i in range(0, len(rows), batch)])
    finally:
        cap.remove()


def writer_rate(hidden: Path, work: Path, aux_format: str) -> float:
    """GB/s of `write_shard` alone, writing the first shard's samples again."""
    ds = open_dataset(hidden)
    first = [ds[i] for i in range(int(ds.manifest["shards"][0]["n_samples"]))]
    t0 = time.perf_counter()
    meta = write_shard(work / "rewrite", 0, first, aux_format=aux_format)
    dt = time.perf_counter() - t0
    shutil.rmtree(work / "rewrite")
    return meta["bytes"] / dt / 1e9


def capture_table(args, work: Path) -> dict:
    cfg = kimi_config(args.layers, args.dense)
    t0 = time.perf_counter()
    model = build_model(cfg)
    built_s = time.perf_counter() - t0
    tokens = token_dataset(work / "tokens", args.samples, args.length, cfg.vocab_size)
    ds = open_dataset(tokens)
    ids = torch.stack([ds[i]["input_ids"].long() for i in range(len(ds))]).cuda()
    batches = list(ids.split(args.batch))
    n_tok = ids.numel()
    plain(model, batches[:1])
    per_layer = [layer_times(model, batches[0]) for _ in range(3)]
    res = {"layers": args.layers, "dense_layers": args.dense, "tokens": n_tok, "batch": [args.batch, args.length],
           "build_s": round(built_s, 1), "peak_gib": None, "modes": {},
           "layer_ms": [round(statistics.median(c), 2) for c in zip(*per_layer)]}
    kw = dict(batch_tokens=args.batch * args.length, shard_bytes=args.shard_bytes)
    plain_s = []
    for name, (aux_format, teacher) in MODES.items():
        ext_s, hooks_s = [], []
        for _ in range(args.repeats):
            plain_s.append(plain(model, batches))
            hooks_s.append(hooks_only(model, ds, args.batch, teacher))
            shutil.rmtree(work / "hidden", ignore_errors=True)
            ext_s.append(_sync_time(lambda: extract(tokens, "kimi-k2.5-shaped", work / "hidden",
                                                    model=model, aux_format=aux_format,
                                                    teacher=teacher, topk=32, layers=AUX,
                                                    **kw)))
        on_disk = int(open_dataset(work / "hidden").manifest["bytes"])
        res["modes"][name] = {
            "hooks_s": [round(t, 3) for t in hooks_s],
            "hooks_tok_s": round(n_tok / statistics.median(hooks_s)),
            "extract_s": [round(t, 3) for t in ext_s], "extract_tok_s": round(
                n_tok / statistics.median(ext_s)), "bytes_per_token": round(on_disk / n_tok, 1),
            "format_bytes_per_token": estimate_bytes(
                [args.length], cfg.hidden_size, aux_format, teacher, 32)["payload_bytes_per_token"],
            "disk_gb": round(on_disk / 1e9, 2),
            "writer_gb_s": round(writer_rate(work / "hidden", work, aux_format), 2)}
    res["plain_s"] = [round(t, 3) for t in plain_s]
    res["plain_tok_s"] = round(n_tok / statistics.median(plain_s))
    res["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return res              # the model goes with this frame (main() empties the cache)


def project(res: dict, hidden: int, n_layers: int = 61, dense: int = 1) -> dict:
    """The full target's capture from the measured layers: time per token of a 61-layer forward
    (1 dense + 60 MoE layers, as measured per layer) plus eyas's per-token capture cost."""
    lm = res["layer_ms"]
    k = res["dense_layers"]
    dense_ms, moe_ms = statistics.median(lm[:k]), statistics.median(lm[k:])
    batch_tok = res["batch"][0] * res["batch"][1]
    plain_ms = 1e3 * statistics.median(res["plain_s"]) / (res["tokens"] / batch_tok)
    rest_ms = plain_ms - sum(lm)                              # embedding, final norm, lm_head
    full_ms = dense * dense_ms + (n_layers - dense) * moe_ms + rest_ms
    seed_tokens = SEED_BYTES / (8 * hidden * 1.0)             # the seed stored 8·tH bytes/token
    out = {"dense_ms": dense_ms, "moe_ms": moe_ms, "rest_ms": round(rest_ms, 2),
           "full_forward_ms_per_batch": round(full_ms, 1),
           "seed_tokens": round(seed_tokens), "modes": {}}
    n_batches = res["tokens"] / batch_tok
    for name, m in res["modes"].items():
        # the forward, hooks, argmax and copies run in series; the shard writer overlaps them
        serial_ms = 1e3 * (res["tokens"] / m["hooks_tok_s"] - res["tokens"] / res["plain_tok_s"]) \
            / n_batches
        write_ms = 1e3 * batch_tok * m["format_bytes_per_token"] / (m["writer_gb_s"] * 1e9)
        batch_ms = max(full_ms + max(serial_ms, 0.0), write_ms)
        tok_s = batch_tok / (batch_ms / 1e3)
        out["modes"][name] = {
            "capture_serial_ms_per_batch": round(serial_ms, 1),
            "write_ms_per_batch": round(write_ms, 1),
            "overhead_full_model": round(batch_ms / full_ms - 1, 4),
            "tok_s_one_pipeline": round(tok_s), "seed_hours": round(seed_tokens / tok_s / 3600, 2),
            "seed_disk_gb": round(seed_tokens * m["format_bytes_per_token"] / 1e9, 1),
            "vs_seed_bytes": round(m["format_bytes_per_token"] / (8 * hidden), 3)}
    return out


def split_check(args, work: Path) -> dict:
    """A smaller-expert variant saved to disk, loaded through device maps: whole on the GPU,
    then with the embedding and the first layers on the CPU."""
    cfg = kimi_config(args.layers, args.dense, experts=args.split_experts)
    model = build_model(cfg)
    model.save_pretrained(work / "target")
    del model
    torch.cuda.empty_cache()
    tokens = token_dataset(work / "split-tokens", args.split_samples, args.split_length,
                           cfg.vocab_size)
    cpu = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(args.split_cpu_layers)]
    # "cpu" in a device map: weights kept in host memory, streamed to the GPU per forward
    maps = {"gpu": {"": 0},
            "split": {**{m: "cpu" for m in cpu}, "model.rotary_emb": 0, "model.norm": 0,
                      "lm_head": 0, **{f"model.layers.{i}": 0
                                       for i in range(args.split_cpu_layers, args.layers)}}}
    res = {"experts": args.split_experts, "cpu_modules": cpu,
           "tokens": args.split_samples * args.split_length}
    for name, dm in maps.items():
        s = extract(tokens, work / "target", work / f"hid-{name}", device_map=dm,
                    layers=AUX)
        res[f"{name}_tok_s"] = s["tokens_per_s"]
    a, b = open_dataset(work / "hid-gpu"), open_dataset(work / "hid-split")
    for f in ("aux", "last"):
        x = torch.cat([a[i][f].double().flatten() for i in range(len(a))])
        y = torch.cat([b[i][f].double().flatten() for i in range(len(b))])
        res[f"{f}_max_abs"] = float((x - y).abs().max())
        res[f"{f}_max_ref"] = float(x.abs().max())
        res[f"{f}_cosine"] = float(torch.nn.functional.cosine_similarity(x, y, dim=0))
    res["argmax_agree"] = float(torch.cat([(a[i]["target_argmax"] == b[i]["target_argmax"])
                                           for i in range(len(a))]).float().mean())
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=5, help="decoder layers (aux ids 2,3,4)")
    p.add_argument("--dense", type=int, default=3,
                   help="leading dense layers (three, as DeepSeek-V3, fit five layers on one "
                        "H200; per-layer times project to Kimi's 1 dense + 60 MoE)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="samples per forward")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--shard-bytes", type=int, default=1 << 30)
    p.add_argument("--split", action="store_true", help="also run the CPU/GPU split check")
    p.add_argument("--split-experts", type=int, default=16)
    p.add_argument("--split-cpu-layers", type=int, default=2)
    p.add_argument("--split-samples", type=int, default=4)
    p.add_argument("--split-length", type=int, default=512)
    p.add_argument("--work", default=None, help="scratch directory on local disk")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    setup_logging(level=logging.WARNING)
    work = Path(args.work or tempfile.mkdtemp(prefix="eyas-capture-"))
    work.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "capture": capture_table(args, work)}
    res["projection"] = project(res["capture"], hidden=7168)
    c, pr = res["capture"], res["projection"]
    print(f"\nKimi-K2.5 shape, {c['layers']} layers, {c['tokens']} tokens, batch {c['batch']}: "
          f"plain {c['plain_tok_s']} tok/s, peak {c['peak_gib']} GiB; layer ms {c['layer_ms']}")
    print(f"{'mode':<10} {'tok/s':>7} {'overhead':>9} {'no-store tok/s':>15} {'B/token':>8} "
          f"{'writer GB/s':>12} "
          f"{'61-layer overhead':>18} {'seed hours':>11} {'seed GB':>8}")
    for name, m in c["modes"].items():
        q, over = pr["modes"][name], c["plain_tok_s"] / m["extract_tok_s"] - 1
        print(f"{name:<10} {m['extract_tok_s']:>7} {over:>9.1%} {m['hooks_tok_s']:>15} "
              f"{m['bytes_per_token']:>8.0f} "
              f"{m['writer_gb_s']:>12} {q['overhead_full_model']:>18.1%} {q['seed_hours']:>11} "
              f"{q['seed_disk_gb']:>8}")
    if args.split:
        shutil.rmtree(work / "hidden", ignore_errors=True)
        gc.collect()
        torch.cuda.empty_cache()
        res["split"] = split_check(args, work)
        print("split:", json.dumps(res["split"]))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
