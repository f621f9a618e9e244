"""The exporter: trainer checkpoints of every kind → a layout-A directory the validator passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.data.common.checksums import read_checksums
from eyas.data.produce.vocab import save_vocab
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.card import serve_commands
from eyas.models.serving.export import EXPORT_META, ExportError, export_checkpoint, export_drafter
from eyas.data.common.targets import load_target_config
from eyas.models.serving.contract import CORE_TENSORS, TensorDir
from eyas.models.serving.validate import validate
from eyas.train.cli import main

from tests.ports import free_port
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "export")

VD = 512
ROOT = Path(__file__).resolve().parents[3]
LAYOUT_A = set(CORE_TENSORS) | {"d2t", "t2d"}


def make_drafter(tcfg: dict, vd: int = VD, seed: int = 0):
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=vd, ttt_steps=4)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, attention="eager")
    if vd < cfg.vocab_size:
        ids = torch.randperm(cfg.vocab_size)[:vd].sort().values
        drafter.set_vocab_map(ids - torch.arange(vd))
    return cfg, drafter.state_dict()


@pytest.fixture(scope="module")
def tcfg():
    return load_target_config("tiny-llama")


@pytest.fixture(scope="module")
def drafter(tcfg):
    return make_drafter(tcfg)


def assert_exported(out: Path, cfg: Eagle3Config, sd: dict, tcfg: dict) -> None:
    """Names exactly layout A, bf16 weights equal to the source rounded, the config exact."""
    got = TensorDir(out).load_all()
    assert set(got) == LAYOUT_A
    for name, t in got.items():
        if name in ("d2t", "t2d"):
            assert t.dtype == (torch.int64 if name == "d2t" else torch.bool)
            assert torch.equal(t, sd[name])
        else:
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, sd[name].to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text()) == cfg.to_config_dict()
    assert validate(out, tcfg) == []
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]  # no temp dir left


def test_plain_state_dict_file_with_wrapper_prefixes(drafter, tcfg, tmp_path):
    cfg, sd = drafter
    f = tmp_path / "weights.safetensors"
    save_file({f"module._orig_mod.{k}": v for k, v in sd.items()}, f)
    out = export_checkpoint(f, tmp_path / "out", config=cfg, target_config=tcfg)
    assert_exported(out, cfg, sd, tcfg)
    meta = json.loads((out / EXPORT_META).read_text())
    assert meta["ttt_steps"] == 4 and meta["aux_layer_ids"] == cfg.aux_layer_ids


def test_bin_file_with_a_wrapper_attribute(drafter, tcfg, tmp_path):
    # a training module holding the drafter as `.drafter` plus tensors of its own
    cfg, sd = drafter
    wrapped = {f"drafter.{k}": v for k, v in sd.items()}
    wrapped["teacher_rows"] = torch.zeros(4, 64)
    torch.save({"module": wrapped}, tmp_path / "mp_rank_00_model.pt")
    out = export_checkpoint(tmp_path / "mp_rank_00_model.pt", tmp_path / "out",
                            config=cfg.to_dict(), target_config=tcfg)
    assert_exported(out, cfg, sd, tcfg)


def test_ddp_checkpoint_dir_with_eyas_json_and_vocab_file(drafter, tcfg, tmp_path):
    cfg, sd = drafter
    ck = tmp_path / "step-000010"
    ck.mkdir()
    weights = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}  # map only in the file
    save_file({f"module.{k}": v for k, v in weights.items()}, ck / "model.safetensors")
    save_vocab(ck / "vocab.safetensors", sd["d2t"], sd["t2d"])
    (ck / "eyas.json").write_text(json.dumps({"drafter": cfg.to_dict(), "lr": 1e-4}))
    out = export_checkpoint(ck, tmp_path / "out", target_config=tcfg)
    assert_exported(out, cfg, sd, tcfg)
    meta = json.loads((out / EXPORT_META).read_text())
    assert meta["ttt_steps"] == 4 and meta["training"]["lr"] == 1e-4
    # a run's checkpoints/ dir resolves through its `latest` pointer
    (tmp_path / "latest").write_text("step-000010")
    out2 = export_checkpoint(tmp_path, tmp_path / "out2", target_config=tcfg)
    assert TensorDir(out2).load_all().keys() == TensorDir(out).load_all().keys()


def test_full_vocabulary_ships_no_mapping(tcfg, tmp_path):
    cfg, sd = make_drafter(tcfg, vd=49152)
    out = export_drafter(sd, cfg, None, None, tmp_path / "full", target_config=tcfg)
    assert set(TensorDir(out).names) == set(CORE_TENSORS)
    assert validate(out, tcfg) == []


def test_refusals_leave_nothing_behind(drafter, tcfg, tmp_path):
    cfg, sd = drafter
    cases = {  # name -> (state dict, d2t passed in, the refusal's message)
        "bias": (dict(sd, **{"midlayer.self_attn.q_proj.bias": torch.zeros(64)}), None,
                 r"checkpoint tensors outside layout A: \['midlayer\.self_attn\.q_proj\.bias'\]"),
        "shape": (dict(sd, **{"fc.weight": torch.zeros(64, 64)}), None,
                  r"fc\.weight has shape \[64, 64\] but the config implies \[64, 192\]"),
        "absolute": ({k: v for k, v in sd.items() if k not in ("d2t", "t2d")},
                     torch.arange(VD) + sd["d2t"],
                     r"vocab map: i \+ d2t\[i\] leaves \[0, 49152\): d2t must hold offsets"),
        "missing": ({k: v for k, v in sd.items() if k != "norm.weight"}, None,
                    r"checkpoint lacks \['norm\.weight'\]: not a complete EAGLE-3 drafter"),
    }
    for name, (state, d2t, message) in cases.items():
        with pytest.raises(ExportError, match=message):
            export_drafter(state, cfg, d2t, None, tmp_path / name, target_config=tcfg)
        assert not (tmp_path / name).exists()
    # a rebuilt mapping that disagrees with the checkpoint's own buffer is refused
    other = sd["d2t"].clone()
    other[0] += 1
    with pytest.raises(ExportError, match="differs"):
        export_drafter(sd, cfg, other, None, tmp_path / "rebuilt")
    # the target check runs inside the export: a drafter for another target is refused
    with pytest.raises(ExportError, match="VOCAB_SIZE"):
        export_drafter(sd, cfg, None, None, tmp_path / "kimi",
                       target_config=load_target_config("kimi-k2.5"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite(drafter, tcfg, tmp_path):
    cfg, sd = drafter
    out = export_drafter(sd, cfg, None, None, tmp_path / "o", target_config=tcfg)
    with pytest.raises(FileExistsError):
        export_drafter(sd, cfg, None, None, out)
    sd2 = dict(sd, **{"norm.weight": torch.full((64,), 2.0)})
    export_drafter(sd2, cfg, None, None, out, overwrite=True)
    assert torch.equal(TensorDir(out).load("norm.weight"), torch.full((64,), 2.0,
                                                                        dtype=torch.bfloat16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_speculators_config_export(drafter, tcfg, tmp_path):
    cfg, sd = drafter
    out = export_drafter(sd, cfg, None, None, tmp_path / "d", target_config=tcfg,
                         speculators=True, verifier="/models/tiny-llama")
    spec_dir = tmp_path / "d-speculators"
    spec = json.loads((spec_dir / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3"
    assert spec["norm_before_residual"] is False
    assert spec["draft_vocab_size"] == VD and spec["target_hidden_size"] == 64
    assert spec["eagle_aux_hidden_state_layer_ids"] == cfg.aux_layer_ids
    assert spec["speculators_config"]["verifier"] == {"name_or_path": "/models/tiny-llama",
                                                      "architectures": ["LlamaForCausalLM"]}
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    layer = spec["transformer_layer_config"]
    assert layer["vocab_size"] == 49152 and layer["num_hidden_layers"] == 1
    assert "eagle_config" not in layer and "draft_vocab_size" not in layer
    assert (spec_dir / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    # the run record travels along; the card is the directory's own (tests/.../test_card.py)
    assert (spec_dir / "eyas_provenance.json").read_bytes() == (
        out / "eyas_provenance.json").read_bytes()
    assert "Eagle3Speculator" in (spec_dir / "README.md").read_text()
    assert {"README.md", "eyas_provenance.json"} <= set(read_checksums(spec_dir))
    # the layout-A config.json itself stays free of speculators keys
    assert validate(out, tcfg) == []
    with pytest.raises(ExportError, match="verifier"):
        export_drafter(sd, cfg, None, None, tmp_path / "e", speculators=True)
    assert not (tmp_path / "e").exists()


def test_a_relative_local_verifier_is_written_absolute(drafter, tcfg, tmp_path, monkeypatch):
    """vLLM reads name_or_path verbatim from the server's working directory: a relative or `~`
    local path would name another path (or none) there."""
    cfg, sd = drafter
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "t.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "models"))
    cases = [("models/tiny", str(tmp_path / "models" / "tiny")),
             ("models/t.gguf", str(tmp_path / "models" / "t.gguf")),   # a file is a path too
             ("~/tiny", str(tmp_path / "models" / "tiny")),
             ("org/not-here", "org/not-here"),                         # a hub id stays as is
             ("/srv/llama", "/srv/llama")]                             # so does an absolute path
    for i, (verifier, written) in enumerate(cases):
        export_drafter(sd, cfg, None, None, tmp_path / f"o{i}", target_config=tcfg,
                       speculators=True, verifier=verifier)
        spec = json.loads((tmp_path / f"o{i}-speculators" / "config.json").read_text())
        assert spec["speculators_config"]["verifier"]["name_or_path"] == written, verifier
    with pytest.raises(ExportError, match=r"--verifier '~/missing': .*missing does not exist"):
        export_drafter(sd, cfg, None, None, tmp_path / "bad", target_config=tcfg,
                       speculators=True, verifier="~/missing")
    assert not (tmp_path / "bad").exists()         # refused before anything is built


def test_a_speculators_export_leaves_no_half_of_the_pair(drafter, tcfg, tmp_path, monkeypatch):
    cfg, sd = drafter
    kw = dict(target_config=tcfg, speculators=True, verifier="/models/tiny-llama")
    (tmp_path / "a-speculators").mkdir()               # taken: refused before anything is built
    with pytest.raises(FileExistsError, match="a-speculators already exists: .*--overwrite"):
        export_drafter(sd, cfg, None, None, tmp_path / "a", **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-speculators"]

    def fail(*args, **kwargs):                         # the second half fails once the first
        raise OSError("No space left on device")       # is in place
    monkeypatch.setattr("eyas.models.serving.export.write_speculators_export", fail)
    with pytest.raises(OSError, match="No space left"):
        export_drafter(sd, cfg, None, None, tmp_path / "b", **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-speculators"]


def test_cli_prints_the_serve_commands(drafter, tcfg, tmp_path, capsys):
    cfg, sd = drafter
    ck = tmp_path / "ck"
    ck.mkdir()
    save_file(sd, ck / "model.safetensors")
    (ck / "eyas.json").write_text(json.dumps({"drafter": cfg.to_dict()}))
    assert cli_main([str(ck), str(tmp_path / "out"), "--target-config", "tiny-llama"]) == 0
    text = capsys.readouterr().out
    vllm, sglang = serve_commands((tmp_path / "out").resolve(), "tiny-llama", 4)
    assert vllm in text and sglang in text
    assert '"num_speculative_tokens":4' in vllm and "--speculative-num-draft-tokens 5" in sglang
    # through the `eyas` command: an existing OUT_DIR is a usage error, one line, exit 2
    assert main(["export", str(ck), str(tmp_path / "out"), "--target-config", "tiny-llama"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("eyas export: ") and "already exists" in last and "Traceback" not in err


@pytest.mark.slow
def test_deepspeed_zero3_two_process_checkpoint(tcfg, tmp_path):
    """A real 2-process ZeRO-3 save (gloo) is gathered into the exact trained parameters."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")     # eyas is installed: nothing on PYTHONPATH
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(
        [str(Path(sys.executable).parent / "accelerate"), "launch", "--use_deepspeed",
         "--zero_stage", "3", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
         str(ROOT / "tests" / "models" / "serving" / "deepspeed_save_drafter.py"), str(tmp_path), "3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    shards = sorted(p.name for p in (tmp_path / "ckpt" / "pytorch_model").iterdir())
    assert shards == [f"zero_pp_rank_{i}_mp_rank_00_{k}_states.pt"
                      for i in (0, 1) for k in ("model", "optim")]
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "export", target_config=tcfg)
    ref = load_file(tmp_path / "reference.safetensors")
    got = TensorDir(out).load_all()
    assert set(got) == LAYOUT_A
    for name, t in got.items():
        assert torch.equal(t, ref[name].to(t.dtype)), name
    cfg, init = make_drafter(tcfg)  # the same seed: the saved weights are the trained ones
    assert not torch.equal(got["fc.weight"], init["fc.weight"].to(torch.bfloat16))
    assert json.loads((out / EXPORT_META).read_text())["ttt_steps"] == 2
    assert validate(out, tcfg) == []
