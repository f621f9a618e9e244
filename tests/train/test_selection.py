"""The export holds the checkpoint with the best eval decoder-walk τ, and every run draws its
pictures: a real tiny training whose τ peaks and then falls under a learning-rate spike."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.models.serving.export import normalise_names
from eyas.models.serving.importer import read_trainer_checkpoint
from eyas.train.plots import read_records, run_figures
from tests.train.test_trainer import _env, run

# the LR ramps up linearly, 1e-3 more each step (a warmup that outlasts the run): the first steps
# learn, the later ones unlearn, so the decoder-walk τ peaks part-way and then falls
SPIKE = ["target=tiny_llama", "train.max_steps=8", "train.eval_every=1", "train.keep_last=1",
         "optim.schedule=constant", "optim.warmup_steps=49", "optim.lr=0.05",
         "optim.clip_grad_norm=0"]
LAST = 8


@pytest.fixture(scope="module")
def spiked(tmp_path_factory, tiny_llama_dataset):
    """(run dir, summary, stdout) of a run whose decoder-walk τ falls after its peak."""
    d = tmp_path_factory.mktemp("spike") / "r"
    r = run(d, tiny_llama_dataset, *SPIKE)
    return d, json.loads((d / "summary.json").read_text()), r.stdout


def _evals(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval/tau_trajectory"] for r in read_records(run_dir / "metrics.jsonl")
            if r.get("eval/tau_trajectory") is not None}


def _drafter_tensors(state: dict) -> dict:
    return {k: v for k, v in normalise_names(state).items() if k != "embed_tokens.weight"}


def _same(exported: dict, ckpt: dict, name: str) -> bool:
    """The exported tensor is the checkpoint's, in the export's dtype (the training weights may
    be fp32; the export stores the serving dtype)."""
    return torch.equal(exported[name], ckpt[name].to(exported[name].dtype))


@pytest.mark.slow
def test_the_export_is_the_peak_checkpoint_not_the_last(spiked):
    d, summary, stdout = spiked
    walk = _evals(d)
    peak = max(walk, key=walk.get)
    assert peak < LAST and walk[LAST] < walk[peak], walk        # the run was built to fall after a peak
    sel = summary["checkpoint_selection"]
    assert sel["exported"] == "best" and sel["step"] == peak
    assert sel["best"]["tau_trajectory"] == pytest.approx(walk[peak])
    capped = {r["step"]: r["eval/tau_trajectory_capped"]
              for r in read_records(d / "metrics.jsonl") if "eval/tau_trajectory_capped" in r}
    assert sel["best"]["tau_trajectory_capped"] == pytest.approx(capped[peak])
    assert sel["last"] == {"step": LAST, "tau_trajectory": pytest.approx(walk[LAST]),
                           "tau": pytest.approx(summary["tau"]),
                           "tau_trajectory_capped": pytest.approx(capped[LAST])}
    ck = d / "checkpoints"
    # the peak survived rotation (train.keep_last=1 keeps only the final step besides it)
    assert sorted(p.name for p in ck.glob("step-*")) == [f"step-{peak:06d}", f"step-{LAST:06d}"]
    assert (ck / "best").read_text() == f"step-{peak:06d}"
    exported = load_file(str(d / "export" / "model.safetensors"))
    best = _drafter_tensors(read_trainer_checkpoint(ck / f"step-{peak:06d}").state_dict)
    last = _drafter_tensors(read_trainer_checkpoint(ck / f"step-{LAST:06d}").state_dict)
    shared = sorted(set(exported) & set(best))
    assert "fc.weight" in shared and "lm_head.weight" in shared
    for name in shared:
        assert _same(exported, best, name), name
    assert not _same(exported, last, "fc.weight")
    meta = json.loads((d / "export" / "eyas_export.json").read_text())
    assert meta["training"]["checkpoint_selection"]["step"] == peak
    line = f"exported step {peak} (best, export.select=best); best step {peak} tau "
    assert line in stdout and f"last step {LAST} tau {walk[LAST]:.3f}" in stdout


@pytest.mark.slow
def test_select_last_exports_the_final_weights(tmp_path, tiny_llama_dataset):
    d = tmp_path / "r"
    run(d, tiny_llama_dataset, "target=tiny_llama", "train.max_steps=3", "train.eval_every=1",
        "export.select=last", "train.keep_last=1")
    sel = json.loads((d / "summary.json").read_text())["checkpoint_selection"]
    assert sel["exported"] == "last" and sel["step"] == 3 and sel["checkpoint"] is None
    exported = load_file(str(d / "export" / "model.safetensors"))
    last = _drafter_tensors(read_trainer_checkpoint(d / "checkpoints" / "step-000003").state_dict)
    shared = set(exported) & set(last)
    assert "fc.weight" in shared and all(_same(exported, last, n) for n in shared)


def test_without_held_out_data_best_falls_back_to_the_last_step(tmp_path, tiny_llama_dataset):
    d = tmp_path / "r"
    r = run(d, tiny_llama_dataset, "target=tiny_llama", "train.max_steps=2",
            "data.eval_fraction=0")
    sel = json.loads((d / "summary.json").read_text())["checkpoint_selection"]
    assert sel["exported"] == "last" and sel["step"] == 2 and sel["best"] is None
    assert "no held-out samples" in sel["reason"]
    assert "export.select=best: no held-out samples to evaluate on" in r.stderr
    assert not (d / "checkpoints" / "best").exists()


@pytest.mark.slow
def test_the_run_draws_its_pictures(spiked):
    d, summary, _ = spiked
    assert sorted(p.name for p in (d / "plots").iterdir()) == ["acceptance.png", "loss.png",
                                                             "tau.png", "tau_by_context.png"]
    for p in (d / "plots").iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    peak = summary["checkpoint_selection"]["step"]
    figs = run_figures(read_records(d / "metrics.jsonl"), selected_step=peak)
    assert set(figs) == {"loss", "tau", "acceptance", "tau_by_context"}   # eval's by_context

    def labels(ax):
        return [line.get_label() for line in ax.get_lines()]

    (loss,), (tau,) = figs["loss"].axes, figs["tau"].axes
    assert labels(loss) == ["train loss (per log window)", "eval loss (held-out)",
                            f"selected checkpoint (step {peak})"]
    assert [len(line.get_xdata()) for line in loss.get_lines()[:2]] == [LAST, LAST]
    assert labels(tau)[:3] == ["tau, every chain start",
                               "tau_trajectory, decoder walk (ranks checkpoints)",
                               "tau_trajectory_capped, the walk within each answer's first "
                               "eval.max_new_tokens tokens"]
    assert list(tau.get_lines()[3].get_xdata()) == [peak]              # the star on the peak
    over, at = figs["acceptance"].axes
    assert labels(over)[:3] == ["position 0", "position 1", "position 2"]   # K = 3
    assert labels(at) == [f"selected checkpoint (step {peak})", f"last eval (step {LAST})"]
    assert all(ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
               for fig in figs.values() for ax in fig.axes)


@pytest.mark.slow
def test_eyas_evaluate_plot_draws_what_the_result_holds(spiked, tiny_llama_dataset, tmp_path):
    d, _, _ = spiked
    out, png = tmp_path / "res.json", tmp_path / "res.png"
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", "evaluate", "--drafter",
                        str(d / "export"), "--data", str(tiny_llama_dataset), "--all",
                        "--k", "3", "--out", str(out), "--plot", str(png)],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in r.stdout
    from eyas.train.plots import evaluation_figure
    res = json.loads(out.read_text())
    fig = evaluation_figure(res)
    want = 1 + bool(res.get("by_context")) + bool(res.get("by_temperature"))
    assert len(fig.axes) == want
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == pytest.approx(
        [res[f"cond_acc_{k}"] for k in range(3)])


@pytest.mark.slow
def test_a_resumed_run_keeps_its_best(tmp_path, tiny_llama_dataset):
    d = tmp_path / "r"
    first = [o for o in SPIKE if not o.startswith("train.max_steps")]
    run(d, tiny_llama_dataset, *first, "train.max_steps=5")
    before = json.loads((d / "checkpoints" / "best.json").read_text())
    run(d, tiny_llama_dataset, *SPIKE, "train.resume=latest")
    walk = _evals(d)
    peak = max(walk, key=walk.get)
    assert peak < 5 and walk[LAST] < walk[peak], walk
    assert before["step"] == peak
    sel = json.loads((d / "summary.json").read_text())["checkpoint_selection"]
    assert sel["exported"] == "best" and sel["step"] == peak
    exported = load_file(str(d / "export" / "model.safetensors"))
    best = _drafter_tensors(read_trainer_checkpoint(d / "checkpoints" / f"step-{peak:06d}")
                            .state_dict)
    assert all(_same(exported, best, n) for n in set(exported) & set(best))


def test_a_best_json_naming_a_missing_checkpoint_is_the_reason_given(tmp_path, caplog):
    from eyas.train.selection import select_checkpoint
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "best.json").write_text('{"checkpoint": "step-000004", "tau_trajectory": 1.5}')
    with caplog.at_level("WARNING"):
        sel = select_checkpoint(root, "best", 8, {}, has_eval=True)
    assert (sel["exported"], sel["step"]) == ("last", 8)
    assert sel["reason"] == ("export.select=best fell back to the final step: best.json names "
                             "step-000004, which is not a complete checkpoint")
    assert "not a complete checkpoint" in caplog.text
    (root / "best.json").unlink()
    assert select_checkpoint(root, "best", 8, {}, has_eval=True)["reason"].endswith(
        "no eval gave a finite decoder-walk tau")
