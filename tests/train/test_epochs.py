"""The loader alone owns the epoch: two passes of the trainer's loop use orders 0 and 1."""

import torch

from eyas.data.store.loader import PackedLoader
from eyas.data.store.shards import open_dataset, write_manifest, write_shard
from eyas.train.batches import one_pass


def _dataset(root, n=24):
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        T = 3 + i
        samples.append({"input_ids": torch.randint(1, 1000, (T,), generator=g),
                        "loss_mask": torch.ones(T, dtype=torch.bool),
                        "aux": torch.randn(T, 3, 4, generator=g).bfloat16(),
                        "last": torch.randn(T, 4, generator=g).bfloat16(),
                        "target_argmax": torch.randint(0, 1000, (T,), generator=g)})
    write_manifest(root, {"kind": "hidden"}, [write_shard(root, 0, samples)])
    return open_dataset(root)


def _ids(batches):
    return [b.input_ids[:b.num_tokens].tolist() for b in batches]


def test_two_epochs_use_orders_0_and_1(tmp_path):
    ds = _dataset(tmp_path)
    loader = PackedLoader(ds, 64, 0, 1, seed=3, num_workers=0)
    assert loader.plan(0) != loader.plan(1)
    seen = []
    for _ in range(2):                          # the trainer's loop: it only iterates
        seen += _ids(one_pass(loader))
    assert loader.epoch == 2
    want = []
    for epoch in (0, 1):
        ref = PackedLoader(ds, 64, 0, 1, seed=3, num_workers=0)
        ref.set_epoch(epoch)
        want += _ids(ref)
    assert seen == want
