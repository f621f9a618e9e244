"""End-to-end training runs on CPU: real processes, real datasets, real checkpoints."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "train" / "main.py")
ACCELERATE = str(Path(sys.executable).parent / "accelerate")

SMALL = ["drafter.attention=eager", "drafter.ttt_steps=3", "drafter.draft_vocab_size=1024",
         "data.token_budget=256", "data.num_workers=1", "optim.lr=1e-3", "optim.warmup_steps=0",
         "optim.schedule=constant", "train.log_every=1", "data.eval_fraction=0.1",
         "eval.speculative=false", "eval.engines=false"]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return env


def _cmd(nproc: int, port: int):
    if nproc == 1:
        return [sys.executable, MAIN]
    return [ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(nproc), "--num_machines",
            "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(port), MAIN]


def run(run_dir: Path, dataset: Path, *overrides, nproc=1, port=None, timeout=600,
        check=True):
    args = [*_cmd(nproc, port or free_port()), *SMALL, f"data.dataset={dataset}", f"hydra.run.dir={run_dir}",
            *overrides]
    r = subprocess.run(args, cwd=run_dir.parent, env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    return r


def losses(run_dir: Path) -> list[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in recs if "train/loss" in r]


def ranks(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank*.json"))]


def _decreases(ls: list[float]) -> bool:
    k = max(1, len(ls) // 4)
    return sum(ls[-k:]) / k < 0.9 * sum(ls[:k]) / k


@pytest.mark.slow
def test_single_process_trains_exports_and_prints(tmp_path, smollm2_dataset):
    r = run(tmp_path / "r", smollm2_dataset, "train.max_steps=16")
    ls = losses(tmp_path / "r")
    assert len(ls) == 16 and _decreases(ls), ls
    lines = r.stdout.strip().splitlines()
    assert lines[-2:] == [f"export: {tmp_path / 'r' / 'export'}", lines[-1]]
    assert lines[-1].startswith("eval split: decoder walk tau ")
    assert float(lines[-1].split()[5].rstrip(",")) >= 1.0
    cfg = json.loads((tmp_path / "r" / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 1024 and cfg["vocab_size"] == 49152


@pytest.mark.slow
def test_two_process_ddp_world_size_and_learning(tmp_path, smollm2_dataset):
    run(tmp_path / "r", smollm2_dataset, "train.max_steps=12", nproc=2)
    rs = ranks(tmp_path / "r")
    assert [x["world_size"] for x in rs] == [2, 2]
    assert {x["distributed_type"] for x in rs} == {"MULTI_CPU"}
    assert _decreases(losses(tmp_path / "r"))


@pytest.mark.slow
def test_two_process_deepspeed_zero2(tmp_path, smollm2_dataset):
    r = run(tmp_path / "r", smollm2_dataset, "dist=zero2", "train.max_steps=12", nproc=2,
            timeout=900)
    assert "overlap_comm=True (2 process(es))" in r.stderr     # the shipped "auto", 2 ranks
    rs = ranks(tmp_path / "r")
    assert [x["world_size"] for x in rs] == [2, 2]
    assert {x["distributed_type"] for x in rs} == {"DEEPSPEED"}
    assert _decreases(losses(tmp_path / "r"))
    # DeepSpeed wrote its own sharded checkpoint format
    assert list((tmp_path / "r" / "checkpoints").glob("step-*/pytorch_model/*optim_states.pt"))


def assert_resumed(r: subprocess.CompletedProcess, run_dir: Path, step: int) -> None:
    """The run `r` really resumed from checkpoint `step` of `run_dir`: the line
    train/checkpoint.py logs once the state is loaded, on stderr and in the run's train.log
    (a run that starts fresh logs "no checkpoint ... starting fresh" instead)."""
    line = f"resumed from {run_dir / 'checkpoints' / f'step-{step:06d}'} (step {step})"
    assert r.stderr.count(line) == 1, r.stderr[-4000:]
    assert (run_dir / "train.log").read_text().count(line) == 1


def _export_tensors(run_dir: Path) -> dict:
    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.mark.slow
def test_kill9_then_resume_matches_uninterrupted_run_bitwise(tmp_path, tiny_llama_dataset):
    common = ["target=tiny_llama", "train.max_steps=10", "train.deterministic=true",
              "train.eval_every=0"]
    run(tmp_path / "a", tiny_llama_dataset, *common)
    # run b: checkpoint every step, SIGKILL the process once step 4 is published
    b = tmp_path / "b"
    b.mkdir()
    args = [sys.executable, MAIN, *SMALL, f"data.dataset={tiny_llama_dataset}",
            f"hydra.run.dir={b}", *common, "train.save_every=1", "train.keep_last=2"]
    p = subprocess.Popen(args, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    latest = b / "checkpoints" / "latest"
    deadline = time.time() + 400
    while time.time() < deadline:
        if latest.is_file() and latest.read_text().strip() >= "step-000004":
            break
        if p.poll() is not None:
            pytest.fail("run b ended before it could be killed")
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    killed_at = latest.read_text().strip()
    assert killed_at < "step-000010"
    assert not (b / "export").exists()
    r = run(b, tiny_llama_dataset, *common, "train.save_every=1", "train.resume=latest")
    assert_resumed(r, b, int(killed_at.removeprefix("step-")))
    ta, tb = _export_tensors(tmp_path / "a"), _export_tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), f"{name} differs after resume from {killed_at}"


@pytest.mark.slow
def test_resume_refuses_a_different_objective(tmp_path, tiny_llama_dataset):
    common = ["target=tiny_llama", "train.max_steps=2"]
    run(tmp_path / "r", tiny_llama_dataset, *common)
    r = run(tmp_path / "r", tiny_llama_dataset, "target=tiny_llama", "train.max_steps=4",
            "loss.step_weight=0.5", "train.resume=latest", check=False)
    assert r.returncode != 0
    assert "loss.step_weight" in r.stderr and "refusing to resume" in r.stderr


@pytest.mark.slow
def test_wandb_offline_run_directory(tmp_path, tiny_llama_dataset):
    run(tmp_path / "r", tiny_llama_dataset, "target=tiny_llama", "train.max_steps=3",
        "tracker=wandb", "tracker.mode=offline")
    runs = list((tmp_path / "r" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # an offline run keeps config and history as protobuf records in run-<id>.wandb
    record = next(runs[0].glob("run-*.wandb")).read_bytes()
    for key in (b"ttt_steps", b"token_budget", b"train/loss", b"train/loss_0", b"train/loss_2",
                b"train/acc_0", b"train/cond_acc_0",
                b"train/tau", b"train/lr", b"train/grad_norm", b"train/tokens_per_s",
                b"train/data_wait", b"eval/tau", b"eval/tau_trajectory"):
        assert key in record, key
    assert b"drafter-" in record                  # the export, logged as a wandb artifact


def test_tensorboard_receives_the_metrics(tmp_path, tiny_llama_dataset):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run(tmp_path / "r", tiny_llama_dataset, "target=tiny_llama", "train.max_steps=3",
        "tracker=tensorboard", "export.enabled=false", "eval.context_buckets=[0,44,50]")
    events = list((tmp_path / "r").rglob("events.out.tfevents.*"))
    assert events, "no tensorboard event file"
    tags = set()
    for e in events:
        acc = EventAccumulator(str(e.parent))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    for key in ("train/loss", "train/tau", "eval/tau", "eval/tau_ctx_0-44", "eval/tau_ctx_44-50",
                "eval/tau_ctx_50+"):
        assert key in tags, (key, sorted(tags))
    assert not any("by_context" in t for t in tags)       # the table stays in metrics.jsonl
    evals = [r for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text()
                            .splitlines()) if "eval/tau" in r]
    by = evals[-1]["eval/by_context"]
    assert [(b["bucket"], b["lo"], b["hi"]) for b in by] == [("0-44", 0, 44), ("44-50", 44, 50),
                                                             ("50+", 50, None)]
    assert [evals[-1][f"eval/tau_ctx_{b['bucket']}"] for b in by] == [b["tau"] for b in by]
    starts = sum(b["rounds"] for b in by)               # the buckets split every chain start
    assert sum(b["tau"] * b["rounds"] for b in by if b["rounds"]) == \
        pytest.approx(evals[-1]["eval/tau"] * starts)


@pytest.mark.slow
def test_overwrite_removes_the_old_tensorboard_events(tmp_path, tiny_llama_dataset):
    pytest.importorskip("tensorboard")
    r_dir = tmp_path / "r"
    common = ["target=tiny_llama", "train.max_steps=1", "tracker=tensorboard",
              "export.enabled=false"]
    run(r_dir, tiny_llama_dataset, *common)
    old = set(r_dir.rglob("events.out.tfevents.*"))
    assert old and all(p.is_relative_to(r_dir / "eyas") for p in old)
    r = run(r_dir, tiny_llama_dataset, *common, "train.overwrite=true")
    line = next(x for x in r.stderr.splitlines() if "removed the previous run" in x)
    assert "eyas/" in line and "not written by eyas" not in line, line
    new = set(r_dir.rglob("events.out.tfevents.*"))
    assert new and not new & old
    assert len(_scalars(r_dir)["train/loss"]) == 1  # the new run's step only


@pytest.mark.slow
def test_multirun_trains_one_job_per_value(tmp_path, tiny_llama_dataset):
    args = [sys.executable, MAIN, "--multirun", *SMALL, f"data.dataset={tiny_llama_dataset}",
            "target=tiny_llama", "train.max_steps=2", "optim.lr=1e-3,2e-3", "export.enabled=false",
            f"hydra.sweep.dir={tmp_path}/sweep"]
    r = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    jobs = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(jobs) == 2


@pytest.mark.parametrize("log_every,dtype,warnings,total", [
    (1, "fp32", 3, 3),      # torch AdamW: the skip decided on the host
    (2, "bf16", 2, 4),      # MasterAdamW: the skip decided on the device
])
def test_nonfinite_losses_are_skipped_then_abort(tmp_path, nan_dataset, log_every, dtype,
                                                 warnings, total):
    # every step is NaN; the count is read (and the limit checked) every train.log_every steps
    r = run(tmp_path / "r", nan_dataset, "target=tiny_llama", "train.max_steps=6",
            "train.max_nonfinite_steps=2", f"train.log_every={log_every}",
            f"train.param_dtype={dtype}", "data.verify=false", check=False)
    assert r.returncode != 0
    assert "NaN/inf" in r.stderr and "train.max_nonfinite_steps=2" in r.stderr
    assert f"{total} steps had a NaN/inf loss or gradient" in r.stderr
    assert r.stderr.count("optimizer step(s) skipped") == warnings
    assert not list((tmp_path / "r").glob("checkpoints/step-*"))


@pytest.mark.slow
def test_deepspeed_zero2_in_bf16_trains_as_ddp_with_the_engines_own_nonfinite_check(
        tmp_path, tiny_llama_dataset):
    common = ["target=tiny_llama", "train.max_steps=12", "train.param_dtype=bf16",
              "optim.grad_accum=2", "export.enabled=false"]
    run(tmp_path / "ddp", tiny_llama_dataset, *common, "dist=ddp")
    run(tmp_path / "z2", tiny_llama_dataset, *common, "dist=zero2", timeout=600)
    recs = [json.loads(x) for x in (tmp_path / "z2" / "metrics.jsonl").read_text().splitlines()]
    norms = [x["train/grad_norm"] for x in recs if "train/grad_norm" in x]
    assert len(norms) == 12 and all(math.isfinite(n) and n > 0 for n in norms)
    # the same AdamW on fp32 masters, clipped alike: the same losses to bf16 rounding
    assert losses(tmp_path / "z2") == pytest.approx(losses(tmp_path / "ddp"), rel=1e-3)
    assert json.loads((tmp_path / "z2" / "summary.json").read_text())["nonfinite_steps"] == 0


def test_deepspeed_zero2_skips_nonfinite_steps_itself_and_the_trainer_counts_them(
        tmp_path, nan_dataset):
    # DeepSpeed's own NaN/inf check (bf16.check_grad_overflow) skips each whole step; the
    # trainer counts its verdict at once (no micro-batch skipped alone) and stops past the limit
    r = run(tmp_path / "r", nan_dataset, "target=tiny_llama", "dist=zero2", "train.max_steps=6",
            "train.max_nonfinite_steps=2", "train.log_every=2", "train.param_dtype=bf16",
            "optim.grad_accum=2", "data.verify=false", check=False, timeout=600)
    assert r.returncode != 0
    assert "3 steps had a NaN/inf loss or gradient" in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("DeepSpeed skipped the update") == 3
    assert "micro-batch skipped" not in r.stderr
    assert not list((tmp_path / "r").glob("checkpoints/step-*"))


@pytest.mark.slow
def test_warm_start_keeps_the_drafters_vocab_map(tmp_path, tiny_llama_dataset):
    run(tmp_path / "a", tiny_llama_dataset, "target=tiny_llama", "train.max_steps=8")
    first = losses(tmp_path / "a")
    export = tmp_path / "a" / "export"
    # a different draft vocab size would rebuild the map; the warm start must keep the export's
    run(tmp_path / "b", tiny_llama_dataset, "target=tiny_llama", "train.max_steps=2",
        f"drafter.warm_start={export}", "drafter.draft_vocab_size=512")
    a = load_file(str(export / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "export" / "model.safetensors"))
    assert torch.equal(a["d2t"], b["d2t"]) and torch.equal(a["t2d"], b["t2d"])
    assert not (tmp_path / "b" / "vocab.safetensors").exists()
    # it starts from the trained weights, not from scratch
    assert losses(tmp_path / "b")[0] < first[0]


def _files(run_dir: Path) -> dict:
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def _strict_json(path: Path):
    def refuse(name):
        raise ValueError(f"{path} is not strict JSON: {name}")
    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.slow
def test_a_used_run_dir_is_refused_resumed_or_overwritten(tmp_path, tiny_llama_dataset):
    r_dir, ck = tmp_path / "r", tmp_path / "r" / "checkpoints"
    common = ["target=tiny_llama", "train.save_every=1", "train.keep_last=5"]
    run(r_dir, tiny_llama_dataset, *common, "train.max_steps=4", "export.every=2",
        "train.eval_every=2")
    before = _files(r_dir)
    # the same directory again: refused, nothing of the first run touched
    r = run(r_dir, tiny_llama_dataset, *common, "train.max_steps=2", check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    line = next(x for x in r.stderr.splitlines() if f"the run directory {r_dir}" in x)
    for word in ("step-000004", "metrics.jsonl", "export/", "summary.json",
                 "train.resume=latest", "train.overwrite=true"):
        assert word in line, (word, line)
    assert _files(r_dir) == before
    # resuming it continues the run
    r = run(r_dir, tiny_llama_dataset, *common, "train.max_steps=6", "train.resume=latest")
    assert "(step 4)" in r.stderr and len(losses(r_dir)) == 6
    assert _strict_json(r_dir / "summary.json")["steps"] == 6
    # overwriting it leaves nothing of the old run
    r = run(r_dir, tiny_llama_dataset, *common, "train.max_steps=1", "train.overwrite=true")
    assert "removed the previous run" in r.stderr
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-000001"]
    assert (ck / "latest").read_text() == (ck / "best").read_text() == "step-000001"
    assert _strict_json(ck / "best.json")["checkpoint"] == "step-000001"
    assert len(losses(r_dir)) == 1 and not list(r_dir.glob("export-step*"))
    summary = _strict_json(r_dir / "summary.json")
    assert summary["steps"] == 1 and summary["export"] == str(r_dir / "export")


def _scalars(run_dir: Path) -> dict:
    """{tag: [values]} of every tensorboard event file under the run dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    found: dict = {}
    for d in sorted({e.parent for e in run_dir.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(d))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, []).extend(s.value for s in acc.Scalars(tag))
    return found


