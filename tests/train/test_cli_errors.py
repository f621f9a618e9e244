"""Every `eyas` subcommand: a wrong path is one line and exit 2 (never a traceback), findings
are 1, `--version` is the installed version, and every option's help shows its default."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.data.common.log import HelpFormatter
from eyas.data.common.options import parser
from eyas.train.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
NO = "/no/such/path"

# subcommand argv with a path that does not exist ("{tmp}": a fresh output location)
WRONG_PATH = {
    "prepare": ["prepare", "--input", NO, "--target", "tiny-llama", "--out", "{tmp}/o"],
    "synthesize": ["synthesize", "--target", NO, "--n", "1", "--out", "{tmp}/o.jsonl"],
    "extract": ["extract", "--tokens", NO, "--target", "tiny-llama", "--out", "{tmp}/o"],
    "import": ["import", "specforge", NO, "--out", "{tmp}/o", "--target", "tiny-llama"],
    "export-data": ["export-data", NO, "{tmp}/o"],
    "vocab": ["vocab", "--data", NO, "--out", "{tmp}/v.safetensors"],
    "inspect": ["inspect", NO],
    "verify": ["verify", NO, "--target", "tiny-llama"],
    "export": ["export", NO, "{tmp}/o"],
    "validate": ["validate", NO, "--target-config", "tiny-llama"],
    "validate target": ["validate", "{export}", "--target-config", NO],
    "doctor": ["doctor", NO, "--target-config", "tiny-llama"],
    "doctor data": ["doctor", "{export}", "--target-config", "tiny-llama", "--data", NO],
    "engines check": ["engines", "check", NO, "--target-config", "tiny-llama", "--no-setup"],
    "evaluate": ["evaluate", "--drafter", NO, "--data", NO, "--k", "3", "--out", "{tmp}/e.json"],
}


@pytest.fixture(scope="module")
def clean_export(tmp_path_factory):
    import torch

    from eyas.data.common.targets import load_target_config
    from eyas.models.config import Eagle3Config
    from eyas.models.drafter import Eagle3Drafter
    from eyas.models.serving.export import export_drafter
    tcfg = load_target_config("tiny-llama")
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=256, ttt_steps=2)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, attention="eager")
    ids = torch.randperm(cfg.vocab_size)[:256].sort().values
    drafter.set_vocab_map(ids - torch.arange(256))
    return export_drafter(drafter.state_dict(), cfg, None, None,
                          tmp_path_factory.mktemp("x") / "clean", target_config=tcfg)


@pytest.mark.parametrize("case", sorted(WRONG_PATH))
def test_wrong_path_is_one_line_and_exit_2(case, tmp_path, clean_export, capsys):
    argv = [a.format(tmp=tmp_path, export=clean_export) for a in WRONG_PATH[case]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    mine = [line for line in err.splitlines() if line.startswith("eyas ")]
    assert len(mine) == 1 and NO in mine[0], err
    assert mine[0].startswith(f"eyas {argv[0]}"), err


def test_wrong_path_through_the_console_script_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", "inspect", NO],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"eyas inspect: {NO}")


def test_validate_and_doctor_findings_are_1_usage_errors_2(clean_export, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file
    broken = tmp_path / "broken"
    shutil.copytree(clean_export, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["lm_head.weight"]  # the planted problem: LM_HEAD_MISSING
    save_file(tensors, broken / "model.safetensors")
    for cmd in ("validate", "doctor"):
        assert main([cmd, str(clean_export), "--target-config", "tiny-llama"]) == 0
        assert main([cmd, str(broken), "--target-config", "tiny-llama"]) == 1
        assert main([cmd, str(tmp_path / "typo"), "--target-config", "tiny-llama"]) == 2
        assert main([cmd, str(broken / "config.json"), "--target-config", "tiny-llama"]) == 2
    capsys.readouterr()


def test_version_is_the_pyproject_version(capsys):
    want = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"eyas {want}"
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", "--version"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"eyas {want}"


def options() -> dict[str, type]:
    """Every command's options class, by its words ("inspect", "engines check")."""
    out = {}
    for name, (load, _) in COMMANDS.items():
        target = load()
        nested = target.items() if isinstance(target, dict) else [("", target)]
        out.update({f"{name} {sub}".rstrip(): entry[0] for sub, entry in nested})
    return out


def _all_parsers():
    return {words: parser(cls, f"eyas {words}") for words, cls in options().items()}


def test_every_option_has_help_that_shows_its_default():
    missing = []
    for name, p in _all_parsers().items():
        assert p.formatter_class is HelpFormatter, name
        fmt = HelpFormatter(p.prog)
        # one of a required group is given: no default to show (evaluate --prompts/--data); a
        # hidden option (a renamed spelling, refused with its new one) shows no help at all
        chosen = {id(a) for g in p._mutually_exclusive_groups if g.required
                  for a in g._group_actions}
        for action in p._actions:
            if (not action.option_strings or isinstance(action, argparse._HelpAction)
                    or id(action) in chosen or action.help == argparse.SUPPRESS):
                continue
            flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            shown = (fmt._get_help_string(action) if action.help else "").lower()
            # a None default ("not given") shows nothing by itself: its help says what it means
            if not action.help or not (flag or action.required or "default" in shown
                                       or (action.default is None and "(none" in shown)):
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing
