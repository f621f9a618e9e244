"""Targets named by a hub id, resolved from an HF cache laid out on disk (no network)."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.data.common import hub
from eyas.data.common.targets import (load_embedding_and_head, load_target, load_target_config,
                               load_tokenizer, resolve_target, weights_error)


@pytest.fixture(scope="module")
def tiny_files():
    """The tiny-llama preset's saved files (config, weights, tokenizer)."""
    d = resolve_target("tiny-llama")
    return {p.name: p for p in d.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def tiny_sharded(tmp_path_factory, tiny_files):
    """tiny-llama saved in several safetensors shards with an index."""
    from transformers import AutoModelForCausalLM
    out = tmp_path_factory.mktemp("sharded")
    model = AutoModelForCausalLM.from_pretrained(resolve_target("tiny-llama"))
    model.save_pretrained(out, max_shard_size="2MB")
    return {p.name: p for p in out.iterdir() if p.is_file()}


def test_parse_hub_id():
    assert hub.parse_hub_id("meta-llama/Llama-3.1-8B-Instruct") == (
        "meta-llama/Llama-3.1-8B-Instruct", None)
    assert hub.parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    for not_an_id in ("tiny-llama", "/abs/dir", "a/b/c", "org/", "./x"):
        assert hub.parse_hub_id(not_an_id) is None, not_an_id


def test_an_existing_directory_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.parse_hub_id("org/name") is None


def test_hub_id_resolves_from_the_cache_offline(hub_cache, tiny_files):
    snap = hub_cache("acme/tiny-llama", tiny_files)
    assert resolve_target("acme/tiny-llama") == snap
    assert load_target_config("acme/tiny-llama") == json.loads(
        tiny_files["config.json"].read_bytes())
    assert load_tokenizer("acme/tiny-llama")("hello").input_ids == \
        load_tokenizer("tiny-llama")("hello").input_ids
    model, _ = load_target("acme/tiny-llama", dtype=torch.float32)
    ref, _ = load_target("tiny-llama", dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)
    assert weights_error("acme/tiny-llama", "model") is None


def test_revision_selects_its_ref(hub_cache, tiny_files):
    cfg = json.loads(tiny_files["config.json"].read_bytes())
    cfg["num_hidden_layers"] = 9
    hub_cache("acme/tiny-llama", tiny_files)
    hub_cache("acme/tiny-llama", {**tiny_files, "config.json": json.dumps(cfg).encode()},
              revision="v2")
    assert load_target_config("acme/tiny-llama")["num_hidden_layers"] == 8
    assert load_target_config("acme/tiny-llama@v2")["num_hidden_layers"] == 9


def test_embedding_and_head_need_only_their_shards(hub_cache, tiny_sharded):
    index = json.loads(tiny_sharded["model.safetensors.index.json"].read_bytes())["weight_map"]
    keep = {f for k, f in index.items() if k.endswith(("embed_tokens.weight", "lm_head.weight"))}
    assert len(set(index.values())) > len(keep)    # some shards hold neither
    files = {n: p for n, p in tiny_sharded.items()
             if not n.endswith(".safetensors") or n in keep}
    hub_cache("acme/sharded", files)
    embed, head = load_embedding_and_head("acme/sharded")
    ref_embed, ref_head = load_embedding_and_head("tiny-llama")
    assert torch.equal(embed, ref_embed) and torch.equal(head, ref_head)


def test_a_missing_id_fails_in_one_line(hub_cache):
    for call in (resolve_target, load_target_config, load_embedding_and_head, load_tokenizer):
        with pytest.raises(hub.HubError) as e:
            call("acme/absent")
        msg = str(e.value)
        assert "\n" not in msg, msg
        assert "'acme/absent'" in msg and "offline" in msg and "HF_HUB_OFFLINE" in msg
        assert "HF_HOME" in msg and "local model directory" in msg
        assert str(hub_cache.root) in msg


def test_weights_error_names_what_is_missing(hub_cache, tiny_files, tmp_path):
    hub_cache("acme/config-only", {"config.json": tiny_files["config.json"]})
    assert weights_error("acme/config-only", "config") is None
    assert "offline" in weights_error("acme/config-only", "embedding")
    assert "offline" in weights_error("acme/absent", "model")
    assert "config-only preset" in weights_error("llama-3.1-8b", "embedding")
    assert "meta-llama/Llama-3.1-8B-Instruct" in weights_error("llama-3.1-8b", "model")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_bytes(tiny_files["config.json"].read_bytes())
    assert "no *.safetensors" in weights_error(str(tmp_path / "m"), "embedding")
    assert "no config.json" in weights_error(str(tmp_path / "nowhere"), "model")
    assert weights_error("tiny-llama", "model") is None