def test_the_real_decoding_tau_reaches_the_tracker(tmp_path, tiny_llama_dataset):
    pytest.importorskip("tensorboard")
    r_dir = tmp_path / "r"
    run(r_dir, tiny_llama_dataset, "target=tiny_llama", "train.max_steps=1",
        "tracker=tensorboard", "eval.speculative=true", "eval.num_prompts=1",
        "eval.max_new_tokens=4")
    tau = _strict_json(r_dir / "summary.json")["speculative"]["tau"]
    assert _scalars(r_dir)["speculative/tau"] == [pytest.approx(tau)]


@pytest.mark.parametrize("option", ["drafter.fp8=tensorwise",
                                    "drafter.fp8=tensorwise drafter.fp8_split_qkv=true",
                                    "drafter.host_embedding=true data.device_prefetch=true",
                                    "optim.moments=bf16 train.param_dtype=bf16 "
                                    "drafter.checkpoint_mlp=true",
                                    "optim=muon optim.weight_decay=0.01"])
@pytest.mark.slow
def test_resume_is_exact_with_each_memory_and_speed_option(tmp_path, tiny_llama_dataset, option):
    if "fp8" in option:
        pytest.importorskip("torchao.float8")
    # export.select=last: the resumed run also evaluated its step-3 end, which the best
    # checkpoint could otherwise pick
    common = ["target=tiny_llama", "train.deterministic=true", "train.eval_every=0",
              "export.select=last", *option.split()]
    run(tmp_path / "a", tiny_llama_dataset, *common, "train.max_steps=6")
    b = tmp_path / "b"
    run(b, tiny_llama_dataset, *common, "train.max_steps=3", "train.save_every=1",
        "export.enabled=false")
    r = run(b, tiny_llama_dataset, *common, "train.max_steps=6", "train.save_every=1",
            "train.resume=latest")
    assert_resumed(r, b, 3)
    ta, tb = _export_tensors(tmp_path / "a"), _export_tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 5
    for name in ta:
        assert torch.equal(ta[name], tb[name]), f"{name} differs after resume ({option})"
    if "moments" in option:     # the log says so, and the checkpoints really hold bf16 moments
        assert "optimizer: MasterAdamW (torch twin update, fp32 masters, bf16 moments)" in \
            (tmp_path / "a" / "train.log").read_text()
        state = torch.load(next((b / "checkpoints").rglob("optimizer.bin")), weights_only=False)
        assert {t["exp_avg"].dtype for t in state["inner"]["state"].values()} == {torch.bfloat16}
    if "muon" in option:   # Muon took the hidden matrices; the other optimizer is refused
        assert "optimizer: torch Muon on 8 hidden matrices" in \
            (tmp_path / "a" / "train.log").read_text()
        r = run(b, tiny_llama_dataset, "target=tiny_llama", "train.max_steps=7",
                "train.resume=latest", check=False)
        assert r.returncode != 0 and "optim.name: checkpoint 'muon', now 'adamw'" in r.stderr
    if "fp8" in option:   # the FP8 run really ran float8 linears (fc kept bf16), and
        log = (tmp_path / "a" / "train.log").read_text()   # exported plain weights
        assert "FP8 training (tensorwise): midlayer.self_attn.q_proj," in log
        assert "midlayer.mlp.down_proj\n" in log and "(tensorwise): fc" not in log
        from eyas.models.serving.validate import validate
        assert validate(tmp_path / "a" / "export", "tiny-llama") == []


