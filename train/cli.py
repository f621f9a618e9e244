"""`eyas`: one command with a subcommand per stage. Training itself is
`accelerate launch train/main.py` (or ./launch.sh), because accelerate owns the processes."""

from __future__ import annotations

import sys
from typing import Callable


# one function per subcommand: each imports its module's cli_main only when it runs, so
# `eyas --help` stays fast and every arrow is a plain import
def _prepare(argv: list[str]) -> int:
    from eyas.data.prepare import cli_main
    return cli_main(argv)


def _synthesize(argv: list[str]) -> int:
    from eyas.data.synthesize import cli_main
    return cli_main(argv)


def _extract(argv: list[str]) -> int:
    from eyas.data.extract import cli_main
    return cli_main(argv)


def _import(argv: list[str]) -> int:
    from eyas.data.importers import cli_main
    return cli_main(argv)


def _vocab(argv: list[str]) -> int:
    from eyas.data.vocab import cli_main
    return cli_main(argv)


def _inspect(argv: list[str]) -> int:
    from eyas.data.inspect import cli_main
    return cli_main(argv)


def _export(argv: list[str]) -> int:
    from eyas.models.serving.export import cli_main
    return cli_main(argv)


def _validate(argv: list[str]) -> int:
    from eyas.models.serving.validate import cli_main
    return cli_main(argv)


def _doctor(argv: list[str]) -> int:
    from eyas.models.serving.doctor import cli_main
    return cli_main(argv)


def _engines(argv: list[str]) -> int:
    from eyas.models.serving.engines import cli_main
    return cli_main(argv)


def _evaluate(argv: list[str]) -> int:
    from eyas.train.evaluate import cli_main
    return cli_main(argv)


# subcommand -> (its runner, one-line help)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "prepare": (_prepare, "tokenise conversations (or generate them with the target) into a token dataset"),
    "synthesize": (_synthesize, "sample user prompts from the target itself (more, different prompts)"),
    "extract": (_extract, "run the target over a token dataset and store its hidden states"),
    "import": (_import, "convert SpecForge/speculators hidden states into an eyas dataset"),
    "vocab": (_vocab, "build the draft vocabulary map (d2t/t2d) from a dataset"),
    "inspect": (_inspect, "summarise a dataset: samples, tokens, bytes/token, modes"),
    "export": (_export, "turn a training checkpoint into a directory vLLM and SGLang load"),
    "validate": (_validate, "check an exported drafter against the serving contract"),
    "doctor": (_doctor, "explain the likely causes of low acceptance"),
    "engines": (_engines, "load an export with vLLM's and SGLang's own loaders (CPU, own venvs)"),
    "evaluate": (_evaluate, "offline acceptance on a dataset, or real speculative decoding"),
}

USAGE = "usage: eyas <command> [--help] [args...]\n\ncommands:\n" + "\n".join(
    f"  {name:<11}{text}" for name, (_, text) in COMMANDS.items()) + (
    "\n\ntraining: accelerate launch train/main.py [hydra overrides]   (or ./launch.sh --help)")


def _cpu_threads() -> None:
    """On the CPU, the trainer's thread rule for one process (train.dist.set_cpu_threads) unless
    OMP_NUM_THREADS is set: OpenMP threads spin-wait on busy cores."""
    import os

    from eyas.data.targets import fast_device
    from eyas.train.dist import set_cpu_threads
    if not fast_device() and "OMP_NUM_THREADS" not in os.environ:
        set_cpu_threads(None, processes_per_node=1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"eyas: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from eyas.data.log import setup_logging
    setup_logging()
    _cpu_threads()
    return int(COMMANDS[name][0](rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
