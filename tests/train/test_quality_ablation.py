"""benchmarks/quality_ablation.py end to end on the shrunk embedded default: two variants share
one dataset (the second reads the cache the first built), both are decoded for real and walked
offline on the same held-out prompts, and the table and ablation.json carry each run's own
figures."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("quality_ablation",
                                               ROOT / "benchmarks" / "quality_ablation.py")
quality_ablation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quality_ablation)


@pytest.mark.slow
def test_two_variants_share_the_dataset_and_report_their_own_figures(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    env.pop("TRITON_INTERPRET", None)
    common = (f"data.cache_dir={tmp_path}/cache data.num_prompts=8 data.max_new_tokens=16 "
              "data.token_budget=256 drafter.draft_vocab_size=2048 drafter.ttt_steps=3 "
              "train.max_steps=2 eval.num_prompts=2 eval.max_new_tokens=8 eval.engines=false "
              "eval.heldout_offline=true eval.heldout_max_new_tokens=12")
    out = tmp_path / "abl"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality_ablation.py"),
                        "--out", str(out), "--common", common, "--stagger", "0",
                        "--launcher", f"{sys.executable} train/main.py",
                        "base=", "norm=drafter.norm_before_fc=true"],
                       check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:] + \
        "".join(p.read_text()[-3000:] for p in out.glob("*.log"))
    record = json.loads((out / "ablation.json").read_text())
    rows = {row["name"]: row for row in record["rows"]}
    assert list(rows) == ["base", "norm"]
    for name, row in rows.items():
        summary = json.loads((out / "runs" / name / "summary.json").read_text())
        assert row["exit"] == 0 and row["steps"] == 2 == summary["steps"]
        assert row["real_tau"] == summary["speculative"]["tau"]
        assert row["identical"] is True
        # the held-out answers run to 12 tokens: the walk within their first 8 is the one real
        # decoding (8 tokens) compares with, the walk over all 12 is reported beside it
        off = summary["heldout_offline"]
        assert (row["heldout_walk"], row["heldout_walk_long"], row["heldout_long_tokens"]) == \
            (off["tau_trajectory_capped"], off["tau_trajectory"], 12)
        assert row["eval_walk"] == summary["tau_trajectory"]
        assert row["eval_walk_capped"] == summary["eval"]["tau_trajectory_capped"]
        logged = [json.loads(x) for x in
                  (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        train_tau = [x["train/tau"] for x in logged if x.get("train/tau") is not None]
        assert row["train_tau_common"] == {"step": 2, "tau": train_tau[-1]}
    assert rows["base"]["real_tau_ratio"] == 1.0
    assert rows["norm"]["real_tau_ratio"] == pytest.approx(
        rows["norm"]["real_tau"] / rows["base"]["real_tau"], abs=1e-4)
    # the variant's export carries the norm; the second run read the first one's dataset
    cfg = json.loads((out / "runs" / "norm" / "export" / "config.json").read_text())
    assert cfg.get("norm_before_fc") is True
    assert "embedded dataset: cached at" in (out / "norm.log").read_text()
    assert len(list((tmp_path / "cache" / "datasets").glob("*/hidden/manifest.json"))) == 1
    # one run answered the held-out prompts; the other read (or waited for) its cache
    built = [n for n in rows
             if "held-out offline check: answering" in (out / f"{n}.log").read_text()]
    assert len(built) == 1
    assert len(list((tmp_path / "cache" / "heldout").glob("*/hidden/manifest.json"))) == 1
    norm = rows["norm"]
    assert (f"| norm | 0 | 2 | {norm['train_tau_common']['tau']:.3f} | {norm['eval_walk']:.3f} | "
            f"{norm['eval_walk_capped']:.3f} | {norm['heldout_walk']:.3f} | "
            f"{norm['heldout_walk_long']:.3f} (≤ 12) | {norm['real_tau']:.3f} ± ") in r.stdout
    assert "train τ @2" in r.stdout


def test_runs_cut_short_are_compared_at_the_last_step_all_logged():
    rows = [{"name": "a", "real_tau": 2.0, "heldout_walk": 2.2,
             "train_tau": {100: 1.3, 200: 1.7, 300: 1.9}},
            {"name": "b", "real_tau": None, "heldout_walk": None,
             "train_tau": {100: 1.2, 200: 1.8}}]
    rows.append({"name": "c", "real_tau": None, "heldout_walk": None, "train_tau": {}})
    out = quality_ablation.with_ratios(rows)   # c, which logged nothing, is left out of it
    assert [r["train_tau_common"] for r in out] == [{"step": 200, "tau": 1.7},
                                                    {"step": 200, "tau": 1.8}, None]
    assert out[0]["real_tau_ratio"] == 1.0 and out[1]["real_tau_ratio"] is None
    assert out[1]["train_tau"] == [(100, 1.2), (200, 1.8)]


def test_the_ratio_to_the_first_row_gets_its_standard_error_paired_over_prompts():
    from eyas.models.expected_tau import paired_ratio_se
    ref = [["p0", 10, 8], ["p1", 30, 12], ["p2", 5, 9]]
    other = [["p0", 12, 8], ["p1", 27, 12], ["p2", 6, 8]]
    common = {"exit": 0, "steps": 10, "eval_walk": None, "heldout_walk": None,
              "real_tau_se": 0.1, "identical": True}
    rows = [dict(common, name="a", real_tau=2.0, per_prompt=ref),
            dict(common, name="b", real_tau=2.1, per_prompt=other),
            dict(common, name="c", real_tau=2.2,                  # other prompts: no pairing
                 per_prompt=[["q0", 12, 8], ["p1", 27, 12], ["p2", 6, 8]])]
    out = quality_ablation.with_ratios(rows)
    assert out[0]["real_tau_ratio_se"] == 0.0
    assert out[1]["real_tau_ratio_se"] == round(paired_ratio_se(
        [(10, 8), (30, 12), (5, 9)], [(12, 8), (27, 12), (6, 8)]), 4) > 0
    assert out[2]["real_tau_ratio_se"] is None
    assert "| 1.0500 ± " in quality_ablation.table(out)


def test_a_line_cut_off_in_metrics_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 100, "train/tau": 1.5}\n{"step": 100, "eval/tau": 2.0}\n'
                    '{"step": 200, "train/tau": 1.9}\n{"step": 300, "train/t')
    assert quality_ablation.train_curve(path) == {100: 1.5, 200: 1.9}


@pytest.mark.parametrize("spec", ["base", "=x=1", "a b=x=1"])
def test_a_malformed_variant_is_refused_naming_it(spec):
    with pytest.raises(SystemExit) as e:
        quality_ablation.parse_variant(spec)
    assert repr(spec) in str(e.value) and "NAME=OVERRIDES" in str(e.value)


def test_the_eval_walk_is_the_exported_checkpoints():
    resumed = {"steps": 1176, "tau_trajectory": None,     # a re-run that evaluated nothing
               "checkpoint_selection": {"exported": "best",
                                        "best": {"step": 1176, "tau_trajectory": 2.7996},
                                        "last": {"step": 1176, "tau_trajectory": None}}}
    assert quality_ablation.row("norm", [], resumed, 0)["eval_walk"] == 2.7996
    earlier = {"steps": 1044, "tau_trajectory": 2.7097,  # best was step 1000, not the last
               "checkpoint_selection": {"exported": "best",
                                        "best": {"step": 1000, "tau_trajectory": 2.7134},
                                        "last": {"step": 1044, "tau_trajectory": 2.7097}}}
    assert quality_ablation.row("lists", [], earlier, 0)["eval_walk"] == 2.7134
    last = dict(earlier, checkpoint_selection=dict(earlier["checkpoint_selection"],
                                                   exported="last"))
    assert quality_ablation.row("lists", [], last, 0)["eval_walk"] == 2.7097
    unrecorded = {"steps": 10, "tau_trajectory": 2.81}   # no selection record: the last eval
    assert quality_ablation.row("norm", [], unrecorded, 0)["eval_walk"] == 2.81
    capped = dict(earlier, eval={"tau_trajectory_capped": 2.5})   # the capped walk: the same
    capped["checkpoint_selection"]["best"]["tau_trajectory_capped"] = 2.6   # rule
    assert quality_ablation.row("lists", [], capped, 0)["eval_walk_capped"] == 2.6
    del capped["checkpoint_selection"]
    assert quality_ablation.row("lists", [], capped, 0)["eval_walk_capped"] == 2.5
    assert quality_ablation.row("norm", [], None, None)["eval_walk"] is None


def test_stop_waits_for_the_whole_process_group(tmp_path):
    """The launcher dies at once on SIGTERM; its child takes a while to save: stop_all returns
    only after the child's save has finished (no SIGKILL cut it short) and no process of the
    group is left."""
    import signal
    import time
    saved = tmp_path / "saved"
    child = ("import signal, sys, time\n"
             "def save(*_):\n"
             "    time.sleep(1.5)\n"
             f"    open({str(saved)!r}, 'w').write('done')\n"
             "    sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, save)\n"
             f"open({str(tmp_path / 'ready')!r}, 'w').close()\n"
             "time.sleep(60)\n")
    launcher = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "$0" & wait', child],
                                start_new_session=True)
    while not (tmp_path / "ready").exists():
        time.sleep(0.05)
    pgid = launcher.pid                      # its own session: the group is the launcher's pid
    assert quality_ablation.stop_all({"job": launcher}, grace=30) == {"job": -signal.SIGTERM}
    assert saved.read_text() == "done"
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)                   # the whole group is gone, the child included
