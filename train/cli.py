"""`eyas`: one command with a subcommand per stage. Training itself is
`accelerate launch train/main.py` (or ./launch.sh), because accelerate owns the processes."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with cli_main, one-line help)
COMMANDS = {
    "prepare": ("eyas.data.prepare", "tokenise conversations (or generate them with the target) into a token dataset"),
    "synthesize": ("eyas.data.synthesize", "sample user prompts from the target itself (more, different prompts)"),
    "extract": ("eyas.data.extract", "run the target over a token dataset and store its hidden states"),
    "import": ("eyas.data.importers", "convert SpecForge/speculators hidden states into an eyas dataset"),
    "vocab": ("eyas.data.vocab", "build the draft vocabulary map (d2t/t2d) from a dataset"),
    "inspect": ("eyas.data.inspect", "summarise a dataset: samples, tokens, bytes/token, modes"),
    "export": ("eyas.models.serving.export", "turn a training checkpoint into a directory vLLM and SGLang load"),
    "validate": ("eyas.models.serving.validate", "check an exported drafter against the serving contract"),
    "doctor": ("eyas.models.serving.doctor", "explain the likely causes of low acceptance"),
    "engines": ("eyas.models.serving.engines", "load an export with vLLM's and SGLang's own loaders (CPU, own venvs)"),
    "evaluate": ("eyas.train.evaluate", "offline acceptance on a dataset, or real speculative decoding"),
}

USAGE = "usage: eyas <command> [--help] [args...]\n\ncommands:\n" + "\n".join(
    f"  {name:<11}{text}" for name, (_, text) in COMMANDS.items()) + (
    "\n\ntraining: accelerate launch train/main.py [hydra overrides]   (or ./launch.sh --help)")


def _cpu_threads() -> None:
    """Leave a core free on small CPU machines (OpenMP threads spin-wait on busy cores)."""
    import os

    import torch
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"eyas: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    from eyas.train.log import setup_logging
    setup_logging()
    _cpu_threads()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        print(f"eyas {name}: not implemented yet ({module_name}: {e})", file=sys.stderr)
        return 3
    if not hasattr(module, "cli_main"):
        print(f"eyas {name}: not implemented yet ({module_name} has no cli_main)", file=sys.stderr)
        return 3
    return int(module.cli_main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
