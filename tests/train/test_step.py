"""train.step: the host-held embedding gives the training forward exactly what the drafter's own
lookup gives, and stays out of the module's parameters, buffers and checkpoints."""

from dataclasses import replace

import pytest
import torch

from eyas.data.store.loader import Batch
from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.data.store.packing import embedding_ids
from eyas.models.ttt import step_tokens
from eyas.train.config import LossConfig
from eyas.train.step import TrainingModule, to_device


def test_embedding_ids_hold_every_steps_tokens_as_a_slice():
    ids = torch.tensor([5, 6, 7, 8, 9])
    ext = embedding_ids(ids, 3)
    for k in range(3):
        assert torch.equal(ext[1 + k:1 + k + 5], step_tokens(ids, k))


def _module(host: bool):
    cfg = Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=256,
                                   aux_layer_ids=[2, 4, 5], ttt_steps=3)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="eager", compile_flex=False)
    d.embed_tokens.weight.data.normal_()
    head = torch.randn(256, cfg.target_hidden_size)
    return TrainingModule(d, head, LossConfig(), loss_impl="torch", host_embedding=host), cfg


def _batch(cfg, T=24):
    g = torch.Generator().manual_seed(3)
    tH = cfg.target_hidden_size
    return Batch(input_ids=torch.randint(0, cfg.vocab_size, (T,), generator=g),
                 loss_mask=torch.ones(T, dtype=torch.bool),
                 doc_ids=torch.tensor([0] * 15 + [1] * 9, dtype=torch.int32),
                 positions=torch.cat([torch.arange(15), torch.arange(9)]),
                 aux=torch.randn(T, 3 * tH, generator=g), last=torch.randn(T, tH, generator=g),
                 target_argmax=torch.randint(0, 256, (T,), generator=g), num_tokens=T)


def test_host_embedding_trains_the_same_and_is_not_module_state():
    plain, cfg = _module(False)
    host, _ = _module(True)
    assert host.drafter.embed_tokens is None and host.host_embedding is not None
    assert not any("embed_tokens" in k for k in host.state_dict())
    assert host.state_dict().keys() == {k for k in plain.state_dict() if "embed_tokens" not in k}
    host.to(torch.float64)                        # moving the module leaves the table alone
    assert host.host_embedding.dtype == torch.float32
    host.to(torch.float32)
    batch = _batch(cfg)
    _, a_in = to_device(batch, "cpu", 3, skip_masked_rows=True)
    rows = host.host_embedding.index_select(0, embedding_ids(batch.input_ids, 3))
    _, b_in = to_device(replace(batch, embeds=rows), "cpu", 3, skip_masked_rows=True)
    assert a_in["embeds"] is None and b_in["embeds"].shape == (24 + 3, cfg.hidden_size)
    a, b = plain(**a_in), host(**b_in)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.draft_argmax, b.draft_argmax)
    a.loss.backward()
    b.loss.backward()
    theirs = dict(host.drafter.named_parameters())
    for name, p in plain.drafter.named_parameters():
        if name != "embed_tokens.weight":
            assert torch.equal(p.grad, theirs[name].grad), name
    try:
        host(**a_in)
    except ValueError as e:
        assert "embedding is held outside it" in str(e) and "embeds=" in str(e)
    else:
        raise AssertionError("a forward without embeds must fail on a host-embedding module")


@pytest.mark.gpu
def test_a_training_step_on_cuda_never_waits_for_the_gpu():
    """The trainer's step on CUDA (pinned batch sent with its loss rows, compiled flex
    attention, Triton loss, clip, fused MasterAdamW with a device skip flag) makes no
    synchronising call once its first step has compiled: the host can queue the next step."""
    from eyas.train.optim import MasterAdamW
    from eyas.train.update import poisoned
    cfg = Eagle3Config.from_target(load_target_config("tiny-llama"), draft_vocab_size=256,
                                   aux_layer_ids=[2, 4, 5], ttt_steps=3)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="flex", compile_flex=True).to("cuda", torch.bfloat16)
    head = torch.randn(256, cfg.target_hidden_size, device="cuda").bfloat16()
    module = TrainingModule(d, head, LossConfig(), loss_impl="triton")
    params = [p for p in module.parameters() if p.requires_grad]
    opt = MasterAdamW(params, lr=1e-4, impl="triton", compact=True)
    lens = [100, 120, 36]
    g = torch.Generator().manual_seed(3)
    T, tH = sum(lens), cfg.target_hidden_size
    batch = Batch(input_ids=torch.randint(0, cfg.vocab_size, (T,), generator=g),
                  loss_mask=torch.ones(T, dtype=torch.bool),
                  doc_ids=torch.cat([torch.full((n,), i, dtype=torch.int32)
                                     for i, n in enumerate(lens)]),
                  positions=torch.cat([torch.arange(n) for n in lens]),
                  aux=torch.randn(T, 3 * tH, generator=g).bfloat16(),
                  last=torch.randn(T, tH, generator=g).bfloat16(),
                  target_argmax=torch.randint(0, 256, (T,), generator=g),
                  num_tokens=T).pin_memory()       # as the loader leaves batches on CUDA

    def step():
        _, inputs = to_device(batch, "cuda", 3, skip_masked_rows=True)
        poisoned(module(**inputs).loss).backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step(skip=~torch.isfinite(norm))
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
