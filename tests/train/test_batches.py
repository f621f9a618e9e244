"""train.batches.DeviceBatches: the same batches with and without prefetching, and a resume
point that excludes the batch held ahead, across epoch boundaries."""

import pytest
import torch

from eyas.data.store.loader import PackedLoader
from eyas.data.store.shards import open_dataset, write_manifest, write_shard
from eyas.train.batches import DeviceBatches

from tests.train.test_epochs import _dataset


def _key(batch, inputs):
    rows = inputs["rows"]
    return (batch.input_ids[:batch.num_tokens].tolist(), batch.aux.float().sum().item(),
            None if rows is None else rows.tolist())


def _take(batches, n):
    return [_key(*next(batches)) for _ in range(n)]


@pytest.mark.parametrize("prefetch", [False, True])
def test_resume_at_every_step_continues_with_the_next_unused_batch(tmp_path, prefetch):
    ds = _dataset(tmp_path)
    loader = PackedLoader(ds, 64, 0, 1, seed=3, num_workers=0)
    per_epoch = len(loader)
    assert per_epoch >= 3
    total = 2 * per_epoch + 2                   # crosses two epoch boundaries
    want = _take(DeviceBatches(PackedLoader(ds, 64, 0, 1, seed=3, num_workers=0), "cpu", 2,
                               True, prefetch=False), total + 2)
    batches = DeviceBatches(loader, "cpu", 2, True, prefetch=prefetch)
    got = []
    for i in range(total):
        got.append(_key(*next(batches)))
        state = batches.state_dict()
        at = (state["epoch"], state["cursor"])  # the end of an epoch is the next one's start
        assert at in {divmod(i + 1, per_epoch), ((i + 1) // per_epoch - 1, per_epoch)}
        fresh = PackedLoader(ds, 64, 0, 1, seed=3, num_workers=1)
        fresh.load_state_dict(state)
        resumed = DeviceBatches(fresh, "cpu", 2, True, prefetch=prefetch)
        assert _take(resumed, 2) == want[i + 1:i + 3]
        resumed.close()
    assert got == want[:total]
    batches.close()


def test_wait_is_the_time_spent_in_the_loader(tmp_path):
    ds = _dataset(tmp_path)
    batches = DeviceBatches(PackedLoader(ds, 64, 0, 1, seed=3, num_workers=0), "cpu", 2, False,
                            prefetch=True)
    batch, inputs = next(batches)
    assert inputs["rows"] is None and batch.aux is inputs["aux"]
    first = batches.take_wait()
    assert first > 0 and batches.take_wait() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetched_cuda_batches_equal_in_line_copies(tmp_path):
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(1, 1000, (n,), generator=g),
                "loss_mask": torch.ones(n, dtype=torch.bool),
                "aux": torch.randn(n, 3, 256, generator=g).bfloat16(),
                "last": torch.randn(n, 256, generator=g).bfloat16(),
                "target_argmax": torch.randint(0, 1000, (n,), generator=g)}
               for n in range(200, 600, 7)]
    write_manifest(tmp_path, {"kind": "hidden"}, [write_shard(tmp_path, 0, samples)])
    ds = open_dataset(tmp_path)
    out = {}
    for prefetch in (False, True):
        loader = PackedLoader(ds, 2048, 0, 1, seed=1, num_workers=2, pin_memory=True)
        batches = DeviceBatches(loader, "cuda", 3, True, prefetch=prefetch)
        keys = []
        for _ in range(2 * len(loader)):
            batch, inputs = next(batches)
            aux = batch.aux * 2                  # used on the compute stream, as a step would
            assert batch.aux.is_cuda and inputs["rows"].is_cuda
            keys.append((aux.float().sum().item(), inputs["rows"].sum().item()))
        batches.close()
        out[prefetch] = keys
    assert out[True] == out[False]