@pytest.mark.slow
def test_profile_steps_write_a_trace_of_exactly_those_steps(tmp_path, tiny_llama_dataset):
    out = tmp_path / "p"
    r = run(out, tiny_llama_dataset, "target=tiny_llama", "train.max_steps=4",
            "train.profile_start=1", "train.profile_steps=2", "export.enabled=false")
    trace = out / "profile" / "trace-rank0.json"
    assert f"profiled steps 1-2 into {trace}" in r.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events if e.get("name") == "train.step" and e.get("ph") == "X"
             and e.get("cat") == "user_annotation"]
    assert len(steps) == 2
    assert any(e.get("name", "").startswith("aten::mm") for e in events)   # the ops inside
    assert "Name" in (out / "profile" / "kernels-rank0.txt").read_text()
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["kernels-rank0.txt",
                                                                   "trace-rank0.json"]
    # the breakdown reads the trainer's trace (no GPU kernels on the CPU: the steps' wall time)
    b = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_breakdown.py"),
                        str(trace)], capture_output=True, text=True, cwd=ROOT)
    assert b.returncode == 0, b.stderr
    assert b.stdout.startswith("2 steps of ")
    late = run(tmp_path / "late", tiny_llama_dataset, "target=tiny_llama", "train.max_steps=2",
               "train.profile_steps=2", "export.enabled=false")      # the default start: 10
    assert "no step from train.profile_start=10 ran" in late.stderr
    assert not (tmp_path / "late" / "profile").exists()
    bad = run(tmp_path / "bad", tiny_llama_dataset, "target=tiny_llama",
              "train.profile_start=0", check=False)
    assert bad.returncode != 0 and "train.profile_start=0" in bad.stderr


