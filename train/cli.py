"""`eyas`: one command with a subcommand per stage. Training itself is
`accelerate launch train/main.py` (or ./launch.sh), because accelerate owns the processes."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

#: command -> (loader, one-line help); the loader imports the command's module only when it runs
#: (`eyas --help` stays fast) and returns its (options class, run function), or the commands
#: nested under it, {name: (options class, run function, one-line help)}
COMMANDS: dict[str, tuple[Callable[[], Any], str]] = {}
WIDTH = 98      # columns of the usage docs/cli.md shows


def _command(name: str, help: str) -> Callable[[Callable[[], Any]], Any]:
    return lambda load: COMMANDS.setdefault(name, (load, help))


@_command("prepare", "tokenise conversations (or generate them with the target) into a token "
          "dataset")
def _():
    from eyas.data.produce.prepare import PrepareOptions, main
    return PrepareOptions, main


@_command("generate", "answer prompts with a served target (OpenAI-compatible endpoint)")
def _():
    from eyas.data.produce.served import GenerateOptions, main
    return GenerateOptions, main


@_command("synthesize", "sample user prompts from the target itself (more, different prompts)")
def _():
    from eyas.data.produce.synthesize import SynthesizeOptions, main
    return SynthesizeOptions, main


@_command("extract", "run the target over a token dataset and store its hidden states")
def _():
    from eyas.data.produce.extract import ExtractOptions, main
    return ExtractOptions, main


@_command("import", "convert SpecForge/speculators hidden states into an eyas dataset")
def _():
    from eyas.data.produce.importers import ImportOptions, main
    return ImportOptions, main


@_command("export-data", "write a hidden-state dataset in speculators' offline training layout")
def _():
    from eyas.data.produce.export_data import ExportDataOptions, main
    return ExportDataOptions, main


@_command("vocab", "build the draft vocabulary map (d2t/t2d) from a dataset")
def _():
    from eyas.data.produce.vocab import VocabOptions, main
    return VocabOptions, main


@_command("inspect", "summarise a dataset: samples, tokens, bytes/token, modes")
def _():
    from eyas.data.store.inspect import InspectOptions, main
    return InspectOptions, main


@_command("verify", "re-run dataset samples through the target and compare what is stored")
def _():
    from eyas.data.produce.verify import VerifyOptions, main
    return VerifyOptions, main


@_command("export", "turn a training checkpoint into a directory vLLM and SGLang load")
def _():
    from eyas.models.serving.export_cli import ExportOptions, main
    return ExportOptions, main


@_command("validate", "check an exported drafter against the serving contract")
def _():
    from eyas.models.serving.validate import ValidateOptions, main
    return ValidateOptions, main


@_command("doctor", "explain the likely causes of low acceptance")
def _():
    from eyas.models.serving.doctor import DoctorOptions, main
    return DoctorOptions, main


@_command("engines", "load an export with vLLM's and SGLang's own loaders (CPU, own venvs)")
def _():
    from eyas.models.serving.loaders.cli import COMMANDS as nested
    return nested


@_command("evaluate", "offline acceptance on a dataset, or real speculative decoding")
def _():
    from eyas.train.evaluate.cli import EvaluateOptions, main
    return EvaluateOptions, main


def nested_usage(name: str, nested: dict[str, tuple]) -> str:
    """The usage of command `name`, which runs one of `nested`."""
    w = max(map(len, nested))
    return (f"usage: eyas {name} {{{','.join(nested)}}} [--help]\n\n" + "\n".join(
        f"  {sub:<{w}}  {help}" for sub, (_, _, help) in nested.items()))


def call(name: str, argv: list[str]) -> int:
    """Command `name` run with the words after it, `argv`: its options parsed and checked (a
    usage error exits 2), then its run function."""
    target, prog = COMMANDS[name][0](), f"eyas {name}"
    if isinstance(target, dict):
        sub = argv[0] if argv else "--help"
        if sub not in target:
            if sub in ("-h", "--help"):
                print(nested_usage(name, target))
                return 0
            print(f"{prog}: unknown subcommand {sub!r}\n\n{nested_usage(name, target)}",
                  file=sys.stderr)
            return 2
        target, prog, argv = target[sub], f"{prog} {sub}", argv[1:]
    from eyas.data.common.options import parse
    return target[1](parse(target[0], prog, argv))


def reference() -> str:
    """docs/cli.md from its first command on: each command's help, as markdown."""
    from eyas.data.common.options import markdown, parser
    out = []
    for name, (load, help) in COMMANDS.items():
        out.append(f"## `eyas {name}`\n\n*{help}.*")
        if isinstance(target := load(), dict):
            out.append(f"```\n{nested_usage(name, target)}\n```")
        for sub, (cls, *_) in target.items() if isinstance(target, dict) else [("", target)]:
            words = f"{name} {sub}".rstrip()
            out.append((f"### `eyas {words}`\n\n" if sub else "")
                       + markdown(parser(cls, f"eyas {words}"), WIDTH))
    return "\n\n".join(out) + "\n"


USAGE = "usage: eyas <command> [--help] [args...]\n       eyas --version\n\ncommands:\n" + (
    "\n").join(
    f"  {name:<13}{text}" for name, (_, text) in COMMANDS.items()) + (
    "\n\ntraining: accelerate launch train/main.py [hydra overrides]   (or ./launch.sh --help)"
    "\n\nexit status: 0 ok, 1 findings (validate, verify, doctor, engines check), 2 usage or "
    "configuration\nerror (bad argument or config, missing or wrong path), 3 a stage that cannot "
    "run here\n(EYAS_DEBUG=1 shows the traceback behind a one-line error)")


def version() -> str:
    """The installed distribution's version (pyproject.toml's `version`)."""
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("eyas")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # no command: a usage error
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"eyas {version()}")
        return 0
    if argv[0] == "--markdown" and len(argv) == 2:     # rewrite docs/cli.md's generated part
        from pathlib import Path
        text = Path(argv[1]).read_text(encoding="utf-8")
        Path(argv[1]).write_text(text[:text.index("\n## `eyas ") + 1] + reference(), "utf-8")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"eyas: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from eyas.data.common.log import run_command, setup_logging
    setup_logging()
    # on the CPU, the trainer's thread rule for one process (train.dist.set_cpu_threads) unless
    # OMP_NUM_THREADS is set: OpenMP threads spin-wait on busy cores. Help runs nothing (no
    # thread line before it); `generate` only sends requests (no torch)
    if not {"-h", "--help"} & set(rest) and name != "generate" \
            and "OMP_NUM_THREADS" not in os.environ:
        from eyas.data.common.targets import fast_device
        from eyas.train.dist import set_cpu_threads
        if not fast_device():
            set_cpu_threads(None, processes_per_node=1)
    # one place for every subcommand: an error the user can fix is one line and exit 2 (3 for
    # a stage that cannot run here); anything else keeps its traceback
    return run_command(f"eyas {name}", lambda words: call(name, words), rest)


if __name__ == "__main__":
    sys.exit(main())
