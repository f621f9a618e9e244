"""Check exported drafters with vLLM's and SGLang's own model loaders, on CPU, before serving.

    from eyas.models.serving.engines import check_engines
    reports = check_engines("out/drafter", "llama-3.1-8b")      # {"vllm": EngineReport, ...}

    eyas engines setup                      # create the engine venvs (~14 GB, minutes, once)
    eyas engines check DIR --target-config T [--engines vllm,sglang]

The engines never run inside eyas's interpreter: each lives in its own virtual environment
(venvs.py, default ~/.cache/eyas/engines/<engine>-<version>) and is driven through a probe script
(probe_vllm.py, probe_sglang.py) in a subprocess; check.py turns what the probes saw into
`EngineReport`s with findings. Nothing else in eyas imports vllm or sglang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_engines", "check_engines_many", "EngineReport", "ensure_venv",
           "DEFAULT_VERSIONS", "ENGINES", "cli_main", "engines_cli_main"]


def __getattr__(name: str) -> Any:  # lazy: `eyas --help` must not import torch
    if name in ("check_engines", "check_engines_many", "EngineReport", "format_reports"):
        from eyas.models.serving.engines import check
        return getattr(check, name)
    if name in ("ensure_venv", "DEFAULT_VERSIONS", "ENGINES", "EngineSetupError"):
        from eyas.models.serving.engines import venvs
        return getattr(venvs, name)
    raise AttributeError(name)


def cli_main(argv: list[str] | None = None) -> int:
    """`eyas engines setup|check|list …` (see models/serving/engines/cli.py)."""
    from eyas.models.serving.engines.cli import cli_main as main
    return main(argv)


def engines_cli_main(argv: list[str] | None = None) -> int:
    """`eyas engines check` arguments: DIR --target-config T [--engines vllm,sglang] …"""
    from eyas.models.serving.engines.cli import engines_cli_main as main
    return main(argv)
