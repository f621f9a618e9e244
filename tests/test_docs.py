"""The docs show only commands that exist and link only to files that exist.

README.md and docs/*.md are read for `eyas <subcommand> [<nested subcommand>] ... --option ...`
in code blocks and inline code: each subcommand must be one `eyas --help` lists, and each
`--option` written after it (up to the next `eyas`, a shell separator or a comment) must appear
in that subcommand's `--help` output (`python -m eyas.train.cli <sub> [<nested>] --help`, run
once per subcommand). Every relative markdown link of README.md, docs/*.md and
benchmarks/README.md must name an existing file, and a `#fragment` into a markdown file one of
its headings. A doc that names a missing option is fixed in the doc, not here.
"""

from __future__ import annotations

import pytest
import functools
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*DOCS, ROOT / "benchmarks" / "README.md"]

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
# `eyas` as a command: at the start, after a space, a bracket, a quote or a path (.venv/bin/eyas)
INVOCATION = re.compile(r"(?:^|(?<=[\s(\[\"'/]))eyas\s+(-{1,2}[\w-]+|[a-z][\w-]*)")
OPTION = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
STOP = re.compile(r"\s(?:#|\||;|&&)\s|\s#$|\|\|")     # a comment or a shell separator
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@dataclass
class Use:
    """One `eyas ...` in a doc: where, which (nested) subcommand, which long options."""
    where: str
    words: tuple[str, ...]
    options: list[str] = field(default_factory=list)


def code_fragments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every code block line (continuation lines joined) and every inline code
    span (a paragraph's lines joined, so a span may wrap) of a markdown file."""
    out: list[tuple[int, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    in_fence, pending, pending_line = False, "", 0
    para: list[tuple[int, str]] = []

    def flush_para():
        if para:
            text = " ".join(t for _, t in para)
            out.extend((para[0][0], m.group(2)) for m in CODE_SPAN.finditer(text))
            para.clear()

    for no, line in enumerate(lines, 1):
        if FENCE.match(line):
            flush_para()
            in_fence = not in_fence
            continue
        if in_fence:
            if not pending:
                pending_line = no
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((pending_line, pending + line))
            pending = ""
        elif line.strip():
            para.append((no, line.strip()))
        else:
            flush_para()
    flush_para()
    return out


def uses(path: Path) -> list[Use]:
    found = []
    for no, text in code_fragments(path):
        matches = list(INVOCATION.finditer(text))
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
            rest = text[m.end():end]
            stop = STOP.search(rest)
            rest = rest[:stop.start()] if stop else rest
            first = m.group(1)
            if first.startswith("-"):          # `eyas --help`, `eyas --version`
                found.append(Use(f"{path.relative_to(ROOT)}:{no}", (), [first]))
                continue
            words = [first]
            nxt = re.match(r"\s+([a-z][\w-]*)", rest)
            if nxt and nxt.group(1) in nested_commands(first):
                words.append(nxt.group(1))
            found.append(Use(f"{path.relative_to(ROOT)}:{no}", tuple(words),
                             OPTION.findall(rest)))
    return found


@functools.lru_cache(maxsize=None)
def help_text(words: tuple[str, ...]) -> str:
    """`eyas <words> --help`, run in a scratch directory (no checkout folder shadows a package)."""
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", *words, "--help"],
                       capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir(),
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, f"eyas {' '.join(words)} --help exited {r.returncode}:\n{r.stderr}"
    return r.stdout + r.stderr


@functools.lru_cache(maxsize=None)
def subcommands() -> frozenset[str]:
    listing = help_text(()).split("commands:", 1)[1].split("\n\n", 1)[0]
    return frozenset(re.findall(r"^  ([a-z][\w-]*)\s", listing, re.M))


@functools.lru_cache(maxsize=None)
def nested_commands(sub: str) -> frozenset[str]:
    """The nested subcommands of `sub` (`eyas engines {setup,check,list}`), from its usage line."""
    if sub not in subcommands():
        return frozenset()
    m = re.match(rf"usage: eyas {re.escape(sub)} \{{([\w,-]+)\}}", help_text((sub,)))
    return frozenset(m.group(1).split(",")) if m else frozenset()


@pytest.mark.slow
def test_docs_name_only_existing_commands_and_options():
    # one test for both checks: under pytest-xdist each --help still runs once
    subs = subcommands()
    found = [u for doc in DOCS for u in uses(doc)]
    assert any(u.words for u in found), "no `eyas <subcommand>` found in the docs"
    unknown = [f"{u.where}: eyas {u.words[0]}" for u in found if u.words and u.words[0] not in subs]
    assert not unknown, "subcommands that `eyas --help` does not list:\n" + "\n".join(unknown)
    needed = sorted({u.words for u in found if u.options})
    with ThreadPoolExecutor(max_workers=4) as pool:     # every --help at once
        texts = dict(zip(needed, pool.map(help_text, needed)))
    missing = []
    for u in found:
        for opt in u.options:
            if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", texts[u.words]):
                missing.append(f"{u.where}: eyas {' '.join(u.words)} {opt}".replace("  ", " "))
    assert not missing, "options missing from the subcommand's --help:\n" + "\n".join(missing)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation
    other than `-` and `_` dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out, in_fence = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of each markdown link outside code."""
    out, in_fence = [], False
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            plain = CODE_SPAN.sub(lambda m: "code" if "](" not in m.group(0) else m.group(0), line)
            out.extend((no, m.group(1)) for m in LINK.finditer(plain))
    return out


def test_relative_links_resolve():
    checked, broken = 0, []
    for doc in LINKED:
        for no, target in links(doc):
            if re.match(r"[a-z][\w+.-]*:", target):      # http:, https:, mailto:
                continue
            file, _, fragment = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            where = f"{doc.relative_to(ROOT)}:{no}: {target}"
            checked += 1
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{where} (no heading with that anchor)")
    assert checked, "no relative links found"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_documents_the_ci_test_command():
    # .ci/run runs "the README's test command", `./launch.sh --test ...`
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Tests and benchmarks", 1)[1].split("\n## ", 1)[0]
    assert "`./launch.sh --test` runs `pytest`" in section
    assert "./launch.sh --test -n 2" in text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
