"""train.step: the host-held embedding gives the training forward exactly what the drafter's own
lookup gives, and stays out of the module's parameters, buffers and checkpoints."""

from dataclasses import replace

import torch

from eyas.data.loader import Batch
from eyas.data.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.ttt import embedding_ids, step_tokens
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