def _lrs(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/lr"] for r in recs if "train/lr" in r}


@pytest.mark.slow
def test_logged_rates_resume_settings_and_a_resume_at_the_last_step(tmp_path,
                                                                    tiny_llama_dataset):
    r_dir = tmp_path / "r"
    common = ["target=tiny_llama", "optim.schedule=linear", "train.save_every=2",
              "train.keep_last=5", "train.max_steps=4"]
    run(r_dir, tiny_llama_dataset, *common)
    # each step logs the rate it trained at: lr · (1 - (step - 1) / 4)
    assert _lrs(r_dir) == pytest.approx({1: 1e-3, 2: 7.5e-4, 3: 5e-4, 4: 2.5e-4})
    tau = _strict_json(r_dir / "summary.json")["tau"]
    # a run that dies after its final checkpoint resumes with nothing left to train: its
    # eval is computed again, not lost
    shutil.rmtree(r_dir / "export")
    (r_dir / "summary.json").unlink()
    run(r_dir, tiny_llama_dataset, *common, "train.resume=latest")
    summary = _strict_json(r_dir / "summary.json")
    assert summary["steps"] == 4 and summary["tau"] == pytest.approx(tau)
    # resuming at step 2 with a new optim.lr trains at it; the later checkpoint is retired
    r = run(r_dir, tiny_llama_dataset, *common, "optim.lr=1e-4",
            f"train.resume={r_dir / 'checkpoints' / 'step-000002'}")
    assert "resumed with a changed setting: optim.lr: 0.001 in the checkpoint, 0.0001 now" \
        in r.stderr
    assert "removing the later checkpoints of the continuation it replaces: step-000004" \
        in r.stderr
    assert _lrs(r_dir)[3] == pytest.approx(5e-5) and _lrs(r_dir)[4] == pytest.approx(2.5e-5)
    # the replaced continuation's records are gone: each step is logged once, by this run
    recs = [json.loads(x) for x in (r_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs if "train/lr" in x] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_check_that_fails_after_training_keeps_the_runs_summary(tmp_path, tiny_llama_dataset):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    r_dir = tmp_path / "r"
    r = run(r_dir, tiny_llama_dataset, "target=tiny_llama", "train.max_steps=2",
            "eval.speculative=true", f"eval.prompts={empty}", check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "no prompt records" in r.stderr
    summary = _strict_json(r_dir / "summary.json")         # the training's record survives
    assert summary["steps"] == 2 and summary["export"] == str(r_dir / "export")
    assert "speculative" not in summary
    # a path that does not exist is refused before anything runs
    r = run(tmp_path / "r2", tiny_llama_dataset, "target=tiny_llama", "eval.speculative=true",
            f"eval.prompts={tmp_path / 'nope.jsonl'}", check=False)
    assert r.returncode == 2 and "eval.prompts=" in r.stderr and "Fix: eval.prompts=null" in r.stderr
    assert not (tmp_path / "r2" / "checkpoints").exists()
