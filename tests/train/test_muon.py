"""optim=muon (train/muon.py): torch's Muon for the drafter's hidden matrices, AdamW for the rest,
as one optimizer that steps, saves and resumes exactly."""

import copy
import subprocess

import pytest
import torch

from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.train.config import ConfigError, OptimConfig, check
from eyas.train.muon import MuonAdamW
from eyas.train.optim import MasterAdamW, apply_optim_settings, build_optimizer, build_scheduler
from tests.train.test_config import _compose
from tests.train.test_trainer import _export_tensors, assert_resumed, losses, ranks, run

MUON = ["fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
        "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight"]
ADAMW = ["midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
         "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight"]
CFG = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1)


def _drafter(dtype=torch.float32) -> Eagle3Drafter:
    cfg = Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=256,
                                   aux_layer_ids=[2, 4, 5], ttt_steps=3)
    torch.manual_seed(0)
    return Eagle3Drafter(cfg, attention="eager", compile_flex=False).to(dtype)


def _grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _trainable(module):
    return [p for p in module.parameters() if p.requires_grad]


def test_hidden_matrices_go_to_muon_and_the_rest_to_adamw():
    d = _drafter()
    names = {id(p): n for n, p in d.named_parameters()}
    opt = build_optimizer(d.parameters(), CFG, master_weights=False)
    assert isinstance(opt, MuonAdamW) and len(opt.param_groups) == 2
    muon, adamw = ([names[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert muon == MUON and opt.param_groups[0]["muon"] is True
    assert sorted(adamw) == sorted(ADAMW)
    assert "embed_tokens.weight" not in muon + adamw            # frozen: no optimizer at all
    assert opt.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert opt.param_groups[0]["lr"] == opt.param_groups[1]["lr"] == CFG.lr   # one optim.lr
    assert "torch Muon on 8 hidden matrices" in opt.describe()


def test_a_step_equals_torch_muon_and_adamw_stepped_apart():
    d, ref = _drafter(), _drafter()
    opt = build_optimizer(d.parameters(), CFG, master_weights=False)
    named = dict(ref.named_parameters())
    muon = torch.optim.Muon([named[n] for n in MUON], lr=CFG.lr, weight_decay=0.1,
                            momentum=0.95, nesterov=True, ns_steps=5,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([named[n] for n in ADAMW], lr=CFG.lr, betas=(0.9, 0.95),
                              eps=1e-8, weight_decay=0.1)
    for seed in (1, 2):
        _grads(_trainable(d), seed)
        _grads(_trainable(ref), seed)
        opt.step()
        muon.step()
        adamw.step()
    for (name, a), b in zip(d.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_bitwise(dtype):
    """Steps 1-2, save, load into a fresh optimizer over a copy, steps 3-4: the parameters of
    an unbroken 4-step run, bitwise; bf16 parameters through fp32 masters (MasterAdamW's half)."""
    masters = dtype == torch.bfloat16

    def build(module):
        opt = build_optimizer(module.parameters(), CFG, master_weights=masters)
        return opt, build_scheduler(opt, CFG, 10)

    a = _drafter(dtype)
    opt_a, sched_a = build(a)
    assert isinstance(opt_a.adamw, MasterAdamW) == masters
    for seed in (1, 2, 3, 4):
        if seed == 3:
            b = _drafter(dtype)           # not a deepcopy: it drops the use_muon flags
            b.load_state_dict(a.state_dict())
            saved_opt = copy.deepcopy(opt_a.state_dict())
            saved_sched = copy.deepcopy(sched_a.state_dict())
        _grads(_trainable(a), seed)
        opt_a.step()
        sched_a.step()
    opt_b, sched_b = build(b)
    opt_b.load_state_dict(saved_opt)
    sched_b.load_state_dict(saved_sched)
    assert apply_optim_settings(sched_b, CFG) == []
    for seed in (3, 4):
        _grads(_trainable(b), seed)
        opt_b.step()
        sched_b.step()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert [g["lr"] for g in opt_a.param_groups] == [g["lr"] for g in opt_b.param_groups]


def test_a_skipped_step_changes_nothing():
    d = _drafter()
    opt = build_optimizer(d.parameters(), CFG, master_weights=False)
    _grads(_trainable(d), 1)
    before = [p.clone() for p in d.parameters()]
    opt.step(skip=torch.tensor(True))
    assert all(torch.equal(p, q) for p, q in zip(d.parameters(), before))
    assert not opt.muon.state and not opt.adamw.state
    fc = d.fc.weight.clone()
    opt.step(skip=torch.tensor(False))
    assert not torch.equal(d.fc.weight, fc)


def test_changed_muon_settings_apply_on_resume():
    d = _drafter()
    opt = build_optimizer(d.parameters(), CFG, master_weights=False)
    sched = build_scheduler(opt, CFG, 10)
    new = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1, muon_lr=0.02, muon_momentum=0.9)
    lines = apply_optim_settings(sched, new)
    assert lines == ["optim.muon_momentum: 0.95 in the checkpoint, 0.9 now",
                     "optim.muon_lr: 0.01 in the checkpoint, 0.02 now"]
    assert sched.base_lrs == [0.02, 0.01] and opt.muon.param_groups[0]["momentum"] == 0.9


def test_muon_is_refused_under_deepspeed_zero3_with_one_line():
    with pytest.raises(ConfigError) as e:
        check(_compose(["optim=muon", "dist=zero3", "optim.clip_grad_norm=0"]))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("optim.name='muon': expected adamw under DeepSpeed ZeRO-3")
    assert "Fix: dist=zero2 or dist=ddp" in msg


@pytest.mark.parametrize("dist", ["zero1", "zero2"])
def test_muon_runs_under_zero1_and_zero2_without_clipping(dist):
    check(_compose(["optim=muon", f"dist={dist}", "optim.clip_grad_norm=0"]))


@pytest.mark.parametrize("override,key", [
    ([], "optim.clip_grad_norm=0.5: expected 0 with optim=muon under dist=zero2"),
    (["optim.muon_nesterov=false"], "optim.muon_nesterov=False: expected true under dist=zero2"),
    (["optim.muon_ns_steps=6"], "optim.muon_ns_steps=6: expected 5 under dist=zero2")])
def test_what_deepspeeds_muon_cannot_honour_is_refused_with_one_line(override, key):
    clip = [] if not override else ["optim.clip_grad_norm=0"]
    with pytest.raises(ConfigError) as e:
        check(_compose(["optim=muon", "dist=zero2", *clip, *override]))
    assert "\n" not in str(e.value) and str(e.value).startswith(key), str(e.value)


ZCFG = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1, clip_grad_norm=0.0)


def test_zero_groups_carry_torchs_lr_scale():
    """Under DeepSpeed: its MuonWithAuxAdam, AdamW's group first (the logged lr), then one
    Muon group per matrix shape whose lr is torch's scale over DeepSpeed's own times optim.lr
    and whose weight decay is divided by it: lr·wd and the step are torch Muon's."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from deepspeed.runtime.zero.muon.original_muon import _aspect_ratio_scale
    d = _drafter()
    names = {id(p): n for n, p in d.named_parameters()}
    opt = build_optimizer(d.parameters(), ZCFG, master_weights=False, deepspeed=True)
    assert type(opt) is MuonWithAuxAdam and "DeepSpeed MuonWithAuxAdam" in opt.describe()
    adamw, *muon = opt.param_groups
    assert adamw["use_muon"] is False and adamw["lr"] == ZCFG.lr
    assert sorted(names[id(p)] for p in adamw["params"]) == sorted(ADAMW)
    assert sorted(names[id(p)] for g in muon for p in g["params"]) == sorted(MUON)
    assert len(muon) == 5 and all(g["use_muon"] and g["ns_method"] == "gram" for g in muon)
    for g in muon:
        rows, cols = g["muon_shape"]
        assert all(tuple(p.shape) == (rows, cols) for p in g["params"])
        ratio = 0.2 * max(rows, cols) ** 0.5 / _aspect_ratio_scale(rows, cols)
        assert g["lr"] == pytest.approx(ZCFG.lr * ratio, rel=1e-12)
        assert g["lr"] * g["weight_decay"] == pytest.approx(ZCFG.lr * ZCFG.weight_decay,
                                                            rel=1e-12)
    original = OptimConfig(name="muon", lr=1e-2, muon_lr=0.02, muon_adjust_lr="original")
    opt = build_optimizer(d.parameters(), original, master_weights=False, deepspeed=True)
    assert [g["lr"] for g in opt.param_groups] == [1e-2] + [0.02] * 5   # scales agree


def test_zero_groups_take_changed_settings_on_resume_in_configured_units():
    d = _drafter()
    opt = build_optimizer(d.parameters(), ZCFG, master_weights=False, deepspeed=True)
    sched = build_scheduler(opt, ZCFG, 10)
    assert apply_optim_settings(sched, ZCFG) == []
    i = next(i for i, g in enumerate(opt.param_groups) if g.get("muon_shape") == (64, 192))
    new = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1, muon_lr=0.02,
                      muon_adjust_lr="original", clip_grad_norm=0.0)
    lines = apply_optim_settings(sched, new)
    assert lines == ["optim.muon_adjust_lr: match_rms_adamw in the checkpoint, original now",
                     "optim.muon_lr: 0.01 in the checkpoint, 0.02 now"]
    assert sched.base_lrs[i] == 0.02 and sched.base_lrs[0] == 1e-2     # the peaks, unscaled
    assert opt.param_groups[i]["weight_decay"] == 0.1 and opt.param_groups[i]["lr"] == 0.01
    assert apply_optim_settings(sched, new) == []


@pytest.mark.slow
def test_a_zero_step_is_torch_muons_step(tmp_path):
    """Two optimizer steps under 2-process ZeRO-1 and ZeRO-2 (tests/train/zero_muon_step.py)
    from the DDP optimizer's start with its gradients. AdamW's half: bitwise. Muon's
    matrices: torch's Muon algorithm, evaluated in fp64, to 1e-5 where DeepSpeed's Gram
    Newton-Schulz runs in fp32 (the CPU without fp16 matmuls; measured ~2e-6), so DeepSpeed's
    lr and weight decay are torch's; and within 4 % of torch's own Muon step (measured
    1.3-2.1 %), all of it torch's bf16 Newton-Schulz rounding (torch's bf16 iteration is as
    far from the fp64 one)."""
    import json
    from tests.ports import free_port
    from tests.train.test_trainer import ACCELERATE, ROOT, _env
    out = tmp_path / "steps.json"
    cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(free_port()), str(ROOT / "tests" / "train" / "zero_muon_step.py"), str(out),
           "zero1", "zero2"]
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(out.read_text())
    for dist, stage in (("zero1", 1), ("zero2", 2)):
        rep = report[dist]
        assert (rep["world_size"], rep["engine"], rep["stage"]) == (2, "DEEPSPEED", stage)
        assert rep["optimizer"] == ["DeepSpeedZeroOptimizer", "MuonWithAuxAdam"]
        for step in rep["steps"]:
            for name, v in step.items():
                if name in ADAMW:
                    assert v["ddp"] == 0.0, (dist, name, v)
                else:
                    assert v["ddp"] < 0.04, (dist, name, v)
                    if rep["ns_dtype"] == "torch.float32":
                        assert v["exact"] < 1e-5, (dist, name, v)


@pytest.mark.slow
def test_a_two_process_zero2_run_resumes_bitwise(tmp_path, tiny_llama_dataset):
    """optim=muon under 2-process ZeRO-2 (gloo): DeepSpeed checkpoints Muon's momentum and the
    AdamW moments itself; stopped at step 2 and resumed in a new process, the run exports the
    same drafter as the unbroken one, bitwise."""
    common = ["target=tiny_llama", "optim=muon", "dist=zero2", "optim.clip_grad_norm=0",
              "optim.weight_decay=0.01", "train.deterministic=true", "data.eval_fraction=0",
              "train.max_steps=4"]
    a, b = tmp_path / "a", tmp_path / "b"
    r = run(a, tiny_llama_dataset, *common, "train.save_every=2", nproc=2)
    assert "optimizer: DeepSpeed MuonWithAuxAdam" in r.stderr
    assert [x["distributed_type"] for x in ranks(a)] == ["DEEPSPEED", "DEEPSPEED"]
    assert len(losses(a)) == 4
    step2 = a / "checkpoints" / "step-000002"
    r = run(b, tiny_llama_dataset, *common, f"train.resume={step2}", nproc=2)
    assert r.stderr.count(f"resumed from {step2} (step 2)") == 1, r.stderr[-3000:]
    assert "resumed with a changed setting" not in r.stderr
    assert len(losses(b)) == 2 and losses(b) == losses(a)[2:]
    ta, tb = _export_tensors(a), _export_tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 5
    for name in ta:
        assert torch.equal(ta[name], tb[name]), f"{name} differs after resume"


@pytest.mark.parametrize("override", ["optim.muon_momentum=1.0", "optim.muon_ns_steps=0",
                                      "optim.muon_lr=0", "optim.muon_weight_decay=-1"])
def test_bad_muon_values_are_refused(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        check(_compose(["optim=muon", override]))


def test_the_preset_composes_with_its_defaults():
    cfg = _compose(["optim=muon"])
    assert cfg.optim.name.value == "muon" and cfg.optim.muon_lr is None
    assert cfg.optim.muon_adjust_lr.value == "match_rms_adamw"
    assert _compose().optim.name.value == "adamw"
