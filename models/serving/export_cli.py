"""`eyas export CHECKPOINT OUT_DIR`: the command around `models.serving.export`."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from eyas.data.common.options import option
from eyas.models.serving.card import serve_commands
from eyas.models.serving.export import EXPORT_META, export_checkpoint


@dataclass(kw_only=True)
class ExportOptions:
    """Write a trained drafter as a directory vLLM and SGLang serve as is (config.json +
    model.safetensors, layout A of models/serving/CONTRACT.md), with a model card (README.md) and
    eyas_provenance.json made from the checkpoint's run record: the same card as the run's own
    export."""

    checkpoint: str = option(
        help="trainer checkpoint dir (DDP or DeepSpeed, with eyas.json), a state-dict file, or an "
        "exported drafter dir (re-export / convert)", positional=True)
    out_dir: str = option(help="output directory (must not exist unless --overwrite)",
                          positional=True)
    target_config: str | None = option(
        None, "the target's config.json, its directory, hub id (org/name[@revision]) or preset "
        "name: enables the target checks (default: none, no target checks)")
    drafter_config: str | None = option(
        None, "drafter config.json when the checkpoint has no eyas.json (default: the "
        "checkpoint's eyas.json)")
    speculators_config: bool = option(
        False, "also write OUT_DIR-speculators/ (vLLM-only speculators format)")
    verifier: str | None = option(
        None, "target path or hub id for the speculators config and the printed serve commands "
        "(default: none; needed with --speculators-config; a relative or ~ path that exists here "
        "is recorded absolute)")
    num_speculative_tokens: int | None = option(
        None, "K for the printed commands (default: the TTT steps trained, else 3)")
    overwrite: bool = option(
        False, "replace an earlier export in OUT_DIR (refused when OUT_DIR holds files an export "
        "does not write)")
    shard_size_gb: float | None = option(
        None, "split model.safetensors into shards of at most this size (default: one file)")


def main(args: ExportOptions) -> int:
    """`eyas export CHECKPOINT OUT_DIR [--target-config FILE] [--speculators-config] …`."""
    config = json.loads(Path(args.drafter_config).read_text()) if args.drafter_config else None
    # ExportError, a missing checkpoint, an existing OUT_DIR: one line, exit 2 (log.run_command)
    out = export_checkpoint(
        args.checkpoint, args.out_dir, config=config, target_config=args.target_config,
        speculators=args.speculators_config, verifier=args.verifier,
        num_speculative_tokens=args.num_speculative_tokens, overwrite=args.overwrite,
        max_shard_bytes=int(args.shard_size_gb * 2**30) if args.shard_size_gb else None)
    meta = json.loads((out / EXPORT_META).read_text())
    k = args.num_speculative_tokens or meta.get("ttt_steps") or 3
    if meta.get("ttt_steps") and k > meta["ttt_steps"]:
        print(f"warning: K={k} > the {meta['ttt_steps']} TTT steps trained: later draft "
              f"positions were never trained", file=sys.stderr)
    target = args.verifier or args.target_config or "TARGET"
    vllm, sglang = serve_commands(out.resolve(), target, k)
    print(f"exported {out}\n\nvLLM:\n  {vllm}\n\nSGLang:\n  {sglang}")
    if args.speculators_config:
        print(f"\nvLLM (speculators format): vllm serve {out.resolve()}-speculators")
    return 0

