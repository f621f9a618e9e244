"""Command-line options declared once: a subcommand's options are the fields of one dataclass,
its docstring the description; `parse` turns the command line into an instance of it.

A field's type and default are the option's; `option()` adds the rest, the rules between
options included (checked by `parse`; an irregular one is the dataclass's `check()`). `shared()`
declares an option the trainer also configures, with the default and help of the setting's own
field (`data.common.settings`) and its Hydra key named, so the two cannot drift
(tests/train/test_cli_defaults.py). `markdown` renders a parser as docs/cli.md shows it.

Plain argparse, not tyro, simple-parsing or jsonargparse: they take help from attribute
docstrings by parsing the source at run time and spell flags and help their own way
(`--flag/--no-flag`), where argparse gives eyas's flags, defaults and help exactly.
"""

from __future__ import annotations

import argparse
import inspect
import os
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
           action: str | None = None, min: float | None = None, max: float | None = None,
           requires: str | dict[str, str] = {}, excludes: dict[str, str] = {},
           needed: str | None = None) -> Any:
    """A dataclass field that is a command-line option: required without a default (or a
    positional); `flags` replaces the `--field-name` spelling; `type` parses the text (default:
    an int or float annotation; a bool field is a flag); `group` titles a help section; fields
    sharing an `exclusive` name exclude each other; `action="append"` repeats.

    Rules: `min`/`max` bound the value; given (not its default), the option `requires` the
    options it maps to their error lines (one name: a plain line) and `excludes` them; one of
    the fields sharing a `needed` name must be given."""
    meta = dict(help=help, flags=tuple(flags), positional=positional, type=type,
                choices=choices, metavar=metavar, group=group, exclusive=exclusive, action=action,
                min=min, max=max, excludes=excludes, needed=needed,
                requires={requires: None} if isinstance(requires, str) else requires)
    return _field(default, {_KEY: meta})


def setting(default: Any, help: str) -> Any:
    """A settings field (the Hydra schema's and the subcommands') with its help text."""
    return _field(default, {"help": help})


def _field(default: Any, metadata: dict[str, Any]) -> Any:
    if isinstance(default, list):            # a fresh list per instance
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _default(f: Any) -> Any:
    """The default of dataclass field `f` (MISSING: none)."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def shared(cls: type, name: str, key: str | None = None, note: str = "", **kw: Any) -> Any:
    """An option backed by setting `name` of `cls`: its default (an enum's values are the
    choices) and help, then `note`, then "(default: KEY, VALUE)" naming the Hydra key `key`."""
    f = next(f for f in fields(cls) if f.name == name)
    if isinstance(f.default, Enum):
        kw.setdefault("choices", [e.value for e in type(f.default)])
    text = " ".join(t for t in (f.metadata.get("help", ""), note) if t)
    named, value = f"{key}, " if key else "", _default(f)
    value = value.value if isinstance(value, Enum) else value
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
    if (value := _default(f)) is not MISSING:
        kw["default"] = value
    elif not meta["positional"]:
        kw["required"] = True
    names = ([f.name] if meta["positional"]
             else list(meta["flags"]) or ["--" + f.name.replace("_", "-")])
    if meta["flags"] and names[0].lstrip("-").replace("-", "_") != f.name:
        kw["dest"] = f.name
    box.add_argument(*names, **kw)


class _Renamed(argparse.Action):
    """An option that was renamed: refused with the new spelling."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {values} is now {self.const.format(values)}")


def parser(cls: type, prog: str) -> argparse.ArgumentParser:
    """The argparse parser of the options dataclass `cls`, options in field order: its
    docstring's first paragraph the description, the others the epilog; `cls.renamed` maps an
    old flag to its new spelling ("{}" the value), which it is refused with."""
    about = inspect.cleandoc(cls.__doc__ or "").split("\n\n")
    p = argparse.ArgumentParser(
        prog=prog, description=about[0], epilog="\n\n".join(about[1:]) or None,
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
    for old, new in getattr(cls, "renamed", {}).items():
        p.add_argument(old, action=_Renamed, const=new, help=argparse.SUPPRESS,
                       default=argparse.SUPPRESS)
    return p


def flag(f: Any) -> str:
    """How field `f` is written on the command line."""
    meta = f.metadata[_KEY]
    return f.name if meta["positional"] else (meta["flags"] or ["--" + f.name.replace("_", "-")])[0]


def _given(opts: Any, f: Any) -> bool:
    return (value := _default(f)) is MISSING or getattr(opts, f.name) != value


def broken_rule(opts: Any) -> str | None:
    """The error line of the first rule the options `opts` break (declared ones in field order,
    then `opts.check()`); None when they keep them all."""
    every = {f.name: f for f in fields(opts)}
    needed: dict[str, list[Any]] = {}
    for f in every.values():
        meta, value = f.metadata[_KEY], getattr(opts, f.name)
        for bound, ok, word in ((meta["min"], lambda v, b: v >= b, ">="),
                                (meta["max"], lambda v, b: v <= b, "<=")):
            if bound is not None and value is not None and not ok(value, bound):
                return f"{flag(f)} must be {word} {bound}, got {value}"
        if meta["needed"]:
            needed.setdefault(meta["needed"], []).append(f)
        if not _given(opts, f):
            continue
        for name, line in meta["requires"].items():
            if not _given(opts, every[name]):
                return line or f"{flag(f)} needs {flag(every[name])}"
        for name, line in meta["excludes"].items():
            if _given(opts, every[name]):
                return line or f"{flag(f)} does not go with {flag(every[name])}"
    for first, *rest in needed.values():
        if not any(_given(opts, f) for f in (first, *rest)):
            return (f"the following arguments are required: {flag(first)} "
                    f"(or {' or '.join(flag(f) for f in rest)})")
    return opts.check() if hasattr(opts, "check") else None


def parse(cls: type, prog: str, argv: Sequence[str] | None = None) -> Any:
    """The options dataclass `cls` made from the command line `argv` (default: sys.argv's);
    a usage error or a broken rule exits 2 with argparse's one line."""
    p = parser(cls, prog)
    opts = cls(**vars(p.parse_args(argv)))
    if (line := broken_rule(opts)) is not None:
        p.error(line)
    return opts


def markdown(p: argparse.ArgumentParser, width: int) -> str:
    """The help of parser `p` as markdown: the description, the usage (`width` columns), a table
    per group of options, the epilog; the home directory written `~`."""
    fmt = HelpFormatter(p.prog, width=width)
    fmt.add_usage(p.usage, p._actions, p._mutually_exclusive_groups)
    out = [" ".join((p.description or "").split()), f"```\n{fmt.format_help().strip()}\n```"]
    for group in p._action_groups:
        rows = [f"| `{fmt._format_action_invocation(a)}` | "
                f"{fmt._expand_help(a) if a.help else ''} |".replace("\n", " ")
                for a in group._group_actions if a.help != argparse.SUPPRESS]
        if rows:
            title = group.title[0].upper() + group.title[1:]
            out.append(f"{title}:\n\n| argument | what |\n|---|---|\n" + "\n".join(rows))
    out.append(" ".join((p.epilog or "").split()))
    return "\n\n".join(t for t in out if t).replace(os.path.expanduser("~"), "~")
