"""The entry point's side of Hydra (train/hydra_cli.py): run_name is a name, a bad override
gets its fix, --help lists the groups a run can pick."""

import shlex
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf

from eyas.train.config import ConfigError, check
from eyas.train.hydra_cli import explain
from eyas.train.limits import RUN_NAME_RULE, run_name_error
from tests.train.test_config import _compose
from tests.train.test_dist_conventions import _main

ROOT = Path(__file__).resolve().parents[2]


def _lines(text):
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["20261206-072633", "smollm2-quality", "r1", "a.b_c+d=e@f",
                                  "_x", "运行1", "a" * 128])
def test_run_names_that_are_names_are_accepted(name):
    assert run_name_error(name) is None


@pytest.mark.parametrize("name", ["", ".", "..", "../../x", "a b/c", "a/b", "/abs", ".hidden",
                                  "-x", "a b", "a\nb", "a" * 129, "x\\y"])
def test_run_names_that_are_paths_are_refused(name):
    assert run_name_error(name) == RUN_NAME_RULE
    cfg = _compose([])
    cfg.run_name = name
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value).startswith(f"run_name={name!r}: expected {RUN_NAME_RULE}. Fix: ")


@pytest.mark.parametrize("name", ["../../x", "a b/c"])
def test_bad_run_name_is_refused_before_any_directory_is_made(tmp_path, name):
    work = tmp_path / "a" / "work"
    work.mkdir(parents=True)
    for mode in ([], ["--multirun", "optim.lr=1e-4,3e-4"]):
        r = _main([*mode, f"run_name={name}", "train.dry_run=true"], cwd=work)
        assert r.returncode == 2, r.stderr[-3000:]
        assert _lines(r.stderr)[-1].endswith(
            f"bad configuration: run_name={name!r}: expected {RUN_NAME_RULE}. Fix: "
            f"run_name=my-run (or EYAS_RUN_ID=my-run); to write the run elsewhere, "
            f"hydra.run.dir=DIR")
        assert "Traceback" not in r.stderr and "UserWarning" not in r.stderr
        made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
        assert made == ["a", "a/work"], made


def test_a_run_id_that_is_a_path_is_refused(tmp_path):
    r = _main(["train.dry_run=true"], cwd=tmp_path, EYAS_RUN_ID="../escaped")
    assert r.returncode == 2 and "run_name='../escaped': expected a name" in r.stderr
    assert sorted(tmp_path.parent.glob("escaped")) == [] and not (tmp_path / "runs").exists()


def test_a_good_run_name_names_the_directory(tmp_path):
    r = _main(["train.dry_run=true", "run_name=llama8b.v2_lr3e-4"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["llama8b.v2_lr3e-4"]


def _explained(override):
    with pytest.raises(HydraException) as e:
        _compose([override])
    return explain(e.value)


@pytest.mark.parametrize("override,line", [
    ("optim.lrr=1e-3", "Could not override 'optim.lrr': Key 'lrr' not in 'OptimConfig'. "
                       "Did you mean optim.lr? Fix: optim.lr=1e-3"),
    ("optmi.lr=1e-3", "Could not override 'optmi.lr': Key 'optmi' not in 'EyasConfig'. "
                      "Did you mean optim.lr? Fix: optim.lr=1e-3"),
    ("train.max_step=5", "Could not override 'train.max_step': Key 'max_step' not in "
                         "'TrainConfig'. Did you mean train.max_steps? Fix: train.max_steps=5"),
    ("optimm=adamw", "Could not override 'optimm': Key 'optimm' not in 'EyasConfig'. Did you "
                     "mean optim? Fix: optim=adamw"),
])
def test_a_misspelt_key_gets_the_nearest_valid_one(override, line):
    assert _explained(override) == line
    fixed = line.rsplit("Fix: ", 1)[1]
    _compose([fixed])                                         # the fix composes


def test_a_key_with_no_near_one_gets_the_sections_keys():
    text = _explained("optim.zzzzz=3")
    assert text.startswith("Could not override 'optim.zzzzz': Key 'zzzzz' not in "
                           "'OptimConfig'. The keys of optim: lr, betas, eps, weight_decay, ")
    assert text.endswith(". Fix: one of them (each is documented in train/config.py)")


@pytest.mark.parametrize("override,value", [("data.prompts=/x/y(1).jsonl", "/x/y(1).jsonl"),
                                            ("tracker.run_name=lr=3e-4", "lr=3e-4")])
def test_an_unquoted_value_the_grammar_cannot_read_gets_the_quoting_rule(override, value):
    text = _explained(override)
    assert "\n" not in text and f"in the override {override!r}. " in text
    assert "Fix: quote the value, e.g. " in text
    example = text.split("e.g. ", 1)[1].split(" (the outer", 1)[0]
    (arg,) = shlex.split(example)                             # as the shell passes it
    key = override.split("=", 1)[0]
    assert arg == f'{key}="{value}"'
    assert OmegaConf.select(_compose([arg]), key) == value


def test_the_entry_point_prints_the_hint_in_one_line_with_status_2(tmp_path):
    r = _main(["optim.lrr=1e-3", "train.dry_run=true"], cwd=tmp_path)
    assert r.returncode == 2
    assert _lines(r.stderr) == ["Could not override 'optim.lrr': Key 'lrr' not in "
                                "'OptimConfig'. Did you mean optim.lr? Fix: optim.lr=1e-3"]
    r = _main(["data.prompts=/x/y(1).jsonl"], cwd=tmp_path)
    assert r.returncode == 2 and len(_lines(r.stderr)) == 1
    assert """e.g. 'data.prompts="/x/y(1).jsonl"'""" in r.stderr
    assert not (tmp_path / "runs").exists()


def test_launch_sh_check_prints_the_same_hint(capsys):
    from eyas.train.main import precheck
    assert precheck(["optmi.lr=1e-3"]) == 2
    assert _lines(capsys.readouterr().err) == [
        "Could not override 'optmi.lr': Key 'optmi' not in 'EyasConfig'. Did you mean optim.lr? "
        "Fix: optim.lr=1e-3"]


def test_hydra_full_error_keeps_hydras_stack_trace(tmp_path):
    r = _main(["optim.lrr=1e-3"], cwd=tmp_path, HYDRA_FULL_ERROR="1")
    assert r.returncode == 1 and "Traceback" in r.stderr
    assert "hydra.errors.ConfigCompositionException: Could not override 'optim.lrr'" in r.stderr


def test_help_lists_the_groups_a_run_can_pick_and_where_fields_are_documented(tmp_path):
    r = _main(["--help"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.splitlines()
    start = out.index("== Configuration groups (group=option) ==") + 1
    groups = out[start:out.index("", start)]
    assert groups == [
        "data: default, fp8",
        "dist: ddp, zero1, zero2, zero3",
        "drafter: default",
        "experiment: gpu_default, smollm2_quality  (+experiment=NAME: a whole recipe)",
        "loss: lk_alpha, lk_lambda, mix, soft_ce, specforge, tv",
        "optim: adamw, muon",
        "target: deepseek_v3, kimi_k2_5, llama_3_1_8b, qwen3_8b, smollm2, tiny_deepseek_v3, "
        "tiny_llama",
        "tracker: none, tensorboard, wandb"]
    assert not any("accelerate" in g for g in groups)
    text = " ".join(r.stdout.split())
    assert "the doc line under it in train/config.py (the schema); the groups and presets: " \
           "docs/configuration.md." in text
    docs = (ROOT / "docs" / "configuration.md").read_text()
    assert all(f"| `{g.split(':')[0]}` |" in docs for g in groups)
