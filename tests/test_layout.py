"""The import rules of the layout, checked on an import graph built from the source.

Every ``.py`` under data/, models/, kernels/, train/ and conf/ is parsed (ast, nothing is
imported); each ``import``/``from … import`` statement, at module level or inside a function,
becomes an arrow from its file to the files it names. A relative import is resolved against the
file's package; ``from eyas.data import x`` is an arrow to ``data/__init__.py`` and, when ``x``
is a submodule, to ``data/x.py`` too. A bare ``import name`` of a sibling file (the engine probe
scripts, which run outside eyas) is an arrow to that sibling unless `name` is a standard-library
module (data/common/settings.py's ``import inspect`` is not data/store/inspect.py). The rules (zero
exceptions):

- data/ imports nothing of eyas.models, eyas.kernels, eyas.train;
- models/ and kernels/ never import eyas.train; kernels/ imports nothing of the project;
- the network part of models/ (everything outside models/serving/) never imports
  eyas.models.serving;
- data/ is three rooms and the runtime engine: data/common/ (the common base) imports nothing
  of eyas outside it; data/store/ (the dataset format and its readers) imports only the common
  base; data/engine/ (vLLM in its own venv) imports only the common base; data/produce/ (the
  stages that build datasets) may import all three. models/ (network and serving) never
  imports the dataset-producing stages;
- evaluation (train/evaluate/) sits between the job and the serving contract: of train/ it
  imports only itself, the schema (train/config.py) and train/plots.py; models/ never imports it
  (the rule above);
- no file loads a project module by string (``importlib.import_module``, ``__import__``,
  ``importlib.util``): every arrow is an ``import`` statement;
- no file imports the bare folder names (``data``, ``models``, …) instead of ``eyas.…``;
- no import cycle between files.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "eyas"
FOLDERS = ("data", "models", "kernels", "train", "conf")
SERVING = f"{PACKAGE}.models.serving"
#: folder -> project packages it must not import (prefixes of dotted names)
FORBIDDEN = {
    "data": (f"{PACKAGE}.models", f"{PACKAGE}.kernels", f"{PACKAGE}.train"),
    "models": (f"{PACKAGE}.train",),
    "kernels": (f"{PACKAGE}.data", f"{PACKAGE}.models", f"{PACKAGE}.train", f"{PACKAGE}.conf"),
}
#: file path prefix -> project packages it must not import: the rooms of data/
ROOMS = {
    ("data", "common"): (f"{PACKAGE}.data.store", f"{PACKAGE}.data.produce", f"{PACKAGE}.data.engine"),
    ("data", "store"): (f"{PACKAGE}.data.produce", f"{PACKAGE}.data.engine"),
    ("data", "engine"): (f"{PACKAGE}.data.store", f"{PACKAGE}.data.produce"),
    ("models",): (f"{PACKAGE}.data.produce",),
}
#: what evaluation may import of train/ besides itself
EVALUATION = f"{PACKAGE}.train.evaluate"
EVALUATION_READS = (EVALUATION, f"{PACKAGE}.train.config", f"{PACKAGE}.train.plots")
_LOADERS = {"import_module", "__import__", "spec_from_file_location", "find_spec",
            "module_from_spec", "spec_from_loader", "SourceFileLoader"}


@dataclass(frozen=True)
class Arrow:
    src: Path       # the importing file
    line: int
    target: str     # dotted module name it imports (eyas.data.common.utils), or a sibling script
    dst: Path | None  # the project file behind `target`, when there is one


def modules(root: Path) -> dict[str, Path]:
    """Dotted name (eyas.data.common.utils, eyas.data for data/__init__.py) -> file, for every folder."""
    out: dict[str, Path] = {}
    for folder in FOLDERS:
        for f in sorted((root / folder).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((PACKAGE, *parts))] = f
    return out


def _name_of(path: Path, mods: dict[str, Path]) -> tuple[str, bool]:
    name = next(n for n, f in mods.items() if f == path)
    return name, path.name == "__init__.py"


def _is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _resolve(node: ast.ImportFrom, name: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def arrows(path: Path, tree: ast.AST, mods: dict[str, Path]) -> list[Arrow]:
    """Every import statement of one file as arrows (see the module docstring)."""
    name, is_pkg = _name_of(path, mods)
    out: list[Arrow] = []

    def add(line: int, target: str) -> None:
        dst = mods.get(target)
        if (dst is None and "." not in target and target not in sys.stdlib_module_names
                and (path.parent / f"{target}.py").is_file()):
            dst = path.parent / f"{target}.py"  # a script importing its sibling by path
        out.append(Arrow(path, line, target, dst))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, name, is_pkg)
            add(node.lineno, base)
            for alias in node.names:
                if f"{base}.{alias.name}" in mods:
                    add(node.lineno, f"{base}.{alias.name}")
    return out


def string_loads(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """Calls that load a module by name or file: only a constant, non-project name is allowed."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
        if called not in _LOADERS:
            continue
        arg = node.args[0] if node.args else None
        text = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
        top = text.split(".")[0] if text else None
        if text is None or top in (PACKAGE, *FOLDERS) or text.endswith(".py"):
            out.append((node.lineno, f"{called}({ast.unparse(arg) if arg else ''})"))
    return out


def cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """Strongly connected components of more than one file (or a file importing itself)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []

    def visit(v: Path) -> None:  # Tarjan, iterative over successors via recursion depth ~ files
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def violations(root: Path) -> list[str]:
    """Every broken rule under `root`, one line each naming the file and line."""
    mods = modules(root)
    out: list[str] = []
    graph: dict[Path, set[Path]] = {f: set() for f in mods.values()}
    for f in mods.values():
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        rel = f.relative_to(root)
        folder = rel.parts[0]
        network = folder == "models" and rel.parts[1:2] != ("serving",)
        for a in arrows(f, tree, mods):
            where = f"{rel}:{a.line}"
            if a.dst is not None and a.dst != f:
                graph[f].add(a.dst)
            top = a.target.split(".")[0]
            if top in FOLDERS and a.dst is None:  # (a sibling script is not a folder name)
                out.append(f"{where}: imports {a.target!r}; the project imports as "
                           f"{PACKAGE}.{a.target}")
            for bad in FORBIDDEN.get(folder, ()):
                if _is_under(a.target, bad):
                    out.append(f"{where}: {folder}/ must not import {bad} ({a.target})")
            for prefix, banned in ROOMS.items():
                if rel.parts[:len(prefix)] == prefix:
                    for bad in banned:
                        if _is_under(a.target, bad):
                            out.append(f"{where}: {'/'.join(prefix)}/ must not import {bad} "
                                       f"({a.target})")
            if (rel.parts[:2] == ("train", "evaluate") and _is_under(a.target, f"{PACKAGE}.train")
                    and not any(_is_under(a.target, ok) for ok in EVALUATION_READS)):
                out.append(f"{where}: evaluation (train/evaluate/) must not import the job "
                           f"({a.target})")
            if network and _is_under(a.target, SERVING):
                out.append(f"{where}: the network (models/ outside serving/) must not import "
                           f"the serving contract ({a.target})")
        for line, call in string_loads(f, tree):
            out.append(f"{rel}:{line}: loads a module by string ({call}); use an import")
    for comp in cycles(graph):
        out.append("import cycle: " + " -> ".join(str(p.relative_to(root)) for p in comp))
    return out


def test_import_rules_hold():
    found = violations(ROOT)
    assert not found, "import rules broken:\n" + "\n".join(found)


def test_graph_sees_the_known_arrows():
    """The graph is built from the code: known arrows of the tree are in it."""
    mods = modules(ROOT)
    f = ROOT / "models" / "serving" / "validate.py"
    dsts = {a.dst for a in arrows(f, ast.parse(f.read_text()), mods)}
    assert ROOT / "models" / "serving" / "contract.py" in dsts
    probe = ROOT / "models" / "serving" / "loaders" / "probe_vllm.py"
    dsts = {a.dst for a in arrows(probe, ast.parse(probe.read_text()), mods)}
    assert probe.with_name("_probe_common.py") in dsts


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_checker_reports_a_violating_tree(tmp_path):
    for pkg in FOLDERS:
        _write(tmp_path, f"{pkg}/__init__.py", "")
    _write(tmp_path, "models/serving/__init__.py", "")
    _write(tmp_path, "models/serving/contract.py", "")
    _write(tmp_path, "data/a.py", "def f():\n    from eyas.models import drafter\n")
    _write(tmp_path, "models/drafter.py", "from .serving import contract\n")
    _write(tmp_path, "kernels/k.py", "import eyas.data.a\n")
    _write(tmp_path, "train/x.py", "from . import y\n")
    _write(tmp_path, "train/y.py", "def g():\n    from eyas.train import x\n")
    _write(tmp_path, "train/z.py", "import importlib\nimportlib.import_module('eyas.train.x')\n"
                                   "import models.drafter\n")
    _write(tmp_path, "train/evaluate/__init__.py", "")
    _write(tmp_path, "train/evaluate/walk.py", "from eyas.train.config import C\n"
                                              "from eyas.train import trainer\n")
    _write(tmp_path, "data/store/__init__.py", "")
    _write(tmp_path, "data/store/reader.py", "from eyas.data.produce import stage\n")
    _write(tmp_path, "data/produce/__init__.py", "")
    _write(tmp_path, "data/produce/stage.py", "")
    _write(tmp_path, "data/common/__init__.py", "")
    _write(tmp_path, "data/common/base.py", "import eyas.data.store.reader\n")
    _write(tmp_path, "models/serving/uses_build.py", "from eyas.data.produce.stage import x\n")
    found = "\n".join(violations(tmp_path))
    assert "data/store/reader.py:1: data/store/ must not import eyas.data.produce" in found
    assert "data/common/base.py:1: data/common/ must not import eyas.data.store" in found
    assert "models/serving/uses_build.py:1: models/ must not import eyas.data.produce" in found
    assert "data/a.py:2: data/ must not import eyas.models" in found
    assert "models/drafter.py:1: the network" in found
    assert "kernels/k.py:1: kernels/ must not import eyas.data" in found
    assert "import cycle: train/x.py -> train/y.py" in found
    assert "train/z.py:2: loads a module by string" in found
    assert "train/z.py:3: imports 'models.drafter'" in found
    assert "train/evaluate/walk.py:2: evaluation (train/evaluate/) must not import the job" in found
    assert "train/evaluate/walk.py:1" not in found
