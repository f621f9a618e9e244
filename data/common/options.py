"""Command-line options declared once: a subcommand's options are the fields of one dataclass,
and `parser` turns that dataclass into its argparse parser.

A field's type and default are the option's; `option()` adds the rest (help, flags, choices, a
help group); `shared()` declares an option the trainer also configures, with the default and
help of the setting's own field (`data.common.settings`) and its Hydra key named, so the two
cannot drift (tests/train/test_cli_defaults.py).

Plain argparse, not tyro, simple-parsing or jsonargparse: they take help from attribute
docstrings by parsing the source at run time and spell flags and help their own way
(`--flag/--no-flag`), where argparse gives eyas's flags, defaults and help exactly.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, field, fields
from enum import Enum
from typing import Any, Callable, Sequence

from eyas.data.common.log import HelpFormatter

_KEY = "eyas.option"


def option(default: Any = MISSING, help: str | None = None, *, flags: Sequence[str] = (),
           positional: bool = False, type: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, metavar: str | None = None,
           group: str | None = None, exclusive: str | None = None,
           action: str | None = None) -> Any:
    """A dataclass field that is a command-line option: required without a default (or a
    positional); `flags` replaces the `--field-name` spelling; `type` parses the text (default:
    an int or float annotation; a bool field is a flag); `group` titles a help section; fields
    sharing an `exclusive` name exclude each other; `action="append"` repeats."""
    meta = dict(help=help, flags=tuple(flags), positional=positional, type=type,
                choices=choices, metavar=metavar, group=group, exclusive=exclusive, action=action)
    return _field(default, {_KEY: meta})


def setting(default: Any, help: str) -> Any:
    """A settings field (the Hydra schema's and the subcommands') with its help text."""
    return _field(default, {"help": help})


def _field(default: Any, metadata: dict[str, Any]) -> Any:
    if isinstance(default, list):            # a fresh list per instance
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def default(cls: type, name: str) -> Any:
    """The default of field `name` of dataclass `cls`, an enum as its value."""
    f = next(f for f in fields(cls) if f.name == name)
    value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return value.value if isinstance(value, Enum) else value


def shared(cls: type, name: str, key: str | None = None, note: str = "", **kw: Any) -> Any:
    """An option backed by setting `name` of `cls`: its default (an enum's values are the
    choices) and help, then `note`, then "(default: KEY, VALUE)" naming the Hydra key `key`."""
    f = next(f for f in fields(cls) if f.name == name)
    if isinstance(f.default, Enum):
        kw.setdefault("choices", [e.value for e in type(f.default)])
    text = " ".join(t for t in (f.metadata.get("help", ""), note) if t)
    named = f"{key}, " if key else ""
    value = default(cls, name)
    return option(value, f"{text} (default: {named}{value})".replace("%", "%%"), **kw)


def _add(box: Any, f: Any, meta: dict[str, Any], hint: Any) -> None:
    """add_argument for field `f`, annotated `hint`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):      # X | None: X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    kw = {k: meta[k] for k in ("help", "choices", "metavar", "action") if meta[k] is not None}
    if hint is bool:
        kw["action"] = "store_true"
    elif meta["type"] is not None or hint in (int, float):
        kw["type"] = meta["type"] or hint
    if f.default is not MISSING or f.default_factory is not MISSING:
        kw["default"] = f.default if f.default is not MISSING else f.default_factory()
    elif not meta["positional"]:
        kw["required"] = True
    names = ([f.name] if meta["positional"]
             else list(meta["flags"]) or ["--" + f.name.replace("_", "-")])
    if meta["flags"] and names[0].lstrip("-").replace("-", "_") != f.name:
        kw["dest"] = f.name
    box.add_argument(*names, **kw)


def parser(cls: type, prog: str, description: str,
           epilog: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser of the options dataclass `cls`, options in field order."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                formatter_class=HelpFormatter)
    hints, boxes = typing.get_type_hints(cls), {}
    for f in fields(cls):
        meta, box = f.metadata[_KEY], p
        if meta["group"]:
            box = boxes.get(meta["group"]) or boxes.setdefault(
                meta["group"], p.add_argument_group(meta["group"]))
        if meta["exclusive"]:
            box = boxes.get(meta["exclusive"]) or boxes.setdefault(
                meta["exclusive"], box.add_mutually_exclusive_group())
        _add(box, f, meta, hints[f.name])
    return p
