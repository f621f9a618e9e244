"""Real-model target presets: named by hub id, overridable by a local path, refused at config
check in one line when the weights a stage reads are not reachable; the embedded default
never touches the network."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from eyas.data.common.targets import HUB_IDS, resolve_target
from eyas.train.config import ConfigError, check, register

ROOT = Path(__file__).resolve().parents[2]
REAL = ["llama_3_1_8b", "qwen3_8b", "deepseek_v3", "kimi_k2_5"]


def _compose(overrides):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("preset", REAL)
def test_preset_names_its_hub_id_and_aux_ids(preset):
    cfg = _compose([f"target={preset}"])
    assert cfg.target.name in HUB_IDS.values()
    assert len(cfg.target.aux_layer_ids) == 3


@pytest.mark.parametrize("overrides,need", [
    (["data.dataset=/data/hs", "eval.speculative=false"], "embedding"),   # training only
    (["data.dataset=/data/hs"], "model"),                                  # + real decoding
    ([], "model"),                                     # + generation and extraction
])
def test_unreachable_weights_fail_at_check_in_one_line(hub_cache, overrides, need):
    cfg = _compose(["target=llama_3_1_8b", *overrides])
    with pytest.raises(ConfigError) as e:
        check(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("target.name='meta-llama/Llama-3.1-8B-Instruct': ")
    assert "hub offline" in msg and "HF_HOME" in msg and "Fix:" in msg


def test_the_embedding_shard_suffices_for_training_only(preset_hub_cache):
    check(_compose(["target=kimi_k2_5", "data.dataset=/data/hs", "eval.speculative=false"]))
    with pytest.raises(ConfigError) as e:   # real decoding runs the model: every shard
        check(_compose(["target=kimi_k2_5", "data.dataset=/data/hs"]))
    assert "1 of the 2 shards model reads not in the HF cache" in str(e.value)


def test_path_override_keeps_the_preset_aux_ids(hub_cache, tmp_path):
    local = resolve_target("tiny-llama")
    cfg = _compose(["target=llama_3_1_8b", f"target.name={local}", "data.dataset=/data/hs"])
    assert cfg.target.name == str(local) and list(cfg.target.aux_layer_ids) == [2, 16, 29]
    check(cfg)
    (tmp_path / "config.json").write_text((local / "config.json").read_text())
    cfg = _compose(["target=llama_3_1_8b", f"target.name={tmp_path}", "data.dataset=/data/hs"])
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert "\n" not in str(e.value) and "no *.safetensors or *.bin weights" in str(e.value)


def test_bare_config_only_preset_name_says_what_to_use():
    with pytest.raises(ConfigError) as e:
        check(_compose(["target.name=kimi-k2.5", "data.dataset=/data/hs"]))
    assert "config-only preset" in str(e.value) and "moonshotai/Kimi-K2.5" in str(e.value)


def test_main_job_stops_in_one_line_without_weights(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty-hub"),
               WANDB_MODE="offline")
    r = subprocess.run([sys.executable, str(ROOT / "train" / "main.py"), "target=kimi_k2_5",
                        "data.dataset=/data/kimi-hs", "eval.speculative=false",
                        f"hydra.run.dir={tmp_path}/r"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if "moonshotai/Kimi-K2.5" in line]
    assert len(lines) == 1 and "hub offline" in lines[0], r.stderr[-3000:]


def test_embedded_default_never_touches_the_network(tmp_path):
    """With the hub left online (no HF_HUB_OFFLINE), loading SmolLM2 opens no socket."""
    code = """
import sys
seen = []
sys.addaudithook(lambda ev, args: seen.append((ev, str(args)[:120]))
                 if ev in ("socket.connect", "socket.getaddrinfo") else None)
from eyas.data.common.targets import load_target, load_target_config, weights_error
model, tok = load_target("smollm2")
load_target_config("smollm2")
assert weights_error("smollm2", "model") is None
print("SEEN", seen)
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "SEEN []", r.stdout[-2000:]


def test_launch_help_kimi_example_passes_the_check(preset_hub_cache):
    help_text = subprocess.run([str(ROOT / "launch.sh"), "--no-venv", "--help"],
                               capture_output=True, text=True).stdout
    (line,) = [x for x in help_text.splitlines() if "target=kimi_k2_5" in x]
    overrides = [a for a in line.split() if "=" in a and not a.startswith("-")]
    check(_compose(overrides))


def test_launch_sh_leaves_hub_access_to_the_user():
    lines = (ROOT / "launch.sh").read_text().splitlines()
    forcing = [x for x in lines if "HF_HUB_OFFLINE=" in x and x.strip().startswith("export")]
    assert forcing == ['  export HF_HUB_OFFLINE=1 WANDB_MODE=offline'], forcing   # --test only


def test_readme_real_model_commands_pass_the_check(preset_hub_cache):
    import json

    from eyas.data.common.targets import load_target_config
    text = (ROOT / "README.md").read_text()
    section = text.split("## Train a drafter for a real model", 1)[1].split("\n## ", 1)[0]
    commands = [c for c in section.replace("\\\n", " ").splitlines()
                if c.strip().startswith("./launch.sh")]
    assert len(commands) == 2, commands
    index = {"weight_map": {"model.embed_tokens.weight": "s1.safetensors",
                            "model.norm.weight": "s2.safetensors"}}
    preset_hub_cache(HUB_IDS["llama-3.1-8b"], {   # the whole model, for real decoding
        "config.json": json.dumps(load_target_config("llama-3.1-8b")).encode(),
        "model.safetensors.index.json": json.dumps(index).encode(),
        "s1.safetensors": b"stub", "s2.safetensors": b"stub"})
    for command in commands:
        overrides = [a for a in command.split() if "=" in a and not a.startswith("-")]
        check(_compose(overrides))
