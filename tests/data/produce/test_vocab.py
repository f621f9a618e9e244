"""Draft vocabulary: selection rule, serving invariants, messages, files, special tokens."""

from functools import partial

import numpy as np
import pytest
import torch

from eyas.data.store.shards import open_dataset, write_manifest, write_shard
from eyas.data.produce.vocab import (build_vocab, count_tokens, load_vocab, save_vocab,
                             special_token_ids)
from eyas.data.store.vocab_map import VocabMap
from eyas.train.cli import call

cli_main = partial(call, "vocab")


def test_selection_ties_and_forced():
    # V = 8, Vd = 3 (real: V = 128256, Vd = 32000)
    counts = torch.tensor([5, 0, 3, 3, 1, 0, 0, 9])
    d2t, t2d = build_vocab(counts, size=3)
    # 7 (9), 0 (5), then the tie 2 vs 3 (3 each) goes to the lower id
    assert t2d.nonzero().flatten().tolist() == [0, 2, 7]
    assert d2t.tolist() == [0, 1, 5] and d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    d2t, t2d = build_vocab(counts, size=4, force_ids=[6, 6])
    assert t2d.nonzero().flatten().tolist() == [0, 2, 6, 7]  # forced 6 in, 3 left out
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 6, 7]


def test_fill_with_unseen_ids_by_id_order():
    d2t, t2d = build_vocab({5: 2, 1: 7}, size=4, target_vocab_size=6)
    assert t2d.nonzero().flatten().tolist() == [0, 1, 2, 5]   # 1, 5 seen; 0, 2 fill
    assert t2d.sum() == 4 and len(d2t) == 4
    d2t, t2d = build_vocab(np.zeros(5), size=5)
    assert not d2t.any() and t2d.all()


def test_selection_errors():
    with pytest.raises(ValueError, match=r"draft vocab size 9 must be in \[1, V=8\]"):
        build_vocab(torch.ones(8), size=9)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        build_vocab(torch.ones(8), size=3, force_ids=[8])
    with pytest.raises(ValueError, match="3 forced ids do not fit"):
        build_vocab(torch.ones(8), size=2, force_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="target_vocab_size is required"):
        build_vocab({1: 2}, size=1)


@pytest.mark.parametrize("d2t, t2d, pattern", [
    (torch.tensor([0, 1, 5]), torch.tensor([1, 0, 1, 0, 0, 0, 0, 1], dtype=torch.bool), None),
    (torch.tensor([0, 2, 7]), torch.tensor([1, 0, 1, 0, 0, 0, 0, 1], dtype=torch.bool),
     "absolute target ids"),
    (torch.tensor([0, 1, 6]), torch.tensor([1, 0, 1, 0, 0, 0, 0, 1], dtype=torch.bool),
     r"d2t\[2\] = 6 maps draft row 2 to target id 8, outside \[0, 8\)"),
    (torch.tensor([0, 1, 0]), torch.tensor([1, 0, 1, 0, 0, 0, 0, 1], dtype=torch.bool),
     "not strictly increasing: row 1 -> 2, row 2 -> 2"),
    (torch.tensor([0, 1, 5]), torch.tensor([1, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool),
     "t2d selects 4 ids but d2t has Vd = 3"),
    (torch.tensor([0, 1, 4]), torch.tensor([1, 0, 1, 0, 0, 0, 0, 1], dtype=torch.bool),
     "draft row 2 maps to target id 6 but the 2-th id selected by t2d is 7"),
    (torch.tensor([0, 0, 0]), torch.tensor([1, 0, 1, 0, 0, 0, 0, 1], dtype=torch.bool),
     "all zeros"),
    (torch.tensor([0, 1, 5], dtype=torch.int32), torch.ones(8, dtype=torch.bool),
     "d2t must be an int64 tensor"),
    (torch.tensor([0, 1, 5]), torch.ones(8, dtype=torch.int64), "t2d must be a bool tensor"),
])
def test_validate_messages(d2t, t2d, pattern):
    if pattern is None:
        VocabMap(d2t, t2d).validate(target_vocab_size=8, draft_vocab_size=3)
        return
    with pytest.raises(ValueError, match=pattern):
        VocabMap(d2t, t2d).validate()


def test_validate_sizes():
    d2t, t2d = build_vocab(torch.arange(8), size=3)
    with pytest.raises(ValueError, match="target vocabulary has 9"):
        VocabMap(d2t, t2d).validate(target_vocab_size=9)
    with pytest.raises(ValueError, match="draft_vocab_size is 4"):
        VocabMap(d2t, t2d).validate(draft_vocab_size=4)


def test_save_load_round_trip(tmp_path):
    d2t, t2d = build_vocab(torch.arange(100) % 7, size=10)
    path = save_vocab(tmp_path / "v.safetensors", d2t, t2d)
    d2, t2 = load_vocab(path)
    assert torch.equal(d2, d2t) and torch.equal(t2, t2d)
    from safetensors.torch import save_file
    save_file({"d2t": d2t}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="needs tensors 'd2t' and 't2d'"):
        load_vocab(tmp_path / "bad.safetensors")
    save_file({"d2t": torch.zeros(10, dtype=torch.int64), "t2d": t2d},
              str(tmp_path / "z.safetensors"))
    with pytest.raises(ValueError, match="z.safetensors: d2t and t2d disagree"):
        load_vocab(tmp_path / "z.safetensors")
    with pytest.raises(ValueError, match=r"t2d selects 90 ids but d2t has Vd = 10 rows; they "
                                         r"must describe the same set"):
        save_vocab(tmp_path / "never.safetensors", d2t, ~t2d)
    assert not (tmp_path / "never.safetensors").exists()


def _count_dataset(root, argmax=None):
    # hand-made: 2 samples; V = 10
    ids = [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7])]
    mask = [torch.tensor([0, 1, 1, 1]), torch.tensor([1, 1, 0])]
    arg = argmax or [torch.tensor([9, 9, 8, 0]), torch.tensor([6, 7, 7])]
    ss = [{"input_ids": i, "loss_mask": m, "target_argmax": a,
           "aux": torch.zeros(len(i), 3, 4, dtype=torch.bfloat16)}
          for i, m, a in zip(ids, mask, arg)]
    write_manifest(root, {"kind": "hidden", "target_config": {"vocab_size": 10}},
                   [write_shard(root, 0, ss)])
    return open_dataset(root)


