"""data.stream: batches read while the producer captures equal the batches of the extracted
dataset, keep=all leaves exactly what `eyas extract` writes, keep=none stays within its bound."""

import json
import threading

import pytest
import torch

from eyas.data.produce.extract import extract
from eyas.data.produce.prepare import prepare
from eyas.data.produce.stream import SPOOL, open_stream
from eyas.data.common.targets import load_target, load_tokenizer
from eyas.data.store.loader import PackedLoader, split_indices
from eyas.data.store.shards import open_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET = "tiny-llama"
SHARD_BYTES = 60_000        # a few samples per shard: shards complete at different times


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    src = root / "conv.jsonl"
    with open(src, "w") as f:
        for i in range(24):
            msgs = [{"role": "user", "content": f"Question {i}: " + "why? " * (i % 5)},
                    {"role": "assistant", "content": "Because. " * (1 + i % 7)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    prepare(src, "smollm2", root / "tokens", tokenizer=load_tokenizer("smollm2"))
    return root / "tokens"


@pytest.fixture(scope="module")
def model():
    return load_target(TARGET)[0]


def _loaders(ds, seed=3, rank=0, world=1):
    train_idx, eval_idx = split_indices(len(ds), 0.15, seed)
    train = PackedLoader(ds, 96, rank, world, seed, num_workers=2, indices=train_idx)
    held = PackedLoader(ds, 96, rank, world, seed, shuffle=False, num_workers=1,
                        indices=eval_idx)
    return train, held


def _same(a, b) -> None:
    assert a.num_tokens == b.num_tokens
    for name in ("input_ids", "loss_mask", "doc_ids", "positions", "aux", "last",
                 "target_argmax", "topk_ids", "topk_logits"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        assert x is None or torch.equal(x, y), name


def _stream(tokens_dir, out, model, **kw):
    return open_stream(tokens_dir, TARGET, out, capture="hf", model=model, dtype="float32",
                       shard_bytes=SHARD_BYTES, **kw)


@pytest.mark.parametrize("teacher,aux_format", [("last", "bf16"), ("both", "fp8")])
def test_keep_all_reads_and_writes_what_extract_does(tmp_path, tokens_dir, model, teacher,
                                                     aux_format):
    ref = tmp_path / "extracted"
    extract(tokens_dir, TARGET, ref, model=model, teacher=teacher, topk=4,
            aux_format=aux_format, shard_bytes=SHARD_BYTES)
    s = _stream(tokens_dir, tmp_path / "streamed", model, keep="all", ahead=5,
                spool_bytes=1 << 30, teacher=teacher, topk=4, aux_format=aux_format)
    try:
        train, held = _loaders(s.dataset)
        s.attach(train, held)
        want_train, want_held = _loaders(open_dataset(ref))
        for epoch in range(2):
            for a, b in zip(train, want_train, strict=True):
                _same(a, b)
            for a, b in zip(held, want_held, strict=True):
                _same(a, b)
        s.producer.join(timeout=120)
        assert not s.producer.is_alive() and s.dataset.error is None
    finally:
        s.close()
    out = tmp_path / "streamed"
    assert json.loads((out / "manifest.json").read_text()) == \
        json.loads((ref / "manifest.json").read_text())
    files = sorted(p.name for p in ref.glob("*.safetensors"))
    assert files == sorted(p.name for p in out.glob("*.safetensors")) and len(files) > 4
    for name in files:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert not list((out / SPOOL).glob("sample-*"))


@pytest.mark.parametrize("ahead", [4, 30])
def test_keep_none_recaptures_every_epoch_within_its_bound(tmp_path, tokens_dir, model, ahead):
    """ahead=30, 1.5 epochs: the producer runs into the next epoch, so a sample's file is due twice
    (the end of one epoch, the start of the next) before the loader reads it once."""
    ref = tmp_path / "extracted"
    extract(tokens_dir, TARGET, ref, model=model, shard_bytes=SHARD_BYTES)
    spool = tmp_path / "spool"
    s = _stream(tokens_dir, spool, model, keep="none", ahead=ahead, spool_bytes=1 << 30)
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(list(spool.glob("sample-*"))))
            done.wait(0.002)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        train, held = _loaders(s.dataset)
        s.attach(train, held)
        want_train, want_held = _loaders(open_dataset(ref))
        captured = []

        def three_epochs():
            for epoch in range(3):
                for a, b in zip(train, want_train, strict=True):
                    _same(a, b)
                for a, b in zip(held, want_held, strict=True):
                    _same(a, b)
                captured.append(s.producer.captured)
        reader = threading.Thread(target=three_epochs, daemon=True)
        reader.start()
        reader.join(timeout=180)                # a reader waiting on a sample never captured
        assert not reader.is_alive(), "the loader waits for a sample the producer passed"
        assert len(captured) == 3               # (the reader's own failure is raised below)
    finally:
        done.set()
        watcher.join()
        s.close()
    n_held = len(held.indices)
    per_epoch = len(train.indices)
    if ahead < per_epoch:
        # every epoch captured again: at least one more epoch's samples each time
        assert captured[2] - captured[0] >= 2 * per_epoch - 4
        # the held-out samples stay, the training samples go once read; never more than
        # `ahead` training samples (plus the chunk in flight and sample 0) waited in the spool
        assert peak[0] <= n_held + ahead + 2
    else:
        # far ahead: a file read again in the next epoch stays until its last read is done
        assert peak[0] <= n_held + per_epoch + 1
    assert not (spool / "manifest.json").exists()


def test_a_dead_producer_is_the_readers_error(tmp_path, tokens_dir, model):
    s = _stream(tokens_dir, tmp_path / "spool", model, keep="none", ahead=4,
                spool_bytes=1 << 30)

    def broken(indices):
        raise RuntimeError("the target went away")
    try:
        train, held = _loaders(s.dataset)
        s.attach(train, held)
        s.capturer.capture = broken
        with pytest.raises(RuntimeError, match="the target went away"):
            for _ in train:
                pass
    finally:
        s.close()


def test_a_spool_or_dataset_that_cannot_fit_is_refused_before_capturing(tmp_path, tokens_dir,
                                                                       model):
    from eyas.data.common.space import DiskFullError
    with pytest.raises(DiskFullError, match=r"data.stream.spool_bytes.*needs .* free there"):
        _stream(tokens_dir, tmp_path / "spool", model, keep="none", ahead=4,
                spool_bytes=1 << 62)
    assert not list((tmp_path / "spool").glob("sample-*"))
