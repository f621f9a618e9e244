"""optim=muon (train/muon.py): torch's Muon for the drafter's hidden matrices, AdamW for the rest,
as one optimizer that steps, saves and resumes exactly."""

import copy

import pytest
import torch

from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.train.config import ConfigError, OptimConfig, check
from eyas.train.muon import MuonAdamW
from eyas.train.optim import MasterAdamW, apply_optim_settings, build_optimizer, build_scheduler
from tests.train.test_config import _compose
from tests.train.test_trainer import _export_tensors, assert_resumed, losses, run

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


@pytest.mark.parametrize("dist", ["zero1", "zero2", "zero3"])
def test_muon_is_refused_under_deepspeed_zero_with_one_line(dist):
    with pytest.raises(ConfigError) as e:
        check(_compose(["optim=muon", f"dist={dist}"]))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("optim.name='muon': expected adamw under DeepSpeed")
    assert "1-D partitions" in msg and "Fix: dist=ddp" in msg


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


@pytest.mark.slow
def test_a_tiny_run_trains_and_resumes_bitwise(tmp_path, tiny_llama_dataset):
    common = ["target=tiny_llama", "optim=muon", "optim.weight_decay=0.01",
              "train.deterministic=true", "data.eval_fraction=0"]
    run(tmp_path / "a", tiny_llama_dataset, *common, "train.max_steps=4")
    assert len(losses(tmp_path / "a")) == 4
    assert "optimizer: torch Muon on 8 hidden matrices" in \
        (tmp_path / "a" / "train.log").read_text()
    b = tmp_path / "b"
    run(b, tiny_llama_dataset, *common, "train.max_steps=2", "train.save_every=1",
        "export.enabled=false")
    r = run(b, tiny_llama_dataset, *common, "train.max_steps=4", "train.save_every=1",
            "train.resume=latest")
    assert_resumed(r, b, 2)
    ta, tb = _export_tensors(tmp_path / "a"), _export_tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 5
    for name in ta:
        assert torch.equal(ta[name], tb[name]), f"{name} differs after resume"
    r = run(b, tiny_llama_dataset, "target=tiny_llama", "train.max_steps=5",
            "train.resume=latest", check=False)
    assert r.returncode != 0 and "optim.name: checkpoint 'muon', now 'adamw'" in r.stderr
