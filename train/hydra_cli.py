"""Hydra's side of the training entry point (train/main.py): a bad override told with its fix,
the config groups `--help` lists, and run_name checked before Hydra makes a directory.

    explain(e) -> str     a bad override in one line: the nearest valid key of a misspelt one
                          (Hydra's own advice, to add it with '+', would add a key nothing
                          reads), the quoting rule for a value the override grammar cannot read;
                          any other Hydra error as Hydra prints it
    config_groups() -> str    `--help`'s groups and their presets (the `eyas_help_groups`
                          resolver of conf/config.yaml): conf/<group>/*.yaml, not conf/accelerate/
    RunNameCheck          a hydra.callbacks entry: run_name is a name (`limits.run_name_message`),
                          refused before runs/<run_name> or runs/<run_name>-sweep is made
"""

from __future__ import annotations

import difflib
import logging
import re
from pathlib import Path
from typing import Any

from hydra.errors import OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

log = logging.getLogger("eyas")

CONF = Path(__file__).resolve().parents[1] / "conf"
NOT_GROUPS = ("accelerate",)   # `accelerate launch --config_file` files for launch.sh
FULL_ERROR = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
_KEY = re.compile(r"[+~]{0,2}[\w./@-]+")


def explain(e: BaseException) -> str:
    """What the user reads for Hydra's error `e` (one line for a misspelt key or an unreadable
    value; Hydra's own text, and its cause's, otherwise)."""
    cause = e.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) \
            and str(e).startswith("Could not override") \
            and isinstance(cause.parent_node, DictConfig):
        return _nearest_key(str(e), cause)
    if isinstance(e, OverrideParseException) and (hint := _quoting(e.override)):
        return f"{str(e).splitlines()[0]} in the override {e.override!r}. {hint}"
    text = str(e) + (f"\n{cause}" if isinstance(cause, OmegaConfBaseException) else "")
    return f"{text}\n\n{FULL_ERROR}"


def _nearest_key(message: str, cause: OmegaConfBaseException) -> str:
    """`Could not override 'optim.lrr': Key 'lrr' not in 'OptimConfig'. Did you mean optim.lr?
    Fix: optim.lr=1e-3`; without a close key, the node's keys."""
    override = re.search(r"Could not override '([^']*)'", message).group(1)
    value = message.partition("\nTo append to your config use +")[2].partition("=")[2]
    key, full = str(cause.key), str(cause.full_key)
    keys = [str(k) for k in cause.parent_node]
    where = full[:-len(key)].rstrip(".") if full.endswith(key) else ""
    head = f"Could not override {override!r}: {str(cause).splitlines()[0]}. "
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close:
        return head + (f"The keys of {where or 'the config'}: {', '.join(keys)}. Fix: one of "
                       f"them (each is documented in train/config.py)")
    fixed = (f"{where}." if where else "") + close[0] + override[len(full):]
    return head + f"Did you mean {fixed}? Fix: {fixed}={value}"


def _quoting(override: str) -> str | None:
    """The quoting rule for `override` when its key reads as a key and its value is unquoted:
    Hydra's override grammar reserves = , ( ) [ ] { } : and whitespace in values."""
    key, eq, value = override.partition("=")
    if not eq or not _KEY.fullmatch(key) or value[:1] in ("'", '"', "[", "{"):
        return None
    shell = f"'{key}=\"{value}\"'" if "'" not in value else f"\"{key}='{value}'\""
    return (f"Hydra reads = , ( ) [ ] {{ }} : and spaces in an unquoted value as override "
            f"syntax. Fix: quote the value, e.g. {shell} (the outer quotes are the shell's)")


def config_groups(*_: Any) -> str:
    """The groups a run picks presets from (`group=option`), one line each, as `--help` shows
    them: every conf/<group>/ with YAML presets, but the launcher's files in conf/accelerate/."""
    lines = []
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name not in NOT_GROUPS):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        if options:
            how = "  (+experiment=NAME: a whole recipe)" if group.name == "experiment" else ""
            lines.append(f"{group.name}: {', '.join(options)}{how}")
    return "\n".join(lines)


class RunNameCheck(Callback):
    """conf/config.yaml's hydra.callbacks: run_name is a name, checked before Hydra makes the
    run's directory runs/<run_name> or the sweep's runs/<run_name>-sweep. Hydra turns a
    callback's exception into a warning and goes on, so a bad name ends the process here: one
    line (rank 0), exit status 2."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from eyas.data.common.log import EXIT_USAGE, current_rank
        from eyas.train.limits import run_name_message
        if (message := run_name_message(config.run_name)) is not None:
            if current_rank() == 0:
                log.error("bad configuration: %s", message)
            raise SystemExit(EXIT_USAGE)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.on_run_start(config)


#: `KEY=VALUE` overrides that stand for a group's switch: data.stream=true is
#: data.stream.enabled=true (sweeps too: data.stream=true,false)
SHORTHANDS = {"data.stream": "data.stream.enabled"}


def expand_shorthands(overrides: list[str]) -> list[str]:
    """`overrides` with each shorthand spelt out (SHORTHANDS)."""
    out = []
    for o in overrides:
        key, sep, value = o.partition("=")
        prefix = key[:len(key) - len(key.lstrip("+~"))]
        full = SHORTHANDS.get(key[len(prefix):])
        out.append(f"{prefix}{full}{sep}{value}" if full and sep else o)
    return out
