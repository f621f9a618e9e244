"""The Hydra tree: every preset composes, bad input names its override, sweeps run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ValidationError

from eyas.train.config import ConfigError, EyasConfig, check, register

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


def _compose(overrides=()):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["target", "drafter", "data", "loss", "optim", "dist", "tracker"])
def test_every_preset_composes_and_checks(group, preset_hub_cache, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)     # tracker=wandb is online
    options = _options(group)
    assert options, f"conf/{group}/ has no presets"
    for option in options:
        # the real-model targets' weights are reachable (cached) for a training-only job
        cfg = _compose([f"{group}={option}", "data.dataset=/data/hs", "eval.speculative=false"])
        assert OmegaConf.is_struct(cfg)
        check(cfg)


def test_defaults_are_the_schema_defaults():
    cfg = _compose()
    schema = OmegaConf.structured(EyasConfig)
    assert cfg.drafter.ttt_steps == schema.drafter.ttt_steps == 7
    assert cfg.target.name == "smollm2"
    assert cfg.dist.backend.value == "ddp" and list(cfg.tracker.kind) == list(schema.tracker.kind) == []


def test_dist_presets_select_zero_stage():
    for stage in (1, 2, 3):
        cfg = _compose([f"dist=zero{stage}"])
        assert cfg.dist.backend.value == "deepspeed" and cfg.dist.zero_stage == stage


def test_unknown_key_is_rejected_with_its_name():
    with pytest.raises(ConfigCompositionException,
                       match=r"Could not override 'optim\.learning_rate'") as e:
        _compose(["optim.learning_rate=1e-3"])
    assert isinstance(e.value.__cause__, ConfigAttributeError)
    assert "Key 'learning_rate' not in 'OptimConfig'" in str(e.value.__cause__)


def test_bad_enum_value_lists_valid_choices():
    with pytest.raises(ConfigCompositionException,
                       match=r"Error merging override loss\.impl=cuda") as e:
        _compose(["loss.impl=cuda"])
    assert isinstance(e.value.__cause__, ValidationError)
    assert "Invalid value 'cuda', expected one of [auto, triton, torch]" in str(e.value.__cause__)


def test_bad_type_is_rejected():
    with pytest.raises(ConfigCompositionException,
                       match=r"Error merging override drafter\.ttt_steps=seven") as e:
        _compose(["drafter.ttt_steps=seven"])
    assert isinstance(e.value.__cause__, ValidationError)
    assert "Value 'seven' of type 'str' could not be converted to Integer" in \
        str(e.value.__cause__)


@pytest.mark.parametrize("override,fix", [
    ("drafter.ttt_steps=0", "drafter.ttt_steps=7"),
    ("dist.zero_stage=2", "dist=zero2 "),
    ("target.aux_layer_ids=[5,3,9]", "target.aux_layer_ids="),
    ("optim.betas=[0.9]", "optim.betas="),
    ("data.eval_fraction=1.5", "data.eval_fraction="),
    ("eval.context_buckets=[0,8192,2048]", "eval.context_buckets=[0,2048"),
    ("eval.context_buckets=[100,2048]", "eval.context_buckets=[0,2048"),
    ("drafter.fp8_layers=[fc,lm_head]", "drafter.fp8_layers=[q_proj,k_proj,v_proj,o_proj,"),
    ("drafter.fp8_layers=[]", "drafter.fp8_layers=[q_proj,"),
    ("eval.heldout_max_new_tokens=16", "eval.heldout_max_new_tokens=192"),
])
def test_cross_field_errors_name_the_fix(override, fix):
    cfg = _compose([override])
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert fix in str(e.value) and override.split("=")[0] in str(e.value)


def test_bf16_moments_are_refused_where_no_master_weight_update_runs():
    from eyas.train.config import load
    from eyas.train.resolve import resolve
    for overrides, fix in ((["optim.moments=bf16", "dist=zero2"],
                            "optim.moments=fp32, or dist=ddp"),
                           (["optim.moments=bf16", "train.param_dtype=fp32"],
                            "or train.param_dtype=bf16")):
        with pytest.raises(ConfigError, match="optim.moments") as e:
            check(_compose(overrides))
        assert fix in str(e.value)
    cfg = load(_compose(["optim.moments=bf16", "output_dir=unused"]))
    assert resolve(cfg, "cuda").moments == "bf16"
    with pytest.raises(ConfigError, match="train.param_dtype=bf16, or optim.moments=fp32"):
        resolve(cfg, "cpu")                          # auto parameters are fp32 on a CPU


def test_every_field_is_documented():
    """Each schema field carries a docstring line right under it (train/config.py), and each
    data-side setting it extends a help text (`setting(default, help)`, data/common/settings.py:
    the subcommands' --help shows it)."""
    import ast
    from dataclasses import fields, is_dataclass

    from eyas.data.common import settings
    tree = ast.parse((ROOT / "train/config.py").read_text())
    missing = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and node.name not in (
                "EyasConfig", "ConfigError"):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                        missing.append(f"{node.name}.{stmt.target.id}")
    classes = [c for n, c in vars(settings).items() if n.endswith("Settings") and is_dataclass(c)]
    assert len(classes) >= 8
    missing += [f"{c.__name__}.{f.name}" for c in classes for f in fields(c)
                if not f.metadata.get("help")]
    assert not missing, f"fields without a doc line: {missing}"


def _run_main(args, cwd, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "train" / "main.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_override_exits_nonzero_with_message(tmp_path):
    r = _run_main(["train.dry_run=true", "dist.zero_stage=3", f"hydra.run.dir={tmp_path}/r"],
                  cwd=tmp_path)
    assert r.returncode == 2
    assert "dist=zero3" in r.stderr


def test_zero3_on_one_process_is_refused_with_the_fix(tmp_path):
    r = _run_main(["train.dry_run=true", "dist=zero3", f"hydra.run.dir={tmp_path}/r"],
                  cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "dist=zero3 with 1 process: expected 2 or more processes" in r.stderr
    assert "dist=zero2 or dist=ddp" in r.stderr


def test_dry_run_writes_rank_record(tmp_path):
    r = _run_main(["train.dry_run=true", f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "r" / "ranks" / "rank0.json").read_text())
    assert rec["world_size"] == 1 and rec["rank"] == 0


@pytest.mark.parametrize("preset", _options("target"))
def test_every_target_preset_builds_a_drafter_on_meta(preset, preset_hub_cache):
    import torch

    from eyas.models.config import Eagle3Config
    from eyas.models.drafter import Eagle3Drafter
    from eyas.data.common.targets import load_target_config, text_config

    cfg = _compose([f"target={preset}", "data.dataset=/data/hs", "eval.speculative=false"])
    check(cfg)
    tcfg = load_target_config(cfg.target.name)
    V = text_config(tcfg)["vocab_size"]
    config = Eagle3Config.from_target(tcfg, draft_vocab_size=min(cfg.drafter.draft_vocab_size, V),
                                      ttt_steps=cfg.drafter.ttt_steps)
    with torch.device("meta"):
        drafter = Eagle3Drafter(config, attention="eager", compile_flex=False)
    H, tH = config.hidden_size, config.target_hidden_size
    assert drafter.fc.weight.shape == (H, 3 * tH)
    assert drafter.midlayer.self_attn.q_proj.weight.shape[1] == 2 * H
    assert drafter.lm_head.weight.shape == (config.draft_vocab_size, H)
    assert drafter.embed_tokens.weight.shape == (V, H)
    assert not drafter.embed_tokens.weight.requires_grad
    assert config.to_config_dict()["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        i - 1 for i in config.aux_layer_ids]


def test_resolve_decides_every_auto_by_one_device_rule():
    import torch

    from eyas.kernels.loss import triton_available
    from eyas.train.config import load
    from eyas.train.resolve import resolve
    cfg = load(_compose(["output_dir=unused"]))
    cpu, cuda = resolve(cfg, "cpu"), resolve(cfg, torch.device("cuda"))
    assert (cpu.attention, cpu.compile, cpu.loss_impl, cpu.optim_impl, cpu.param_dtype,
            cpu.target_dtype, cpu.pin_memory) == ("eager", False, "torch", "torch",
                                                  torch.float32, torch.float32, False)
    assert (cuda.attention, cuda.compile, cuda.loss_impl, cuda.param_dtype, cuda.target_dtype,
            cuda.pin_memory) == ("flex", True, "triton", torch.bfloat16, torch.bfloat16, True)
    assert cuda.optim_impl == ("triton" if triton_available() else "torch")
    assert not cpu.compact_masters and cuda.compact_masters == (cuda.optim_impl == "triton")
    assert not resolve(load(_compose(["optim.compact_masters=false", "output_dir=unused"])),
                       "cuda").compact_masters
    explicit = load(_compose(["drafter.attention=eager", "loss.impl=torch", "drafter.compile=false",
                              "train.param_dtype=fp32", "target.dtype=float32", "output_dir=unused"]))
    pinned = resolve(explicit, "cuda")
    assert not pinned.compact_masters                        # fp32 parameters have no bf16 half
    assert (pinned.attention, pinned.compile, pinned.loss_impl, pinned.param_dtype,
            pinned.target_dtype) == ("eager", False, "torch", torch.float32, torch.float32)
    assert resolve(load(_compose(["target.dtype=bf16", "output_dir=unused"])), "cpu").target_dtype == torch.bfloat16
    # the embedding table leaves the GPU by default; on a CPU it stays in the drafter
    assert (cpu.host_embedding, cuda.host_embedding) == (False, True)
    for value, want in (("true", True), ("false", False)):
        forced = load(_compose([f"drafter.host_embedding={value}", "output_dir=unused"]))
        assert resolve(forced, "cpu").host_embedding is resolve(forced, "cuda").host_embedding is want


def test_tracker_checks_fail_before_any_data(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="tracker.mode='online'.*wandb login"):
        check(_compose(["tracker=wandb"]))
    check(_compose(["tracker=wandb", "tracker.mode=offline"]))
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    check(_compose(["tracker=wandb"]))
    with pytest.raises(ConfigError, match="tracker.kind.*names from"):
        check(_compose(["tracker.kind=[nope]"]))
    with pytest.raises(ConfigError, match="swanlab is not installed.*pip install swanlab"):
        check(_compose(["tracker.kind=[swanlab]"]))


@pytest.mark.parametrize("override,accepted", [
    ("train.log_every=0", ">= 1"),
    ("train.max_steps=0", ">= 1, or null"),
    ("train.max_steps=-3", ">= 1, or null"),
    ("train.save_every=-5", ">= 0 (0 = only at the end)"),
    ("train.eval_every=-1", ">= 0 (0 = only at the end)"),
    ("export.every=-2", ">= 0 (0 = only at the end)"),
    ("train.keep_last=0", ">= 1"),
    ("train.max_nonfinite_steps=-1", ">= 0"),
    ("optim.clip_grad_norm=-1.0", ">= 0 (0 = no clipping)"),
    ("optim.warmup_steps=-10", ">= 0, or null"),
    ("drafter.ttt_steps=1000", "in [1, 64]"),
    ("eval.num_prompts=0", ">= 1"),
    ("data.num_prompts=-1", ">= 1"),
    ("data.num_workers=-1", ">= 0"),
    ("train.cpu_threads=0", ">= 1, or null"),
])
def test_surprising_values_are_refused_naming_key_range_and_fix(override, accepted):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        check(_compose([override]))
    msg = str(e.value)
    assert msg.startswith(f"{key}={value}: expected ") and accepted in msg and "Fix: " in msg
    assert "\n" not in msg


def test_fp8_split_qkv_needs_fp8_projections_to_split():
    for bad in (["drafter.fp8_split_qkv=true"],
                ["drafter.fp8_split_qkv=true", "drafter.fp8=tensorwise",
                 "drafter.embedding_qkv_once=false"],
                ["drafter.fp8_split_qkv=true", "drafter.fp8=tensorwise",
                 "drafter.fp8_layers=[o_proj,down_proj]"]):
        with pytest.raises(ConfigError, match=r"^drafter.fp8_split_qkv=True: expected only with "
                                              r"drafter.fp8 on.*Fix: drafter.fp8_split_qkv=false"):
            check(_compose(bad))
    check(_compose(["drafter.fp8_split_qkv=true", "drafter.fp8=tensorwise"]))


@pytest.mark.parametrize("override", [
    "train.save_every=0", "train.eval_every=0", "export.every=0", "optim.clip_grad_norm=0",
    "optim.warmup_steps=0", "train.max_steps=1", "train.log_every=1", "drafter.ttt_steps=64",
    "train.max_nonfinite_steps=0", "train.max_steps=null", "data.num_workers=0",
    "train.cpu_threads=1"])
def test_boundary_values_with_a_meaning_are_accepted(override):
    check(_compose([override]))


def test_zero_warmup_steps_means_no_warmup():
    """optim.warmup_steps=0: the first step already runs at the peak LR."""
    import torch
    from types import SimpleNamespace

    from eyas.train.optim import build_scheduler
    p = torch.nn.Parameter(torch.ones(3))
    for warm, first in ((0, 1.0), (3, 0.25)):
        opt = torch.optim.SGD([p], lr=2.0)
        cfg = SimpleNamespace(warmup_steps=warm, warmup_ratio=0.0, schedule="constant")
        build_scheduler(opt, cfg, total_steps=10)
        assert opt.param_groups[0]["lr"] == 2.0 * first


def test_zero3_turns_off_what_it_cannot_run_and_refuses_it_when_asked(tmp_path):
    """dist=zero3 sets drafter.compile and drafter.embedding_qkv_once off; asking for either
    under ZeRO-3 is one line at the config check, not a silent switch."""
    r = _run_main(["train.dry_run=true", "dist=zero3", "drafter.compile=true",
                   f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert ("drafter.compile=True: expected false under ZeRO-3 (ZeRO-3 gathers its partitioned "
            "weights in module hooks, which compiled graphs bypass). Fix: drafter.compile=false "
            "(dist=zero3 sets it), or dist=zero2") in r.stderr
    r = _run_main(["train.dry_run=true", "dist=zero3", "drafter.embedding_qkv_once=true",
                   f"hydra.run.dir={tmp_path}/r2"], cwd=tmp_path)
    assert r.returncode == 2 and "drafter.embedding_qkv_once=True: expected false" in r.stderr