def test_count_modes_exact(tmp_path):
    ds = _count_dataset(tmp_path)
    c = count_tokens(ds, 10, "target_argmax")      # argmax where mask: 9, 8, 0 | 6, 7
    assert c.tolist() == [1, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    c = count_tokens(ds, 10, "next_token")         # ids[t+1] where mask[t]: 3, 4 | 6, 7
    assert c.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 0, 0]
    c = count_tokens(ds, 10, "masked_token")       # ids[t] where mask[t]: 2, 3, 4 | 5, 6
    assert c.tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    assert count_tokens(ds, 10).tolist() == count_tokens(ds, 10, "target_argmax").tolist()
    d2t, t2d = build_vocab(ds, size=5)             # V from the manifest's target_config
    assert t2d.nonzero().flatten().tolist() == [0, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="outside"):
        count_tokens(ds, 9, "target_argmax")


def test_counts_read_once_per_dataset_and_again_when_it_changes(tmp_path):
    ds = _count_dataset(tmp_path)
    first = count_tokens(ds, 10)
    first[0] = 99                                   # the caller's copy, not the remembered one

    def unread(*args):
        raise AssertionError("the dataset was read again")
    ds.sample = unread
    assert count_tokens(ds, 10).tolist() == [1, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(AssertionError, match="read again"):
        count_tokens(ds, 10, "next_token")          # another mode is counted anew
    # the same directory rewritten with samples of the same lengths and other argmax ids:
    # only the shards' checksums in the manifest differ, and the dataset is counted anew
    _count_dataset(tmp_path, argmax=[torch.tensor([4, 4, 4, 4]), torch.tensor([5, 5, 5])])
    assert count_tokens(open_dataset(tmp_path), 10).tolist() == [0, 0, 0, 0, 3, 2, 0, 0, 0, 0]


def test_cli(tmp_path, capsys):
    _count_dataset(tmp_path / "ds")
    out = tmp_path / "vocab.safetensors"
    assert cli_main(["--data", str(tmp_path / "ds"), "--size", "4", "--out", str(out),
                     "--force-ids", "1", "--count", "next_token"]) == 0
    d2t, t2d = load_vocab(out)
    assert t2d.nonzero().flatten().tolist() == [1, 3, 4, 6]
    assert "Vd=4 of V=10" in capsys.readouterr().out


def test_cli_v_from_target_config_not_tokenizer(tmp_path, capsys):
    # a tokens dataset of a target whose embedding (12 rows) is padded past its tokenizer (10)
    (tmp_path / "padded").mkdir()
    (tmp_path / "padded" / "config.json").write_text('{"vocab_size": 12}')
    ss = [{"input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([1, 1, 0])}]
    write_manifest(tmp_path / "tok", {"kind": "tokens", "target": str(tmp_path / "padded"),
                                      "tokenizer": {"vocab_size": 10}},
                   [write_shard(tmp_path / "tok", 0, ss)])
    out = tmp_path / "v.safetensors"
    args = ["--data", str(tmp_path / "tok"), "--size", "3", "--out", str(out), "--no-special"]
    assert cli_main(args) == 0
    d2t, t2d = load_vocab(out)
    assert t2d.numel() == 12 and t2d.nonzero().flatten().tolist() == [0, 2, 3]
    assert "Vd=3 of V=12" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"text_config": {"vocab_size": 16}}')
    assert cli_main(args + ["--target", str(tmp_path / "other")]) == 0
    assert load_vocab(out)[1].numel() == 16
    with pytest.raises(ValueError, match=r"cannot read the vocab_size of target '/nowhere' "
                                         r".*; pass --target-vocab-size V"):
        cli_main(args + ["--target", "/nowhere"])


def test_special_token_ids_smollm2():
    from eyas.data.common.targets import load_tokenizer
    tok = load_tokenizer("smollm2")
    ids = special_token_ids(tok)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert im_start in ids and im_end in ids and tok.eos_token_id in ids
    assert ids == sorted(set(ids)) and all(0 <= i < len(tok) for i in ids)
    d2t, t2d = build_vocab(torch.zeros(len(tok)), size=64, force_ids=ids)
    assert t2d[ids].all()


def test_vocab_map_from_d2t():
    vm = VocabMap.from_d2t(torch.tensor([0, 1, 4, 4]), 8)
    assert vm.t2d.dtype == torch.bool and vm.t2d.nonzero().flatten().tolist() == [0, 2, 6, 7]
    assert vm.validate(target_vocab_size=8, draft_vocab_size=4) is vm
    assert vm.target_ids.tolist() == [0, 2, 6, 7]
    assert (vm.draft_vocab_size, vm.vocab_size) == (4, 8)
    with pytest.raises(ValueError, match=r"leaves \[0, 8\)"):
        VocabMap.from_d2t(torch.tensor([0, 7]), 8)
