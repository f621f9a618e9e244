"""One device call's side-by-side results as the table of benchmarks/README.md.

Reads what `benchmarks/side_by_side.sh` leaves in its output folder: eyas's
`train_step.py --json` files (`eyas*.json`) and the peers' own harness files
(`**/speculators_bench.json`, `**/specforge_bench.json`, ../shared/peers/README.md), groups
every timed row by T, and prints one markdown table per T: step ms, tokens/s, µs/token, MFU with
the SpecForge-compatible count (and eyas's own count for eyas's rows), peak GiB, and each row's
speed against speculators and SpecForge of the same folder. Every step time is a synchronised
wall time (a device sync before and after the step): train_step.py's for eyas, the harnesses'
`median_ms.wall` for the peers (their CUDA-event sums only in files without it). Rows that failed or ran out of
their time budget are listed with the reason, never left out.

Usage:
  python benchmarks/side_by_side_table.py OUT_DIR [--json merged.json]
Only ratios between rows of one call compare: peers move by up to 7 % between calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PEERS = {"speculators_bench.json": "speculators", "specforge_bench.json": "SpecForge"}


def eyas_rows(path: Path) -> list[dict]:
    """Rows of one `train_step.py --json` file."""
    rows = []
    for r in json.loads(path.read_text()).get("results", []):
        row = dict(who="eyas", name=f"eyas `{r['case']}`", T=int(r["tokens"]), source=str(path))
        if "error" in r:
            row["error"] = str(r["error"])
        else:
            row.update(step_ms=r["step_ms"], tokens_per_s=r["tokens_per_s"],
                       mfu_sf=r["mfu_sf"], mfu_eyas=r["mfu_eyas"], peak_gib=r["peak_gib"])
        rows.append(row)
    return rows


def peer_rows(path: Path) -> list[dict]:
    """Rows of one peer harness file (`bench_sp.py` or `bench_sf.py` output)."""
    who = PEERS[path.name]
    rows = []
    for r in json.loads(path.read_text()).get("runs", []):
        row = dict(who=who, name=who, T=int(r["T"]), source=str(path))
        if "median_ms" not in r:
            row["error"] = str(r.get("error") or r.get("skipped") or "no timed step")
        else:
            mfu = r.get("MFU_vs_989_sfformula", r.get("MFU_vs_989"))
            # the synchronised wall time of a step, as train_step.py times eyas's; the sum of
            # the harness's CUDA-event intervals only where no wall time was recorded
            wall = r["median_ms"].get("wall")
            tps = r.get("tokens_per_s_wall") if wall else None
            row.update(step_ms=wall or r["median_ms"]["total"],
                       tokens_per_s=tps or r["tokens_per_s"], clock="wall" if wall else "events",
                       mfu_sf=mfu and mfu * (tps or r["tokens_per_s"]) / r["tokens_per_s"],
                       mfu_eyas=None, peak_gib=r.get("peak_mem_GiB"))
        rows.append(row)
    return rows


def collect(out_dir: Path) -> dict[int, list[dict]]:
    """Every row under out_dir, grouped by T (ascending); eyas first, then the peers."""
    if not out_dir.is_dir():
        raise SystemExit(f"{out_dir}: no such folder; pass the OUT folder side_by_side.sh wrote")
    rows = [r for p in sorted(out_dir.glob("eyas*.json")) for r in eyas_rows(p)]
    for name in PEERS:
        rows += [r for p in sorted(out_dir.rglob(name)) for r in peer_rows(p)]
    if not rows:
        raise SystemExit(f"{out_dir}: no eyas*.json, speculators_bench.json or "
                         "specforge_bench.json inside; nothing to tabulate")
    by_t: dict[int, list[dict]] = {}
    for r in rows:
        by_t.setdefault(r["T"], []).append(r)
    for T, group in by_t.items():
        ref = {who: next((r for r in group if r["who"] == who and "error" not in r), None)
               for who in PEERS.values()}
        for r in group:
            for who, peer in ref.items():
                if "error" not in r and peer is not None:
                    r[f"vs_{who}"] = r["tokens_per_s"] / peer["tokens_per_s"]
    return dict(sorted(by_t.items()))


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}×"


def format_tables(by_t: dict[int, list[dict]]) -> str:
    head = ("| T | run | step ms | tokens/s | µs/token | MFU sf | MFU eyas | peak GiB "
            "| vs speculators | vs SpecForge |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for T, group in by_t.items():
        for r in group:
            if "error" in r:
                lines.append(f"| {T} | {r['name']} | {r['error'][:80]} |")
                continue
            peak = "–" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            lines.append(
                f"| {T} | {r['name']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                f"{1e6 / r['tokens_per_s']:.2f} | {_pct(r['mfu_sf'])} | {_pct(r['mfu_eyas'])} | "
                f"{peak} | {_ratio(r.get('vs_speculators'))} | {_ratio(r.get('vs_SpecForge'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="side_by_side_table", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path, help="the folder side_by_side.sh wrote ($OUT)")
    ap.add_argument("--json", type=Path, help="also write every row, grouped by T, here")
    args = ap.parse_args(argv)
    by_t = collect(args.out_dir)
    print(format_tables(by_t))
    if args.json:
        from eyas.data.common.utils import atomic_write_json
        atomic_write_json(args.json, {str(T): rows for T, rows in by_t.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
