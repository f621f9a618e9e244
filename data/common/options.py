"""Command-line options declared once: a subcommand's options are the fields of one dataclass,
and `parser` turns that dataclass into its argparse parser.

A field's type and default are the option's; `option()` adds what argparse needs besides (help,
other flag spellings, choices, metavar, a help group); `shared()` declares an option that the
trainer also configures: its default and help come from the setting's own field
(`data.common.settings`), and its help names the Hydra key, so the two cannot drift
(tests/train/test_cli_defaults.py).

Written on argparse rather than taken from tyro, simple-parsing or jsonargparse: those read help
from attribute docstrings by parsing the source at run time and spell flags and help their own
way (`--flag/--no-flag`, their own layout), while eyas's interface (every flag, default and help
text) predates this module and argparse produces it exactly.
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
    """A dataclass field that is a command-line option.

    No default: a required option (or a positional, with `positional=True`). `flags` replaces
    the `--field-name` spelling; `type` parses the text (default: the field's int or float
    annotation; a `bool` field is a flag); `group` is a titled help section; fields sharing an
    `exclusive` name are mutually exclusive; `action="append"` makes a repeatable option."""
    meta = {_KEY: dict(help=help, flags=tuple(flags), positional=positional, type=type,
                       choices=choices, metavar=metavar, group=group, exclusive=exclusive,
                       action=action)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def setting(default: Any, help: str) -> Any:
    """A settings field (shared by the Hydra schema and the subcommands) and its help."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def default(cls: type, name: str) -> Any:
    """The default of field `name` of dataclass `cls`, an enum as its value."""
    f = next(f for f in fields(cls) if f.name == name)
    value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    return value.value if isinstance(value, Enum) else value


def shared(cls: type, name: str, key: str | None = None, note: str = "", **kw: Any) -> Any:
    """An option backed by setting `name` of `cls`: the setting's default (an enum's choices
    become the option's) and its help, then `note`, then "(default: KEY, VALUE)" naming the
    trainer's Hydra key `key` (e.g. "data.max_length") where there is one."""
    f = next(f for f in fields(cls) if f.name == name)
    raw = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    if isinstance(raw, Enum):
        kw.setdefault("choices", [e.value for e in type(raw)])
    value = default(cls, name)
    text = " ".join(t for t in (f.metadata.get("help", ""), note) if t)
    named = f"{key}, " if key else ""
    help = f"{text} (default: {named}{value})".replace("%", "%%")
    return option(value, help, **kw)


def _kwargs(f: Any, meta: dict[str, Any], hint: Any) -> dict[str, Any]:
    """add_argument's keywords for field `f` (annotated `hint`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    kw: dict[str, Any] = {"help": meta["help"]}
    for name in ("choices", "metavar", "action"):
        if meta[name] is not None:
            kw[name] = meta[name]
    if hint is bool:
        kw["action"] = "store_true"
    elif meta["type"] is not None or hint in (int, float):
        kw["type"] = meta["type"] or hint
    missing = f.default is MISSING and f.default_factory is MISSING
    if missing and not meta["positional"]:
        kw["required"] = True
    elif not missing:
        kw["default"] = f.default if f.default is not MISSING else f.default_factory()
    if meta["flags"] and meta["flags"][0].lstrip("-").replace("-", "_") != f.name:
        kw["dest"] = f.name
    return kw


def parser(cls: type, prog: str, description: str,
           epilog: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser of the options dataclass `cls`, options in field order."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                formatter_class=HelpFormatter)
    hints = typing.get_type_hints(cls)
    boxes: dict[Any, Any] = {}
    for f in fields(cls):
        meta = f.metadata[_KEY]
        box = p
        if meta["group"]:
            if meta["group"] not in boxes:
                boxes[meta["group"]] = p.add_argument_group(meta["group"])
            box = boxes[meta["group"]]
        if meta["exclusive"]:
            key = ("exclusive", meta["exclusive"])
            if key not in boxes:
                boxes[key] = box.add_mutually_exclusive_group()
            box = boxes[key]
        names = ([f.name] if meta["positional"]
                 else list(meta["flags"]) or ["--" + f.name.replace("_", "-")])
        box.add_argument(*names, **_kwargs(f, meta, hints[f.name]))
    return p
