"""The stdout table of `benchmarks/train_step.py`: one row per case and length, then the host
diagnoses and the GPU-time profiles of the profiled cases."""

from __future__ import annotations

from eyas.models.config import Eagle3Config


def format_table(target: str, cfg: Eagle3Config, rows: list[dict]) -> str:
    head = ("| T | case | step ms | stream ms | fwd / bwd / opt ms | tokens/s | stream tokens/s "
            "| µs/token | MFU sf | MFU eyas | peak GiB | static GiB |")
    lines = [f"{target}: H={cfg.hidden_size} heads={cfg.num_attention_heads}/"
             f"{cfg.num_key_value_heads} I={cfg.intermediate_size} Vd={cfg.draft_vocab_size} "
             f"V={cfg.vocab_size}", head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tokens']} | {r['case']} | {r['error'][:60]} |")
            continue
        split = (f"{r['fwd_ms']:.1f} / {r['bwd_ms']:.1f} / {r['opt_ms']:.1f}"
                 if "fwd_ms" in r else "–")
        lines.append(f"| {r['tokens']} | {r['case']} | {r['step_ms']:.1f} | "
                     f"{r['stream_ms']:.1f} | {split} | {r['tokens_per_s']:.0f} | "
                     f"{r['stream_tokens_per_s']:.0f} | {r['us_per_token']:.2f} | "
                     f"{100 * r['mfu_sf']:.1f}% | {100 * r['mfu_eyas']:.1f}% | "
                     f"{r['peak_gib']:.2f} | {r['static_gib']:.2f} |")
    for r in rows:
        if r.get("host"):
            from benchmarks.host_overhead import format_diagnosis
            lines.append(format_diagnosis(f"T={r['tokens']} {r['case']}", r["host"]))
        if r.get("profile"):
            p = r["profile"]
            lines.append(f"profile T={r['tokens']} {r['case']}: " + ", ".join(
                f"{k} {v:.1f} ms ({100 * v / p['step_ms']:.0f}%)"
                for k, v in p["per_step_ms"].items()))
    return "\n".join(lines)
