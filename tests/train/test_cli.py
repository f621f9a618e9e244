"""The umbrella `eyas` command: every subcommand exists and explains itself."""

import subprocess
import sys

import pytest

from eyas.train.cli import COMMANDS, main


def test_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2
    assert "usage: eyas" in capsys.readouterr().err
    assert main(["help"]) == 0 and "usage: eyas" in capsys.readouterr().out


def test_unknown_subcommand_fails(capsys):
    assert main(["train-me"]) == 2
    assert "unknown command" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_subcommand_help(name, capsys):
    try:
        code = main([name, "--help"])
    except SystemExit as e:  # argparse exits after printing help
        code = e.code
    assert code == 0
    assert capsys.readouterr().out.startswith(f"usage: eyas {name} ")


def test_subcommand_help_starts_with_its_usage():
    # no log line before the help (the CPU thread rule runs only for a real command)
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", "inspect", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: eyas inspect")
    assert "thread" not in r.stderr, r.stderr


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "evaluate" in r.stdout


def test_cli_reference_is_the_options_help():
    from pathlib import Path

    from eyas.train.cli import reference
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    assert text[text.index("\n## `eyas ") + 1:] == reference(), (
        "docs/cli.md differs from the options' help: python -m eyas.train.cli --markdown "
        "docs/cli.md")
