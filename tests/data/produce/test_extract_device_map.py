"""data.produce.extract with a device map: the loading path large targets take (`--device-map`,
`--max-memory`) stores the same states as a target loaded whole; split across a GPU and the CPU
(needs a GPU) the stored states match a one-device capture within bf16 rounding."""

import json

import pytest
import torch

from eyas.data.common.capture import ExtractError
from eyas.data.produce.extract import extract, parse_max_memory
from eyas.data.produce.prepare import prepare
from eyas.data.store.shards import open_dataset
from eyas.data.common.targets import load_tokenizer
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "extract")

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "tiny-deepseek-v3"


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    src = root / "conv.jsonl"
    with open(src, "w") as f:
        for q, a in [("Name a fruit.", "Apple."), ("What is 2+2?", "Four, of course."),
                     ("Hi", "Hello! How can I help you today?")]:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    prepare(src, NAME, root / "ds", tokenizer=load_tokenizer(NAME))
    return root / "ds"


def _same(a, b, atol=0.0):
    da, db = open_dataset(a), open_dataset(b)
    assert len(da) == len(db) > 0
    worst = 0.0
    for i in range(len(da)):
        sa, sb = da[i], db[i]
        assert sa["input_ids"].equal(sb["input_ids"])
        for f in ("aux", "last"):
            worst = max(worst, (sa[f].float() - sb[f].float()).abs().max().item())
    assert worst <= atol, worst
    return worst


def test_device_map_load_stores_what_a_whole_load_stores(tmp_path, tokens_dir):
    extract(tokens_dir, NAME, tmp_path / "whole", device="cpu")
    rc = cli_main(["--tokens", str(tokens_dir), "--target", NAME, "--out", str(tmp_path / "map"),
                   "--device", "cpu", "--dtype", "bfloat16", "--device-map", "cpu",
                   "--max-memory", "cpu=4GiB"])
    assert rc == 0
    _same(tmp_path / "whole", tmp_path / "map")


def test_max_memory_parsing_and_its_error():
    assert parse_max_memory("0=60GiB, cpu=200GiB") == {0: "60GiB", "cpu": "200GiB"}
    assert parse_max_memory(None) is None
    with pytest.raises(ExtractError, match="DEVICE=SIZE"):
        parse_max_memory("60GiB")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_split_between_cpu_and_gpu_matches_one_device(tmp_path, tokens_dir):
    extract(tokens_dir, NAME, tmp_path / "gpu", device="cuda:0")
    split = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
             "model.layers.2": "cpu", "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0,
             **{f"model.layers.{i}": 0 for i in range(3, 8)}}
    extract(tokens_dir, NAME, tmp_path / "split", device_map=split)
    # the CPU layers round differently from the GPU's kernels: bf16 steps of the random model
    _same(tmp_path / "gpu", tmp_path / "split", atol=0.25)
