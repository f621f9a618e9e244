"""Exports loaded by vLLM's and SGLang's own loaders on CPU (models/serving/loaders).

Marker `engines` (deselected by default): `pytest -m engines`. The first run creates the engine
venvs (~14 GB under ~/.cache/eyas/engines, a few minutes); later runs reuse them. The verdict
table is written to $EYAS_ENGINE_VERDICTS when set (benchmarks/engine_verdicts.md).

Clean exports (SmolLM2 drafter built like a training run's, real-shape Llama-3.1-8B and
Kimi-K2.5 drafters with random weights, the validator tests' tiny one) must load cleanly in
both engines; each deliberately broken export of tests/models/serving/test_validate.py gets the two
engines' verdicts, and each fault must be caught the way RAISES / PROBE / SILENT below say
(benchmarks/engine_verdicts.md is the table these verdicts regenerate).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.loaders import check_engines, check_engines_many
from eyas.data.engine.venvs import EngineSetupError, ensure_venv, file_lock, venv_dir
from eyas.models.serving.engine_rope import EngineRope
from eyas.models.serving.export import export_drafter
from eyas.data.common.targets import load_target_config, text_config

from eyas.models.serving.contract import TensorDir
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "engines")

_spec = importlib.util.spec_from_file_location(  # a helper next to this file, not a package
    "_eyas_broken_exports", Path(__file__).with_name("broken_exports.py"))
_be = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_be)
BROKEN_TARGET, broken_exports = _be.BROKEN_TARGET, _be.broken_exports
clean_tiny_export, random_export = _be.clean_tiny_export, _be.random_export
_spec = importlib.util.spec_from_file_location(
    "_eyas_verdicts", Path(__file__).with_name("verdicts.py"))
_vd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_vd)
verdict, verdict_table = _vd.verdict, _vd.verdict_table

pytestmark = pytest.mark.engines

CLEAN = ("smollm2", "llama-3.1-8b", "kimi-k2.5", "tiny-llama")
# tiny-llama targets with a long-context RoPE whose cos/sin factor is not 1 (yarn: 0.1·ln 4 + 1)
ROPE_TARGETS = {
    "tiny-yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "tiny-longrope": {"rope_type": "longrope", "original_max_position_embeddings": 2048,
                      "short_factor": [1.0 + 0.1 * i for i in range(8)],
                      "long_factor": [1.0 + 2.0 * i for i in range(8)]},
}
ROPE_KINDS = {"llama-3.1-8b": "llama3", "kimi-k2.5": "yarn", "tiny-yarn": "yarn",
              "tiny-longrope": "longrope"}


def rope_target(name: str) -> dict:
    return dict(load_target_config("tiny-llama"), rope_scaling=ROPE_TARGETS[name],
                max_position_embeddings=8192)

# caught by the engine's own code: it raises while loading (the **raises** cells of
# benchmarks/engine_verdicts.md)
RAISES = {
    "vllm": {"extra_tensor", "model_prefix", "embed_other_width", "target_hidden_mismatch",
             "lm_head_rows", "q_proj_input_h", "target_hidden_null"},
    "sglang": {"arch_without_eagle", "embed_other_width", "target_hidden_mismatch",
               "lm_head_rows", "q_proj_input_h", "target_hidden_null"},
}
# silent in the engine, caught by the probe around its loader: case -> {engine: code}
PROBE = {
    "bias_tensor": {"vllm": "ENGINE_DROPPED", "sglang": "ENGINE_DROPPED"},
    "extra_tensor": {"sglang": "ENGINE_DROPPED"},
    "missing_d2t": {"vllm": "ENGINE_UNWRITTEN", "sglang": "ENGINE_SMOKE"},
    "missing_lm_head": {"vllm": "ENGINE_LM_HEAD_FROM_TARGET", "sglang": "ENGINE_UNWRITTEN"},
    "missing_tensor": {"vllm": "ENGINE_UNWRITTEN", "sglang": "ENGINE_UNWRITTEN"},
    "nan_weight": {"vllm": "ENGINE_NONFINITE", "sglang": "ENGINE_NONFINITE"},
    "absolute_d2t_alone": {"vllm": "ENGINE_SMOKE", "sglang": "ENGINE_SMOKE"},
    "d2t_out_of_range": {"vllm": "ENGINE_SMOKE", "sglang": "ENGINE_SMOKE"},
    "vocab_size": {"vllm": "ENGINE_SMOKE"},
    "norm_before_residual": {"vllm": "ENGINE_NORM_BEFORE_RESIDUAL",
                             "sglang": "ENGINE_NORM_BEFORE_RESIDUAL"},
    "aux_missing": {"vllm": "ENGINE_AUX_LAYERS"},             # vLLM falls back to eagle_config
    "aux_same_in_both_keys": {"sglang": "ENGINE_AUX_LAYERS"},  # SGLang adds 1
    "aux_sglang_spelling_in_vllm_key": {"vllm": "ENGINE_AUX_LAYERS",
                                        "sglang": "ENGINE_AUX_LAYERS"},
}
# loads without a word in both engines and nothing in the probe notices: validator only
SILENT = {"layers0", "d2t_not_increasing", "t2d_mismatch", "d2t_int32", "fp32_fp16_mix",
          "max_pos_2048", "aux_descending"}


TABLE_TITLE = (
    "### What vLLM's and SGLang's own loaders catch\n\n"
    "Each deliberately broken export of the validator's tests (tiny-llama target) loaded on CPU "
    "by `eyas engines check`. Regenerate: `EYAS_ENGINE_VERDICTS=benchmarks/engine_verdicts.md "
    "pytest -m engines tests/models/serving/test_loaders.py`.\n")


def smollm2_export(out: Path) -> Path:
    """A drafter for the SmolLM2 target as a training run builds it, random weights, exported."""
    tcfg = load_target_config("smollm2")
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=8192, ttt_steps=3)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, attention="eager")
    ids = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
    drafter.set_vocab_map(ids - torch.arange(cfg.draft_vocab_size))
    return export_drafter(drafter.state_dict(), cfg, None, None, out, target_config=tcfg)


def rope_export(name: str, out: Path) -> Path:
    """A random tiny drafter derived from a tiny target with long-context RoPE, exported."""
    tcfg = rope_target(name)
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=512, ttt_steps=3)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, attention="eager")
    ids = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
    drafter.set_vocab_map(ids - torch.arange(cfg.draft_vocab_size))
    return export_drafter(drafter.state_dict(), cfg, None, None, out, target_config=tcfg)


EAGLE31 = dict(norm_before_fc=True, fc_norm=True, norm_output=True)
#: clean exports whose key is not their target's name
TARGET_OF = {"tiny-eagle31": "tiny-llama"}


def eagle31_export(out: Path) -> Path:
    """A random tiny drafter with every EAGLE-3.1 norm on (norms not the identity), exported."""
    tcfg = load_target_config("tiny-llama")
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=512, ttt_steps=3, **EAGLE31)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, attention="eager")
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith(("input_norm", "fc_norm")):
                p.copy_(1 + 0.5 * torch.randn(p.shape))
    ids = torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values
    drafter.set_vocab_map(ids - torch.arange(cfg.draft_vocab_size))
    return export_drafter(drafter.state_dict(), cfg, None, None, out, target_config=tcfg)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    clean = {"smollm2": smollm2_export(root / "smollm2"),
             "llama-3.1-8b": random_export("llama-3.1-8b", root / "llama8b"),
             "kimi-k2.5": random_export("kimi-k2.5", root / "kimi"),
             "tiny-llama": clean_tiny_export(root / "tiny"),
             **{name: rope_export(name, root / name) for name in ROPE_TARGETS},
             "tiny-eagle31": eagle31_export(root / "eagle31")}
    return clean, broken_exports(clean["tiny-llama"], root / "broken")


@pytest.fixture(scope="module")
def verdicts(exports):
    """{name: {engine: EngineReport}} for every clean and broken export (one process/engine)."""
    clean, broken = exports
    names = list(clean) + list(broken)
    pairs = [(d, rope_target(t) if t in ROPE_TARGETS else TARGET_OF.get(t, t))
             for t, d in clean.items()]
    pairs += [(d, BROKEN_TARGET) for d, _ in broken.values()]
    t0 = time.time()
    reports = check_engines_many(pairs)
    print(f"\n{len(pairs)} exports x 2 engines checked in {time.time() - t0:.0f} s")
    for name, rep in zip(names, reports):
        if any(r.findings and r.findings[0].code == "ENGINE_UNAVAILABLE" for r in rep.values()):
            pytest.fail(f"engine unavailable: {rep}")
    return dict(zip(names, reports))


@pytest.mark.parametrize("preset", CLEAN)
@pytest.mark.parametrize("engine", ("vllm", "sglang"))
def test_clean_exports_load_cleanly(verdicts, exports, preset, engine):
    rep = verdicts[preset][engine]
    assert rep.ok and rep.loaded, "\n".join(map(str, rep.findings))
    tcfg = text_config(load_target_config(preset))
    cfg = json.loads((exports[0][preset] / "config.json").read_text())
    # every shipped tensor reached a parameter, except t2d (and SGLang's d2t -> hot_token_id)
    reached = rep.raw["reached"]
    assert set(reached) == set(TensorDir(exports[0][preset]).names) and len(reached) == 15
    assert [n for n, ps in reached.items() if not ps] == (["d2t", "t2d"] if engine == "sglang"
                                                           else ["t2d"])
    # the only unwritten parameter is the embedding, which the engine takes from the target
    assert rep.unwritten == {"model.embed_tokens.weight": 1.0}
    assert list(rep.from_target) == ["model.embed_tokens.weight"]
    assert rep.nonfinite == []
    # the engine feeds the layers the drafter was trained on: [2, N//2, N-3]
    n = tcfg["num_hidden_layers"]
    assert rep.resolved["aux_layer_ids"] == [2, n // 2, n - 3]
    assert rep.resolved["target_vocab_size"] == tcfg["vocab_size"]
    width = tcfg["vocab_size"] if engine == "vllm" else cfg["draft_vocab_size"]
    assert rep.smoke["logits_shape"] == [4, width] and rep.smoke["logits_finite"]
    assert rep.smoke["mapped_in_range"] and rep.smoke["mapped_increasing"]
    # plain EAGLE-3: none of the EAGLE-3.1 norms is applied
    assert rep.resolved["eagle31"] == {k: False for k in EAGLE31}


@pytest.mark.parametrize("engine", ("vllm", "sglang"))
def test_eagle31_norms_are_loaded_and_applied(verdicts, exports, engine):
    """norm_before_fc, fc_norm and norm_output under the export's spellings: the engine turns
    each on, every norm tensor reaches its parameter and nothing is left unwritten."""
    rep = verdicts["tiny-eagle31"][engine]
    assert rep.ok and rep.loaded, "\n".join(map(str, rep.findings))
    assert rep.resolved["eagle31"] == {k: True for k in EAGLE31}
    reached = rep.raw["reached"]
    for name in ("input_norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"):
        assert reached[name], (name, reached)
    assert rep.unwritten == {"model.embed_tokens.weight": 1.0}


@pytest.mark.parametrize("preset", CLEAN + tuple(ROPE_TARGETS))
@pytest.mark.parametrize("engine", ("vllm", "sglang"))
def test_engines_rope_is_the_references(verdicts, exports, preset, engine):
    """The rotary tables the engine built from the export's config.json (read through its own
    module at positions up to the served length) are the engine-math reference's: llama3 for
    Llama-3.1-8B, yarn for Kimi-K2.5 (the target's scaling, carried by the export), and the tiny
    yarn and longrope drafters, whose cos/sin factor is not 1."""
    rep = verdicts[preset][engine]
    assert rep.ok and rep.loaded, "\n".join(map(str, rep.findings))
    rope = rep.raw["rope"]
    assert "error" not in rope, rope
    cfg = json.loads((exports[0][preset] / "config.json").read_text())
    kind = (cfg.get("rope_scaling") or {}).get("rope_type", "default")
    assert kind == ROPE_KINDS.get(preset, "default")
    if kind == "yarn":
        assert rope["class"] == "YaRNScalingRotaryEmbedding"
        assert cfg["rope_scaling"]["original_max_position_embeddings"] in (2048, 4096)
    ref = EngineRope(cfg, int(cfg["head_dim"]), engine)
    pos = torch.tensor(rope["positions"])
    assert int(pos.max()) >= 8191                             # beyond the original lengths
    cos, sin = ref.cos_sin(pos)
    torch.testing.assert_close(torch.tensor(rope["cos"]), cos, atol=1e-2, rtol=0)
    torch.testing.assert_close(torch.tensor(rope["sin"]), sin, atol=1e-2, rtol=0)
    plain = EngineRope(dict(cfg, rope_scaling=None), int(cfg["head_dim"]), engine).cos_sin(pos)
    if kind != "default":                                     # the scaling is what they serve
        assert float((plain[0] - cos).abs().max()) > 0.1


@pytest.mark.parametrize("engine", ("vllm", "sglang"))
def test_engine_raises_where_documented(verdicts, engine):
    for case in sorted(RAISES[engine]):
        rep = verdicts[case][engine]
        assert verdict(rep)[0] == "raises", (case, [str(f) for f in rep.findings])
        assert not rep.loaded and rep.error["message"] is not None
        assert rep.findings[0].code == "ENGINE_LOAD_ERROR"
        assert rep.error["type"] in rep.findings[0].message  # the engine's own exception


def test_probe_catches_silent_faults(verdicts):
    for case, want in sorted(PROBE.items()):
        for engine, code in want.items():
            rep = verdicts[case][engine]
            if case in RAISES[engine]:
                continue
            assert rep.loaded, (case, engine, rep.error)
            assert code in {f.code for f in rep.findings}, (case, engine,
                                                           [str(f) for f in rep.findings])
    bias = verdicts["bias_tensor"]["vllm"]
    assert bias.dropped == ["midlayer.self_attn.q_proj.bias"]
    lm = verdicts["missing_lm_head"]["sglang"]
    assert lm.unwritten == {"lm_head.weight": 1.0, "model.embed_tokens.weight": 1.0}
    nan = verdicts["nan_weight"]["sglang"]
    assert nan.nonfinite == ["model.layers.0.mlp.down_proj.weight"]


def test_validator_only_faults_are_silent_in_both_engines(verdicts):
    for case in sorted(SILENT):
        for engine in ("vllm", "sglang"):
            rep = verdicts[case][engine]
            assert rep.loaded and rep.ok, (case, engine, [str(f) for f in rep.findings])


def test_verdict_table(verdicts, exports, tmp_path):
    _, broken = exports
    rows = [(case, sorted(codes), verdicts[case]) for case, (_, codes) in broken.items()]
    rows = [("clean (tiny-llama)", [], verdicts["tiny-llama"])] + rows
    table = verdict_table(rows, title=TABLE_TITLE)
    assert table.count("\n| `") == len(rows)
    for case in RAISES["vllm"] | RAISES["sglang"]:
        assert f"| `{case}` |" in table and "**raises**" in table.split(f"| `{case}` |")[1]
    (tmp_path / "engine_verdicts.md").write_text(table)
    if os.environ.get("EYAS_ENGINE_VERDICTS"):
        Path(os.environ["EYAS_ENGINE_VERDICTS"]).write_text(table)
    print("\n" + table)


def test_api_and_cli_on_one_engine(exports, tmp_path, capsys):
    clean, broken = exports
    reps = check_engines(clean["tiny-llama"], BROKEN_TARGET, ("sglang",))
    assert list(reps) == ["sglang"] and reps["sglang"].ok
    bad = broken["bias_tensor"][0]
    assert cli_main(["check", str(bad), "--target-config", BROKEN_TARGET, "--engines",
                     "sglang", "--json", "--no-setup"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [f["code"] for f in out["sglang"]["findings"]] == ["ENGINE_DROPPED"]
    assert out["sglang"]["dropped"] == ["midlayer.self_attn.q_proj.bias"]
    with pytest.raises(SystemExit):
        cli_main(["check", str(bad), "--target-config", BROKEN_TARGET, "--engines", "tgi"])


def test_venv_build_is_locked_and_leaves_nothing_on_failure(tmp_path):
    """A second builder waits for the lock; a failed install leaves no directory behind."""
    root = tmp_path / "venvs"
    errors = []

    def build():
        try:  # a release that does not exist: the installer fails after resolving
            ensure_venv("sglang", "0.0.0.999", root=root)
        except EngineSetupError as e:
            errors.append(str(e))

    lock = root / "sglang-0.0.0.999.lock"
    with file_lock(lock):
        t = threading.Thread(target=build)
        t.start()
        time.sleep(2.0)
        assert t.is_alive()          # blocked on the lock held here
    t.join(timeout=600)
    assert not t.is_alive() and len(errors) == 1 and "sglang==0.0.0.999" in errors[0]
    assert not venv_dir("sglang", "0.0.0.999", root).exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".sglang")]  # no temp dirs left
