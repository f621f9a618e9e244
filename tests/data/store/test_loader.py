"""PackedLoader: exact packing, rank sharding (in-process and 2 real processes), resume."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from eyas.data.store.loader import Batch, PackedLoader, split_indices
from eyas.data.store.packing import build_plan
from eyas.data.store.shards import open_dataset, write_manifest, write_shard

TH = 8  # target hidden (real: 4096)
REPO = Path(__file__).resolve().parents[3]


def make_dataset(root, shard_lengths, *, aux_format="bf16", seed=0, tokens_only=False):
    gen = torch.Generator().manual_seed(seed)
    samples, metas = [], []
    for s, lengths in enumerate(shard_lengths):
        ss = []
        for T in lengths:
            x = {"input_ids": torch.randint(1, 1000, (T,), generator=gen),
                 "loss_mask": torch.rand(T, generator=gen) > 0.3}
            if not tokens_only:
                x["aux"] = torch.randn(T, 3, TH, generator=gen).bfloat16()
                x["last"] = torch.randn(T, TH, generator=gen).bfloat16()
                x["target_argmax"] = torch.randint(0, 1000, (T,), generator=gen)
            ss.append(x)
        metas.append(write_shard(root, s, ss, aux_format=aux_format))
        samples += ss
    write_manifest(root, {"kind": "tokens" if tokens_only else "hidden"}, metas)
    return open_dataset(root), samples


def check_batch(b: Batch, docs, ds, T):
    """Every document of `b` equals the dataset sample (first T tokens), padding is exact."""
    pos = 0
    for d, i in enumerate(docs):
        ref = ds[i]
        n = min(len(ref["input_ids"]), T - pos)
        sl = slice(pos, pos + n)
        assert (b.doc_ids[sl] == d).all() and torch.equal(b.positions[sl], torch.arange(n))
        assert torch.equal(b.input_ids[sl], ref["input_ids"][:n])
        assert torch.equal(b.loss_mask[sl], ref["loss_mask"][:n])
        if b.aux is not None:
            assert torch.equal(b.aux[sl], ref["aux"][:n].reshape(n, -1))
            assert torch.equal(b.last[sl], ref["last"][:n])
            assert torch.equal(b.target_argmax[sl], ref["target_argmax"][:n])
        pos += n
    assert b.num_tokens == pos
    assert (b.doc_ids[pos:] == -1).all() and not b.input_ids[pos:].any()
    assert not b.loss_mask[pos:].any() and not b.positions[pos:].any()
    if b.aux is not None:
        assert not b.aux[pos:].any()


def test_hand_packing_exact(tmp_path):
    ds, samples = make_dataset(tmp_path, [[3, 2, 4]])
    loader = PackedLoader(ds, 6, 0, 1, seed=0, shuffle=False, num_workers=0)
    # best-fit decreasing: 4 -> bin0 (2 left), 3 -> bin1 (3 left), 2 -> bin0 (fits exactly)
    assert loader.plan() == [[2, 1], [0]]
    b0, b1 = list(loader)
    assert b0.doc_ids.tolist() == [0, 0, 0, 0, 1, 1]
    assert b0.positions.tolist() == [0, 1, 2, 3, 0, 1]
    assert b1.doc_ids.tolist() == [0, 0, 0, -1, -1, -1]
    assert b1.positions.tolist() == [0, 1, 2, 0, 0, 0]
    assert b0.input_ids.tolist() == (samples[2]["input_ids"].tolist()
                                     + samples[1]["input_ids"].tolist())
    assert b1.input_ids.tolist()[3:] == [0, 0, 0] and b1.num_tokens == 3
    assert b0.aux.shape == (6, 3 * TH) and b0.aux.dtype == torch.bfloat16
    assert b0.doc_ids.dtype == torch.int32 and b0.positions.dtype == torch.int64
    check_batch(b0, [2, 1], ds, 6)
    check_batch(b1, [0], ds, 6)


def test_truncation_counted_and_logged(tmp_path, caplog):
    ds, samples = make_dataset(tmp_path, [[3, 11, 2]])
    loader = PackedLoader(ds, 8, 0, 1, seed=0, shuffle=False, num_workers=0)
    with caplog.at_level("WARNING"):
        batches = list(loader)
    assert loader.stats.truncated == 1 and "1 sample(s) longer than token_budget=8" in caplog.text
    plan = loader.plan(0)
    b = batches[[k for k, docs in enumerate(plan) if 1 in docs][0]]
    assert plan[[k for k, docs in enumerate(plan) if 1 in docs][0]] == [1]
    assert b.num_tokens == 8 and torch.equal(b.aux, samples[1]["aux"][:8].reshape(8, -1))
    assert sorted(i for docs in plan for i in docs) == [0, 1, 2]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_batches_match_dataset(tmp_path, fmt):
    ds, _ = make_dataset(tmp_path, [[5, 17, 9, 30], [12, 1, 25]], aux_format=fmt)
    loader = PackedLoader(ds, 32, 0, 1, seed=3, num_workers=2)
    plan, batches = loader.plan(0), list(loader)
    assert len(batches) == len(plan) > 1
    assert sorted(i for docs in plan for i in docs) == list(range(len(ds)))  # each sample once
    for b, docs in zip(batches, plan, strict=True):
        check_batch(b, docs, ds, 32)


def test_tokens_dataset_batches(tmp_path):
    ds, _ = make_dataset(tmp_path, [[4, 6, 5]], tokens_only=True)
    loader = PackedLoader(ds, 16, 0, 1, seed=0)
    plan, batches = loader.plan(0), list(loader)
    assert len(batches) == len(plan) == 1             # 4 + 6 + 5 tokens fit one budget of 16
    assert sorted(i for docs in plan for i in docs) == list(range(len(ds)))  # each sample once
    for b, docs in zip(batches, plan, strict=True):
        assert b.aux is None and b.last is None and b.target_argmax is None
        check_batch(b, docs, ds, 16)
    with pytest.raises(ValueError, match="no field"):
        PackedLoader(ds, 16, 0, 1, seed=0, load_fields=["aux"])


def _rank_coverage(ds, W, **kw):
    per_rank = [PackedLoader(ds, 40, r, W, seed=11, **kw).plan(0) for r in range(W)]
    counts = [len(p) for p in per_rank]
    flat = [i for p in per_rank for docs in p for i in docs]
    return per_rank, counts, flat


@pytest.mark.parametrize("W", [2, 3, 4])
def test_ranks_disjoint_complete_equal(tmp_path, W):
    rng = np.random.default_rng(0)
    ds, _ = make_dataset(tmp_path, [rng.integers(1, 40, 13).tolist() for _ in range(3)])
    per_rank, counts, flat = _rank_coverage(ds, W)
    assert len(set(counts)) == 1, counts                       # same number of batches
    assert sorted(flat) == list(range(len(ds)))                # disjoint and complete
    assert per_rank == _rank_coverage(ds, W)[0]                # deterministic
    # drop_last: equal counts, disjoint, and only the dropped samples are missing
    per_rank, counts, flat = _rank_coverage(ds, W, drop_last=True)
    loader = PackedLoader(ds, 40, 0, W, seed=11, drop_last=True)
    assert len(set(counts)) == 1 and len(flat) == len(set(flat))
    assert len(ds) - len(flat) == loader.stats.dropped


def test_tail_padding_batches_when_too_few_samples(tmp_path):
    ds, _ = make_dataset(tmp_path, [[5, 6, 7]])
    # 3 samples of 5-7 tokens, budget 8: 3 single-doc bins, 4 ranks -> one all-padding batch
    plans = [PackedLoader(ds, 8, r, 4, seed=0).plan(0) for r in range(4)]
    assert [len(p) for p in plans] == [1, 1, 1, 1]
    assert sorted(i for p in plans for docs in p for i in docs) == [0, 1, 2]
    empty_rank = [r for r, p in enumerate(plans) if p == [[]]]
    assert len(empty_rank) == 1
    b = next(iter(PackedLoader(ds, 8, empty_rank[0], 4, seed=0)))
    assert b.num_tokens == 0 and (b.doc_ids == -1).all()


def test_epoch_changes_order_seed_fixes_it(tmp_path):
    ds, _ = make_dataset(tmp_path, [list(range(1, 30))])
    a = PackedLoader(ds, 64, 0, 1, seed=5)
    assert a.plan(0) == PackedLoader(ds, 64, 0, 1, seed=5).plan(0)
    assert a.plan(0) != a.plan(1)
    assert a.plan(0) != PackedLoader(ds, 64, 0, 1, seed=6).plan(0)
    assert a.stats.fill > 0.9   # best-fit packing keeps padding low


def _digest(b: Batch):
    return [b.num_tokens, int(b.input_ids.sum()), float(b.aux.float().sum()),
            b.doc_ids.tolist()]


def test_exact_resume_mid_epoch_and_across(tmp_path):
    ds, _ = make_dataset(tmp_path, [list(range(3, 40, 2))])

    def make(workers):
        return PackedLoader(ds, 48, 1, 2, seed=7, num_workers=workers)

    ref = make(2)
    full = [_digest(b) for b in ref] + [_digest(b) for b in ref]   # epochs 0 and 1
    n0 = len(ref.plan(0))
    assert ref.epoch == 2 and len(full) == n0 + len(ref.plan(1))
    for stop in (0, 2, n0, n0 + 1):
        a, got = make(2), []
        while len(got) < stop:                                     # stop mid-iteration
            for b in a:
                got.append(_digest(b))
                if len(got) == stop:
                    break
        state = json.loads(json.dumps(a.state_dict()))             # survives JSON
        resumed, rest = make(0), []
        resumed.load_state_dict(state)
        while resumed.epoch < 2:
            rest += [_digest(b) for b in resumed]
        assert got + rest == full, stop
    with pytest.raises(ValueError, match="seed=7 but this loader has 8"):
        PackedLoader(ds, 48, 1, 2, seed=8).load_state_dict(state)


def test_workers_do_not_change_batches(tmp_path):
    ds, _ = make_dataset(tmp_path, [list(range(1, 25))])
    a = [_digest(b) for b in PackedLoader(ds, 50, 0, 1, seed=1, num_workers=0)]
    b = [_digest(b) for b in PackedLoader(ds, 50, 0, 1, seed=1, num_workers=3, prefetch=1)]
    assert a == b


_WORKER = textwrap.dedent("""
    import json, sys
    from eyas.data.store.shards import open_dataset
    from eyas.data.store.loader import PackedLoader
    root, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    loader = PackedLoader(open_dataset(root), 40, rank, 2, seed=11, num_workers=2)
    rows = [[b.num_tokens, int(b.input_ids.sum()), float(b.aux.float().sum())] for b in loader]
    json.dump({"plan": loader.plan(0), "rows": rows}, open(out, "w"))
