"""The DeepSpeed JSON a run hands to DeepSpeed (HF Trainer's convention: as given, "auto" filled),
what `accelerate launch`'s DeepSpeed flags may and may not say, and a sweep over engines."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eyas.train.config import ConfigError, DistBackend, DistConfig, check
from eyas.train.dist import deepspeed_config, launcher_conflict

ROOT = Path(__file__).resolve().parents[2]


def _zero(stage, file=None):
    return DistConfig(backend=DistBackend.deepspeed, zero_stage=stage, deepspeed_config=file)


def test_shipped_json_gets_its_auto_fields_from_the_config():
    ds = deepspeed_config(_zero(2), grad_accum=4, clip=0.5, bf16=True)
    assert ds["gradient_clipping"] == 0.5 and ds["gradient_accumulation_steps"] == 4
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size,overlap", [(1, False), (2, True), (16, True)])
def test_shipped_overlap_comm_follows_the_process_count(stage, world_size, overlap):
    ds = deepspeed_config(_zero(stage), grad_accum=1, clip=1.0, bf16=True, world_size=world_size)
    assert ds["zero_optimization"]["overlap_comm"] is overlap


def test_user_overlap_comm_is_kept_and_absent_stays_absent(tmp_path):
    f = tmp_path / "my.json"
    f.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}}))
    ds = deepspeed_config(_zero(2, str(f)), grad_accum=1, clip=1.0, bf16=False, world_size=1)
    assert ds["zero_optimization"]["overlap_comm"] is True        # given: DeepSpeed gets it
    f.write_text(json.dumps({"zero_optimization": {"stage": "auto"}}))
    ds = deepspeed_config(_zero(2, str(f)), grad_accum=1, clip=1.0, bf16=False, world_size=1)
    assert "overlap_comm" not in ds["zero_optimization"]          # DeepSpeed's own default


def test_user_json_is_taken_as_given_apart_from_auto(tmp_path):
    user = {"zero_optimization": {"stage": "auto", "reduce_bucket_size": 1000},
            "gradient_clipping": 2.0, "bf16": {"enabled": "auto"},
            "gradient_accumulation_steps": "auto", "steps_per_print": 7}
    f = tmp_path / "my.json"
    f.write_text(json.dumps(user))
    ds = deepspeed_config(_zero(1, str(f)), grad_accum=2, clip=0.5, bf16=False)
    assert ds["gradient_clipping"] == 2.0                 # given: kept, not optim.clip_grad_norm
    assert ds["steps_per_print"] == 7 and ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["zero_optimization"]["stage"] == 1 and ds["bf16"] == {"enabled": False}
    assert ds["gradient_accumulation_steps"] == 2 and ds["train_micro_batch_size_per_gpu"] == 1


@pytest.mark.parametrize("field,value,names", [
    ({"zero_optimization": {"stage": 3}}, 2, "dist.zero_stage"),
    ({"gradient_accumulation_steps": 8}, 2, "optim.grad_accum"),
    ({"bf16": {"enabled": True}}, 2, "train.param_dtype"),
])
def test_user_json_contradicting_the_run_is_refused(tmp_path, field, value, names):
    f = tmp_path / "my.json"
    f.write_text(json.dumps(field))
    with pytest.raises(ConfigError) as e:
        deepspeed_config(_zero(value, str(f)), grad_accum=1, clip=0.5, bf16=False)
    assert names in str(e.value) and "auto" in str(e.value) and "\n" not in str(e.value)


def test_bf16_needs_deepspeeds_own_nonfinite_check(tmp_path):
    f = tmp_path / "my.json"
    f.write_text(json.dumps({"bf16": {"enabled": "auto"}}))
    ds = deepspeed_config(_zero(2, str(f)), grad_accum=1, clip=0.5, bf16=True)
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True}     # absent: set
    assert "check_grad_overflow" not in deepspeed_config(_zero(2, str(f)), grad_accum=1,
                                                         clip=0.5, bf16=False)["bf16"]
    f.write_text(json.dumps({"bf16": {"enabled": "auto", "check_grad_overflow": False}}))
    with pytest.raises(ConfigError) as e:
        deepspeed_config(_zero(2, str(f)), grad_accum=1, clip=0.5, bf16=True)
    assert str(f) in str(e.value) and "bf16.check_grad_overflow=False" in str(e.value)
    assert "Fix: set it to true" in str(e.value) and "\n" not in str(e.value)


def test_user_json_under_ddp_is_refused_at_check():
    cfg = OmegaConf.structured(__import__("eyas.train.config", fromlist=["x"]).EyasConfig(
        output_dir="x"))
    cfg.dist.deepspeed_config = "my.json"
    with pytest.raises(ConfigError, match="dist.deepspeed_config.*dist=zero2"):
        check(cfg)


def test_launcher_deepspeed_flags_must_agree_with_the_dist_group():
    launched = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    msg = launcher_conflict(DistConfig(), launched)
    assert "--use_deepspeed" in msg and "dist=ddp" in msg and "dist=zero2" in msg
    msg = launcher_conflict(_zero(1), launched)
    assert "--zero_stage 2" in msg and "dist=zero1" in msg and "add dist=zero2" in msg
    assert launcher_conflict(_zero(2), launched) is None
    assert launcher_conflict(_zero(2), {}) is None and launcher_conflict(DistConfig(), {}) is None
    assert launcher_conflict(DistConfig(), {"ACCELERATE_USE_DEEPSPEED": "false"}) is None


def _main(args, cwd, **env):
    import os
    return subprocess.run([sys.executable, str(ROOT / "train" / "main.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", **env))


def test_multirun_sweeps_the_engine(tmp_path):
    """dist=zero1,ddp,zero2 in one process: each job gets a fresh accelerate state."""
    r = _main(["--multirun", "train.dry_run=true", "dist=zero1,ddp,zero2",
               f"hydra.sweep.dir={tmp_path}/s"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads((tmp_path / "s" / str(i) / "ranks" / "rank0.json").read_text())
            for i in range(3)]
    assert [x["distributed_type"] for x in recs] == ["DEEPSPEED", "NO", "DEEPSPEED"]


@pytest.mark.slow
def test_multirun_trains_under_each_engine(tmp_path, tiny_llama_dataset):
    """dist=zero1,ddp in one process, each job a real (one-step) training: the engine each job
    built is the one its dist group names, and both trained."""
    r = _main(["--multirun", "dist=zero1,ddp", "target=tiny_llama",
               f"data.dataset={tiny_llama_dataset}", "train.max_steps=1", "train.log_every=1", "drafter.attention=eager",
               "drafter.ttt_steps=2", "drafter.draft_vocab_size=1024", "data.token_budget=256",
               "data.num_workers=1", "data.eval_fraction=0.1", "eval.speculative=false",
               "eval.engines=false", "export.enabled=false", f"hydra.sweep.dir={tmp_path}/s"],
              tmp_path, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    assert r.returncode == 0, r.stderr[-4000:]
    jobs = [tmp_path / "s" / str(i) for i in range(2)]
    recs = [json.loads((j / "ranks" / "rank0.json").read_text()) for j in jobs]
    assert [x["distributed_type"] for x in recs] == ["DEEPSPEED", "NO"]
    summaries = [json.loads((j / "summary.json").read_text()) for j in jobs]
    assert [x["steps"] for x in summaries] == [1, 1]
    assert [x["distributed_type"] for x in summaries] == ["DEEPSPEED", "NO"]


def test_a_launch_asking_for_deepspeed_under_dist_ddp_exits_2(tmp_path):
    r = _main(["train.dry_run=true", f"hydra.run.dir={tmp_path}/r"], tmp_path,
              ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2")
    assert r.returncode == 2 and "add dist=zero2" in r.stderr, r.stderr[-2000:]
