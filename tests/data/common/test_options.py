"""The rules declared on options (data.common.options): each broken one is one argparse line,
exit 2, naming the option and what it needs."""

from dataclasses import dataclass

import pytest

from eyas.data.common.options import option, parse


@dataclass(kw_only=True)
class _Options:
    """A command."""

    renamed = {"--old": "--new {}"}

    source: str | None = option(None, "one of two sources", requires="target", needed="src")
    data: str | None = option(None, "the other", needed="src")
    target: str | None = option(None, "a target")
    k: int = option(1, "a count", min=1, max=8)
    sweep: str | None = option(None, "a sweep", excludes={"many": "--sweep runs at one --k"})
    many: bool = option(False, "many")

    def check(self) -> str | None:
        return "k 7 is unlucky" if self.k == 7 else None


@pytest.mark.parametrize("argv, line", [
    (["--data", "d", "--k", "0"], "--k must be >= 1, got 0"),
    (["--data", "d", "--k", "9"], "--k must be <= 8, got 9"),
    (["--source", "s"], "--source needs --target"),
    ([], "the following arguments are required: --source (or --data)"),
    (["--data", "d", "--sweep", "x", "--many"], "--sweep runs at one --k"),
    (["--data", "d", "--k", "7"], "k 7 is unlucky"),
    (["--data", "d", "--old", "v"], "--old v is now --new v"),
])
def test_a_broken_rule_is_one_usage_line(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        parse(_Options, "eyas x", argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"eyas x: error: {line}"


def test_options_that_keep_the_rules_are_the_dataclass():
    opts = parse(_Options, "eyas x", ["--source", "s", "--target", "t", "--k", "3"])
    assert opts == _Options(source="s", target="t", k=3)
