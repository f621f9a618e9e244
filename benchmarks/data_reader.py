"""Reader benchmarks for the eyas dataset format (CPU; prints a table, --out writes JSON).

Measures, on datasets it generates under --work (reused across runs):
  1. sustained throughput of PackedLoader (real sample bytes packed into batches per second)
     against a raw sequential read() of the same shard files in the same run, page cache warm
     (and cold, when /proc/sys/vm/drop_caches is writable);
  2. random-sample latency: `ds[i]` (zero-copy views), `ds[i]` + reading every byte, and
     `read_into` (copy into a batch buffer);
  3. time to open a dataset of 10,000 shards (and to read a first sample from it);
  4. stored bytes per token for bf16 aux + last, fp8 aux + last, and compact top-k teachers,
     against the 8·tH bytes/token anchor of the reference trainers;
  5. the first-epoch cost of the read checks (data.verify: per-sample crc32 + NaN/inf), off and
     on side by side (`--sections verify --step-ms MS` alone: MS = a train step at --budget).

    python benchmarks/data_reader.py --out bench.json [--gib 2] [--hidden 4096]
    python benchmarks/data_reader.py --sections verify --step-ms 900 --gib 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from eyas.data.store.inspect import summarize
from eyas.data.store.loader import PackedLoader
from eyas.data.store.shards import open_dataset, write_manifest, write_shard


def make_hidden(root: Path, gib: float, tH: int, *, aux_format="bf16", teacher="last", k=32,
                mean_len=1024, shard_mb=256, seed=0) -> Path:
    """A synthetic hidden-state dataset of about `gib` GiB (reused if already there)."""
    if (root / "manifest.json").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    gen = torch.Generator().manual_seed(seed)
    per_token = {"bf16": 6 * tH, "fp8": 3 * tH + 12}[aux_format] + 9
    per_token += 2 * tH if teacher in ("last", "both") else 0
    per_token += 8 * k if teacher in ("topk", "both") else 0
    budget = gib * 2**30
    metas, pending, size, total = [], [], 0, 0
    base_aux = torch.randn(4096, 3, tH, generator=gen).bfloat16()   # reused rows: fast to make
    while total < budget:
        T = int(torch.randint(mean_len // 4, mean_len * 7 // 4, (1,), generator=gen))
        rows = torch.randint(0, 4096, (T,), generator=gen)
        s = {"input_ids": torch.randint(0, 128000, (T,), generator=gen),
             "loss_mask": torch.rand(T, generator=gen) > 0.3, "aux": base_aux[rows],
             "target_argmax": torch.randint(0, 128000, (T,), generator=gen)}
        if teacher in ("last", "both"):
            s["last"] = base_aux[rows, 0]
        if teacher in ("topk", "both"):
            s["topk_ids"] = torch.randint(0, 128000, (T, k), generator=gen)
            s["topk_logits"] = torch.randn(T, k, generator=gen)
        pending.append(s)
        size += T * per_token
        total += T * per_token
        if size >= shard_mb * 2**20:
            metas.append(write_shard(root, len(metas), pending, aux_format=aux_format))
            pending, size = [], 0
    if pending:
        metas.append(write_shard(root, len(metas), pending, aux_format=aux_format))
    write_manifest(root, {"kind": "hidden", "hidden_size": tH,
                          "teacher": {"kind": teacher}}, metas)
    return root


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def raw_read(files: list[Path], chunk: int = 64 << 20) -> tuple[float, int]:
    """Sequential read() of whole files into one reused buffer: (seconds, bytes)."""
    buf = bytearray(chunk)
    mv = memoryview(buf)
    n = 0
    t0 = time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while True:
                got = f.readinto(mv)
                if not got:
                    break
                n += got
    return time.perf_counter() - t0, n


def loader_pass(loader: PackedLoader, per_token: float, budget: int) -> tuple[float, int, int]:
    """One full pass (epoch) of `loader`: (seconds, real sample bytes, batch bytes incl. pad)."""
    real = padded = 0
    t0 = time.perf_counter()
    for b in loader:
        real += b.num_tokens
        padded += budget
    dt = time.perf_counter() - t0
    return dt, int(real * per_token), int(padded * per_token)


def bench_throughput(root: Path, budget: int, reps: int) -> dict:
    """Warm page cache; raw and loader passes interleaved so machine noise hits both; best of
    `reps` each. The loaders run one untimed pass first (their buffer pools fill)."""
    ds = open_dataset(root)
    per_token = summarize(root)["payload_bytes_per_token"]
    files = [ds.shard_path(s) for s in range(ds.num_shards)]
    out: dict = {"dataset_gib": sum(p.stat().st_size for p in files) / 2**30,
                 "samples": len(ds), "tokens": ds.num_tokens, "token_budget": budget,
                 "payload_bytes_per_token": per_token}
    raw_read(files)                                   # warm the page cache
    loaders = {w: PackedLoader(ds, budget, 0, 1, seed=0, num_workers=w) for w in (1, 2)}
    for loader in loaders.values():
        loader_pass(loader, per_token, budget)
    raw, runs = [], {w: [] for w in loaders}
    for _ in range(reps):
        raw.append(raw_read(files))
        for w, loader in loaders.items():
            runs[w].append(loader_pass(loader, per_token, budget))
    out["raw_warm_gbps"] = max(n / dt for dt, n in raw) / 1e9
    out["raw_warm_runs_gbps"] = [n / dt / 1e9 for dt, n in raw]
    for w in loaders:
        best = min(runs[w], key=lambda r: r[0])
        out[f"loader_w{w}_warm_gbps"] = best[1] / best[0] / 1e9
        out[f"loader_w{w}_warm_runs_gbps"] = [r[1] / r[0] / 1e9 for r in runs[w]]
        out[f"loader_w{w}_warm_batch_gbps"] = best[2] / best[0] / 1e9
        out[f"loader_w{w}_warm_ratio"] = out[f"loader_w{w}_warm_gbps"] / out["raw_warm_gbps"]
        out[f"loader_w{w}_fill"] = loaders[w].stats.fill
    return out


def bench_verify(root: Path, budget: int, reps: int, step_ms: float | None) -> dict:
    """First-epoch cost of the read checks (data.verify: crc32 + NaN/inf per sample), checks
    off and on side by side, page cache warm. Each pass opens the dataset afresh, so every
    sample is checked. workers=0 builds batches in the timed thread: the whole cost lands on
    the critical path (an upper bound); with workers it overlaps the consumer (as in training).
    """
    per_token = summarize(root)["payload_bytes_per_token"]
    out: dict = {}
    for w in (0, 2):
        runs: dict[str, list] = {"off": [], "on": []}
        for _ in range(reps):
            for mode in ("off", "on"):
                ds = open_dataset(root)
                if mode == "on":
                    ds.enable_read_checks(checksum=True, nonfinite="error")
                loader = PackedLoader(ds, budget, 0, 1, seed=0, num_workers=w)
                dt, real, _ = loader_pass(loader, per_token, budget)
                runs[mode].append((dt, real, len(loader)))
        best = {m: min(r, key=lambda x: x[0]) for m, r in runs.items()}
        ms = {m: 1e3 * b[0] / b[2] for m, b in best.items()}
        out[f"w{w}"] = {"batches": best["on"][2], "ms_per_batch_off": ms["off"],
                        "ms_per_batch_on": ms["on"], "extra_ms_per_batch": ms["on"] - ms["off"],
                        "gbps_off": best["off"][1] / best["off"][0] / 1e9,
                        "gbps_on": best["on"][1] / best["on"][0] / 1e9,
                        "extra_pct_of_step": (100 * (ms["on"] - ms["off"]) / step_ms
                                              if step_ms else None)}
    return out


def bench_cold(root: Path, budget: int) -> dict:
    """One raw pass and one loader pass, each after dropping the page cache (root only)."""
    out: dict = {"cold_available": drop_caches()}
    if not out["cold_available"]:
        return out
    ds = open_dataset(root)
    per_token = summarize(root)["payload_bytes_per_token"]
    files = [ds.shard_path(s) for s in range(ds.num_shards)]
    dt, n = raw_read(files)
    out["raw_cold_gbps"] = n / dt / 1e9
    drop_caches()
    dt, real, _ = loader_pass(PackedLoader(ds, budget, 0, 1, seed=0, num_workers=2),
                              per_token, budget)
    out["loader_w2_cold_gbps"] = real / dt / 1e9
    out["loader_w2_cold_ratio"] = out["loader_w2_cold_gbps"] / out["raw_cold_gbps"]
    raw_read(files)                                   # leave the cache warm again
    return out


def bench_latency(root: Path, n: int = 300) -> dict:
    ds = open_dataset(root)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(ds), n)
    ds[0]
    for s in range(ds.num_shards):                   # open every shard once
        ds.shard(s)

    def timed(fn) -> list[float]:
        ts = []
        for i in idx:
            t0 = time.perf_counter()
            fn(int(i))
            ts.append((time.perf_counter() - t0) * 1e6)
        return ts

    view = timed(lambda i: ds[i])
    touch = timed(lambda i: [t.sum() for t in ds[i].values()])
    maxlen = int(ds.sample_lengths.max())
    bufs = {k: torch.empty((maxlen, *v.shape[1:]), dtype=v.dtype) for k, v in ds[0].items()}
    copy = timed(lambda i: ds.read_into(i, bufs))
    mean_len = float(ds.sample_lengths[idx].mean())
    q = lambda ts: {"p50_us": statistics.median(ts), "p99_us": float(np.percentile(ts, 99))}  # noqa
    return {"mean_sample_tokens": mean_len, "getitem_views": q(view),
            "getitem_read_all_bytes": q(touch), "read_into_buffer": q(copy)}


def bench_open(root: Path, n_shards: int = 10_000) -> dict:
    if not (root / "manifest.json").exists():
        shutil.rmtree(root, ignore_errors=True)
        gen = torch.Generator().manual_seed(0)
        metas = []
        for s in range(n_shards):
            T = 4
            metas.append(write_shard(root, s, [{
                "input_ids": torch.randint(0, 100, (T,), generator=gen),
                "loss_mask": torch.ones(T, dtype=torch.bool),
                "aux": torch.randn(T, 3, 8, generator=gen).bfloat16()}]))
        write_manifest(root, {"kind": "hidden"}, metas)
    times, first = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        ds = open_dataset(root)
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ds[len(ds) - 1]
        first.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    open_dataset(root, verify="header")
    header = time.perf_counter() - t0
    return {"shards": len(ds), "open_s_median": statistics.median(times),
            "open_s_max": max(times), "first_sample_s": statistics.median(first),
            "open_verify_header_s": header}


def bench_bytes_per_token(work: Path, tH: int) -> dict:
    modes = {"bf16_aux+last": ("bf16", "last"), "fp8_aux+last": ("fp8", "last"),
             "bf16_aux+top32": ("bf16", "topk"), "fp8_aux+top32": ("fp8", "topk")}
    out = {"hidden": tH, "anchor_8tH": 8 * tH}
    for name, (fmt, teacher) in modes.items():
        root = make_hidden(work / f"bpt-{tH}-{name}", 0.05, tH, aux_format=fmt, teacher=teacher,
                           mean_len=512, shard_mb=64)
        s = summarize(root)
        out[name] = {"file_bytes_per_token": s["bytes_per_token"],
                     "payload_bytes_per_token": s["payload_bytes_per_token"],
                     "vs_anchor": s["bytes_per_token"] / (8 * tH)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="/tmp/eyas-bench-data", help="scratch directory (reused)")
    p.add_argument("--gib", type=float, default=2.0, help="throughput dataset size")
    p.add_argument("--hidden", type=int, default=4096, help="target hidden size tH")
    p.add_argument("--budget", type=int, default=8192, help="PackedLoader token budget")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--sections", default="throughput,latency,cold,open,bytes,verify",
                   help="comma list of the measurements to run")
    p.add_argument("--step-ms", type=float, default=None,
                   help="a training step's time (ms, e.g. from benchmarks/train_step.py at the "
                        "same --budget): the read checks' extra time is shown as a share of it")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    res = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    root = make_hidden(work / f"tp-{args.hidden}-{args.gib}", args.gib, args.hidden)
    res["generate_s"] = time.perf_counter() - t0
    sections = set(args.sections.split(","))
    if "verify" in sections:
        res["verify"] = bench_verify(root, args.budget, args.reps, args.step_ms)
        rows = verify_rows(res["verify"])
        if sections == {"verify"}:
            return report(res, rows, args, None)
    res["throughput"] = bench_throughput(root, args.budget, args.reps)
    res["latency"] = bench_latency(root)
    res["throughput"].update(bench_cold(root, args.budget))
    res["open_10k"] = bench_open(work / "open-10k")
    res["bytes_per_token"] = {str(h): bench_bytes_per_token(work, h) for h in (args.hidden, 7168)}
    return report(res, reading_rows(res) + (verify_rows(res["verify"]) if "verify" in res
                                            else []), args, res["throughput"])


def verify_rows(v: dict) -> list[tuple[str, str, str]]:
    rows = []
    for w, r in v.items():
        share = (f"; {r['extra_pct_of_step']:.2f}% of --step-ms"
                 if r["extra_pct_of_step"] is not None else "")
        rows.append((f"read checks off/on, {w[1:]} worker(s)",
                     f"+{r['extra_ms_per_batch']:.2f} ms/batch",
                     f"{r['ms_per_batch_off']:.2f} -> {r['ms_per_batch_on']:.2f} ms "
                     f"({r['gbps_off']:.2f} -> {r['gbps_on']:.2f} GB/s){share}"))
    return rows


def report(res: dict, rows: list, args, tp: dict | None) -> int:
    width = max(len(r[0]) for r in rows)
    if tp is not None:
        print(f"dataset {tp['dataset_gib']:.2f} GiB, {tp['samples']} samples, {tp['tokens']} "
              f"tokens, tH={args.hidden}, budget {args.budget}, {res['cpu_count']} CPUs")
    for name, val, note in rows:
        print(f"{name:<{width}}  {val:>14}  {note}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def reading_rows(res: dict) -> list[tuple[str, str, str]]:
    tp, lat, op = res["throughput"], res["latency"], res["open_10k"]
    rows = [("raw sequential read (warm)", f"{tp['raw_warm_gbps']:.2f} GB/s", ""),
            *[(f"PackedLoader, {w} worker(s) (warm)", f"{tp[f'loader_w{w}_warm_gbps']:.2f} GB/s",
               f"{100 * tp[f'loader_w{w}_warm_ratio']:.0f}% of raw") for w in (1, 2)]]
    if tp["cold_available"]:
        rows += [("raw sequential read (cold)", f"{tp['raw_cold_gbps']:.2f} GB/s", ""),
                 ("PackedLoader, 2 workers (cold)", f"{tp['loader_w2_cold_gbps']:.2f} GB/s",
                  f"{100 * tp['loader_w2_cold_ratio']:.0f}% of raw")]
    else:
        rows.append(("cold-cache runs", "skipped", "drop_caches not writable"))
    for k in ("getitem_views", "getitem_read_all_bytes", "read_into_buffer"):
        rows.append((f"random sample: {k}", f"{lat[k]['p50_us']:.0f} us p50",
                     f"{lat[k]['p99_us']:.0f} us p99 ({lat['mean_sample_tokens']:.0f} tok)"))
    rows.append((f"open {op['shards']} shards", f"{op['open_s_median'] * 1e3:.1f} ms",
                 f"first sample {op['first_sample_s'] * 1e3:.2f} ms; verify=header "
                 f"{op['open_verify_header_s']:.2f} s"))
    for h, bpt in res["bytes_per_token"].items():
        for name, v in bpt.items():
            if isinstance(v, dict):
                rows.append((f"bytes/token tH={h} {name}", f"{v['file_bytes_per_token']:.0f}",
                             f"{100 * v['vs_anchor']:.1f}% of 8*tH = {bpt['anchor_8tH']}"))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
