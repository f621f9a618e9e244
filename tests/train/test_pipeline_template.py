"""Training refuses, before it starts, a dataset (data.dataset or data.eval_dataset) rendered with
another chat template than the one target.name serves: exit status 2 and one line naming both
hashes and the fix."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.data.produce.extract import extract
from eyas.data.produce.prepare import prepare
from eyas.data.common.targets import load_target, load_tokenizer, resolve_target
from eyas.data.common.templates import load_template, template_sha256
from eyas.train.config import ConfigError
from eyas.data.produce.recipe import DatasetPaths
from eyas.train.pipeline import ensure_dataset
from tests.train.test_pipeline import _cfg, _typed
from tests.data.produce.test_extract_template import CONVS, OWN, drifted_target, expected, own_template

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hidden(tmp_path_factory):
    """{template: hidden-state dataset of CONVS rendered with it}: tiny-llama's own, and
    llama-3.1's (extracted from a copy of tiny-llama that serves llama-3.1)."""
    root = tmp_path_factory.mktemp("hidden")
    (root / "conv.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVS))
    llama = root / "tiny-llama-3.1-template"
    shutil.copytree(resolve_target("tiny-llama"), llama)
    (llama / "chat_template.jinja").write_text(load_template("llama-3.1"))
    model, tok = load_target("tiny-llama")[0], load_tokenizer("tiny-llama")
    out = {}
    for name, target in (("own", "tiny-llama"), ("llama-3.1", llama)):
        prepare(root / "conv.jsonl", target, root / f"tokens-{name}", tokenizer=tok,
                chat_template=None if name == "own" else name)
        extract(root / f"tokens-{name}", target, root / f"hid-{name}", model=model)
        out[name] = root / f"hid-{name}"
    return out


def typed(*overrides):
    return _typed(_cfg(*overrides))


def test_training_start_refuses_the_target_with_another_template(tmp_path, hidden):
    target, sha = drifted_target(tmp_path)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "train/main.py", "target=tiny_llama",
                        f"data.dataset={hidden['own']}", f"target.name={target}",
                        f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    line = "E eyas: bad configuration: " + expected(
        f"data.dataset={hidden['own']}", OWN, template_sha256(own_template()), target, sha,
        after=" and extract again")
    assert [x for x in r.stderr.splitlines() if "bad configuration" in x][0].endswith(line)
    assert not list(run.rglob("checkpoint*")) and not (run / "summary.json").exists()


def test_eval_dataset_with_another_template_is_refused(hidden):
    cfg = typed(f"data.dataset={hidden['own']}", f"data.eval_dataset={hidden['llama-3.1']}")
    with pytest.raises(ConfigError) as e:
        ensure_dataset(cfg.data, cfg.target, seed=0, target_dtype="float32")
    assert str(e.value) == expected(
        f"data.eval_dataset={hidden['llama-3.1']}", "chat template 'llama-3.1'",
        template_sha256(load_template("llama-3.1")), "tiny-llama",
        template_sha256(own_template()), resolve_target("tiny-llama"), after=" and extract again")


def test_same_template_passes(hidden):
    cfg = typed(f"data.dataset={hidden['own']}")
    assert ensure_dataset(cfg.data, cfg.target, seed=0, target_dtype="float32") == DatasetPaths(
        train=hidden["own"], eval=None)
