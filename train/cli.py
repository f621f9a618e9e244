"""`eyas`: one command with a subcommand per stage. Training itself is
`accelerate launch train/main.py` (or ./launch.sh), because accelerate owns the processes."""

from __future__ import annotations

import sys
from typing import Callable

# subcommand -> one-line help
COMMANDS: dict[str, str] = {
    "prepare": "tokenise conversations (or generate them with the target) into a token dataset",
    "generate": "answer prompts with a served target (OpenAI-compatible endpoint)",
    "synthesize": "sample user prompts from the target itself (more, different prompts)",
    "extract": "run the target over a token dataset and store its hidden states",
    "import": "convert SpecForge/speculators hidden states into an eyas dataset",
    "export-data": "write a hidden-state dataset in speculators' offline training layout",
    "vocab": "build the draft vocabulary map (d2t/t2d) from a dataset",
    "inspect": "summarise a dataset: samples, tokens, bytes/token, modes",
    "verify": "re-run dataset samples through the target and compare what is stored",
    "export": "turn a training checkpoint into a directory vLLM and SGLang load",
    "validate": "check an exported drafter against the serving contract",
    "doctor": "explain the likely causes of low acceptance",
    "engines": "load an export with vLLM's and SGLang's own loaders (CPU, own venvs)",
    "evaluate": "offline acceptance on a dataset, or real speculative decoding",
}


def _cli_main(name: str) -> Callable[[list[str]], int]:
    """The `cli_main` of subcommand `name`, imported only when it runs (so `eyas --help` stays
    fast), each by a plain import."""
    if name == "prepare":
        from eyas.data.produce.prepare import cli_main
    elif name == "generate":
        from eyas.data.produce.served_cli import cli_main
    elif name == "synthesize":
        from eyas.data.produce.synthesize import cli_main
    elif name == "extract":
        from eyas.data.produce.extract import cli_main
    elif name == "import":
        from eyas.data.produce.importers import cli_main
    elif name == "export-data":
        from eyas.data.produce.export_data import cli_main
    elif name == "vocab":
        from eyas.data.produce.vocab import cli_main
    elif name == "inspect":
        from eyas.data.store.inspect import cli_main
    elif name == "verify":
        from eyas.data.produce.verify import cli_main
    elif name == "export":
        from eyas.models.serving.export_cli import cli_main
    elif name == "validate":
        from eyas.models.serving.validate import cli_main
    elif name == "doctor":
        from eyas.models.serving.doctor import cli_main
    elif name == "engines":
        from eyas.models.serving.engines import cli_main
    else:
        from eyas.train.evaluate.cli import cli_main
    return cli_main


USAGE = "usage: eyas <command> [--help] [args...]\n       eyas --version\n\ncommands:\n" + (
    "\n").join(
    f"  {name:<13}{text}" for name, text in COMMANDS.items()) + (
    "\n\ntraining: accelerate launch train/main.py [hydra overrides]   (or ./launch.sh --help)"
    "\n\nexit status: 0 ok, 1 findings (validate, verify, doctor, engines check), 2 usage or "
    "configuration\nerror (bad argument or config, missing or wrong path), 3 a stage that cannot "
    "run here\n(EYAS_DEBUG=1 shows the traceback behind a one-line error)")


def version() -> str:
    """The installed distribution's version (pyproject.toml's `version`)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("eyas")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _cpu_threads() -> None:
    """On the CPU, the trainer's thread rule for one process (train.dist.set_cpu_threads) unless
    OMP_NUM_THREADS is set: OpenMP threads spin-wait on busy cores."""
    import os

    from eyas.data.common.targets import fast_device
    from eyas.train.dist import set_cpu_threads
    if not fast_device() and "OMP_NUM_THREADS" not in os.environ:
        set_cpu_threads(None, processes_per_node=1)


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
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"eyas: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from eyas.data.common.log import run_command, setup_logging
    setup_logging()
    # help runs nothing: no thread line before it; `generate` only sends requests (no torch)
    if not {"-h", "--help"} & set(rest) and name != "generate":
        _cpu_threads()
    # one place for every subcommand: an error the user can fix is one line and exit 2 (3 for
    # a stage that cannot run here); anything else keeps its traceback
    return run_command(f"eyas {name}", _cli_main(name), rest)


if __name__ == "__main__":
    sys.exit(main())