""")


def test_two_real_processes(tmp_path):
    rng = np.random.default_rng(1)
    ds, _ = make_dataset(tmp_path / "ds", [rng.integers(1, 40, 15).tolist() for _ in range(2)])
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / "ds"), str(r),
                               str(tmp_path / f"r{r}.json")], cwd=REPO) for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    res = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    assert len(res[0]["rows"]) == len(res[1]["rows"])
    flat = [i for r in res for docs in r["plan"] for i in docs]
    assert sorted(flat) == list(range(len(ds)))
    for r in range(2):   # the same batches as an in-process loader of that rank
        local = PackedLoader(ds, 40, r, 2, seed=11, num_workers=0)
        assert res[r]["plan"] == local.plan(0)
        rows = [[b.num_tokens, int(b.input_ids.sum()), float(b.aux.float().sum())] for b in local]
        assert res[r]["rows"] == rows


def test_split_indices():
    tr, ev = split_indices(103, 0.1, seed=4)
    assert len(ev) == 10 and len(tr) == 93
    assert sorted(np.concatenate([tr, ev]).tolist()) == list(range(103))
    tr2, ev2 = split_indices(103, 0.1, seed=4)
    assert np.array_equal(ev, ev2) and not np.array_equal(ev, split_indices(103, 0.1, 5)[1])
    assert len(split_indices(5, 0.01, 0)[1]) == 1 and len(split_indices(2, 0.9, 0)[0]) == 1
    assert len(split_indices(10, 0.0, 0)[1]) == 0
    with pytest.raises(ValueError, match=r"eval_fraction must be in \[0, 1\), got 1\.0"):
        split_indices(10, 1.0, 0)


def test_indices_restrict_loader(tmp_path):
    ds, _ = make_dataset(tmp_path, [list(range(1, 21))])
    tr, ev = split_indices(len(ds), 0.25, seed=0)
    seen = {i for docs in PackedLoader(ds, 32, 0, 1, 0, indices=ev).plan(0) for i in docs}
    assert seen == set(ev.tolist())


def test_batch_to_and_plan_function():
    b = Batch(input_ids=torch.zeros(4, dtype=torch.int64),
              loss_mask=torch.zeros(4, dtype=torch.bool),
              doc_ids=torch.full((4,), -1, dtype=torch.int32),
              positions=torch.zeros(4, dtype=torch.int64), num_tokens=0)
    c = b.to("cpu")
    assert c.aux is None and torch.equal(c.doc_ids, b.doc_ids) and c.num_tokens == 0
    if torch.cuda.is_available():
        assert b.pin_memory().input_ids.is_pinned()
    bins, stats = build_plan(np.array([5, 5, 5]), np.arange(3), 10, 1, 0, 0, shuffle=False)
    assert bins == [[0, 1], [2]] and stats.fill == 15 / 20


def test_buffer_reuse_never_overwrites_held_batches(tmp_path):
    ds, _ = make_dataset(tmp_path, [list(range(4, 30))])
    loader = PackedLoader(ds, 32, 0, 1, seed=0, num_workers=2)
    kept = list(loader)                           # all alive at once: all distinct memory
    assert len({b.aux.data_ptr() for b in kept}) == len(kept) > 6
    for b, docs in zip(kept, loader.plan(0)):
        check_batch(b, docs, ds, 32)
    # dropped batches are refilled in place; a view the caller keeps pins its batch's memory
    loader = PackedLoader(ds, 32, 0, 1, seed=0, num_workers=0)
    ptrs, first_slice, ref = set(), None, None
    for k, (b, docs) in enumerate(zip(loader, loader.plan(0))):
        ptrs.add(b.aux.data_ptr())
        check_batch(b, docs, ds, 32)
        if k == 0:
            first_slice, ref = b.aux[:5], b.aux[:5].clone()
    assert len(ptrs) <= 4 < len(loader.plan(0))   # a few slabs cycle, not one per batch
    assert torch.equal(first_slice, ref)


@pytest.mark.parametrize("workers", [0, 2])
def test_attached_embedding_fills_each_batchs_rows(tmp_path, workers):
    from eyas.data.store.packing import embedding_ids
    ds, _ = make_dataset(tmp_path / "ds", [[5, 9, 3], [7, 11]])
    table = torch.randn(1000, 8).bfloat16()                     # ids are drawn below 1000
    loader = PackedLoader(ds, 16, 0, 1, seed=0, num_workers=workers)
    loader.attach_embedding(table, ttt_steps=3)
    batches = list(loader)
    assert batches
    for b in batches:
        assert b.embeds.shape == (16 + 3, 8) and b.embeds.dtype == torch.bfloat16
        assert torch.equal(b.embeds, table[embedding_ids(b.input_ids, 3)])
    with pytest.raises(ValueError, match=r"attach_embedding needs a \[V, H\] host tensor"):
        loader.attach_embedding(torch.zeros(4), 3)
