"""What a user of other trainers expects: `eyas evaluate --data` scores the held-out split of
training by default, and `eyas vocab` builds the draft vocabulary the trainer builds."""

import json
from types import SimpleNamespace

import pytest
import torch

from eyas.data.store.dataset import open_dataset
from eyas.data.store.packing import split_indices
from eyas.data.common.targets import load_target_config
from eyas.data.produce.vocab import load_vocab
from eyas.models.serving.export import export_drafter
from eyas.train.config import DataConfig, TargetConfig
from eyas.train.evaluate.cli import scored_samples
from eyas.train.trainer import build_vocab_map
from functools import partial
from eyas.train.cli import call

vocab_main = partial(call, "vocab")
evaluate_main = partial(call, "evaluate")


pytestmark = pytest.mark.usefixtures("one_thread")


def _args(data, **kw):
    return SimpleNamespace(**{"data": str(data), "all": False, "eval_fraction": None,
                              "seed": None, **kw})


def test_scored_samples_default_to_the_training_split(tmp_path):
    data = tmp_path / "ds"
    data.mkdir()
    rec = {"dataset": str(data), "eval_dataset": None, "eval_fraction": 0.25, "seed": 7}
    idx, how = scored_samples(_args(data), 40, rec)
    assert list(idx) == list(split_indices(40, 0.25, 7)[1]) and "as in training" in how
    idx, how = scored_samples(_args(data), 40, {})           # nothing recorded: schema defaults
    assert list(idx) == list(split_indices(40, DataConfig.eval_fraction, 0)[1])
    assert "defaults" in how
    assert scored_samples(_args(data, all=True), 40, rec)[0] is None
    assert scored_samples(_args(data, eval_fraction=0.0), 40, rec)[0] is None
    other = tmp_path / "other"
    other.mkdir()
    idx, how = scored_samples(_args(other), 40, rec)
    assert idx is None and "not the drafter's training set" in how
    idx, how = scored_samples(_args(data, seed=3), 40, rec)   # --seed wins over the record
    assert list(idx) == list(split_indices(40, 0.25, 3)[1])
    assert "train.seed=3, seed given with --seed" in how


def test_evaluate_seed_reaches_the_split_however_the_cli_is_called(monkeypatch):
    from eyas.data.common.options import parse
    from eyas.train.evaluate.cli import EvaluateOptions
    need = ["--drafter", "x", "--k", "2", "--out", "o.json", "--data", "d"]
    # the drafter's record decides
    assert parse(EvaluateOptions, "eyas evaluate", need).seed is None
    monkeypatch.setattr("sys.argv", ["evaluate_cli", *need, "--seed", "5"])
    assert parse(EvaluateOptions, "eyas evaluate").seed == 5   # argv read by argparse, not by us


def test_evaluate_cli_scores_the_held_out_split_and_says_so(tiny_drafter, tiny_llama_dataset,
                                                             tmp_path, capsys):
    drafter = tiny_drafter(load_target_config("tiny-llama"), seed=3)
    rec = {"dataset": str(tiny_llama_dataset), "eval_dataset": None, "eval_fraction": 0.25,
           "seed": 0}
    out = export_drafter(drafter.state_dict(), drafter.config, drafter.d2t, drafter.t2d,
                         tmp_path / "export", target_config=load_target_config("tiny-llama"),
                         training={"data": rec})
    f = tmp_path / "offline.json"
    base = ["--drafter", str(out), "--data", str(tiny_llama_dataset), "--k", "2", "--out", str(f),
            "--token-budget", "256"]
    assert evaluate_main(base) == 0
    assert json.loads(f.read_text())["num_samples"] == 6
    assert "scoring 6 of 24 samples" in capsys.readouterr().out
    assert evaluate_main(base + ["--all"]) == 0
    assert json.loads(f.read_text())["num_samples"] == 24
    assert "scoring 24 of 24 samples" in capsys.readouterr().out
    # a split that holds no sample is an error, not a table of n/a
    from eyas.data.store.shards import write_manifest, write_shard
    src = open_dataset(tiny_llama_dataset)
    one = tmp_path / "one"
    write_manifest(one, dict(src.manifest), [write_shard(one, 0, [src[0]])])
    with pytest.raises(ValueError, match=r"--data .*one: the held-out split eval_fraction=0.5, "
                                         r"seed=0 holds none of its 1 samples; .* --all"):
        evaluate_main(base[:3] + [str(one)] + base[4:] + ["--eval-fraction", "0.5"])


class _Rank0:
    is_main_process = True

    def wait_for_everyone(self):
        pass


def test_vocab_cli_builds_the_trainers_vocab(tiny_llama_dataset, tmp_path, capsys):
    ds = open_dataset(tiny_llama_dataset)
    V = int(ds.manifest["target_config"]["vocab_size"])
    (tmp_path / "t").mkdir()
    d2t, t2d = build_vocab_map(DataConfig(), TargetConfig(name="tiny-llama"), 1024, ds, V,
                               _Rank0(), tmp_path / "t")
    f = tmp_path / "vocab.safetensors"
    assert vocab_main(["--data", str(tiny_llama_dataset), "--size", "1024", "--out", str(f)]) == 0
    forced = capsys.readouterr().out
    assert "forcing" in forced and "forcing 0 " not in forced and "forcing no" not in forced
    d2t_cli, t2d_cli = load_vocab(f)
    assert torch.equal(d2t, d2t_cli) and torch.equal(t2d, t2d_cli)
    assert vocab_main(["--data", str(tiny_llama_dataset), "--size", "1024", "--out", str(f),
                       "--no-special"]) == 0
    assert "forcing no special tokens (--no-special)" in capsys.readouterr().out
