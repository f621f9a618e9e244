"""Small real hidden-state datasets for trainer tests (built once per session)."""

import json
from pathlib import Path

import pytest
import torch

from eyas.data.store.shards import write_manifest, write_shard
from eyas.data.common.targets import default_aux_layer_ids, load_target, load_target_config
from eyas.data.produce.prompts import prompts_path

PROMPTS = prompts_path("default")

ANSWERS = [
    "The capital of France is Paris.",
    "Water boils at 100 degrees Celsius at sea level.",
    "A triangle has three sides and three angles.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The Earth orbits the Sun once every year.",
    "Python is a popular programming language.",
]


def build_hidden_dataset(out: Path, target: str, n: int, seed: int = 0) -> Path:
    """Chat-templated conversations run through the real target; aux/last/argmax captured."""
    # fp32 forward: bf16 matmuls are emulated on most CPUs; the stored states are bf16 anyway
    model, tok = load_target(target, dtype=torch.float32)
    cfg = load_target_config(target)
    ids = default_aux_layer_ids(cfg["num_hidden_layers"])
    prompts = [json.loads(line)["messages"] for line in PROMPTS.read_text().splitlines()[:n]]
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, msgs in enumerate(prompts):
        user = [m for m in msgs if m["role"] != "assistant"]
        answer = ANSWERS[int(torch.randint(len(ANSWERS), (1,), generator=g))]
        def encode(messages, **kw):
            text = tok.apply_chat_template(messages, tokenize=False, **kw)
            return tok(text, add_special_tokens=False)["input_ids"]

        prefix = encode(user, add_generation_prompt=True)
        full = encode(user + [{"role": "assistant", "content": answer}])
        x = torch.tensor(full[:160])
        mask = torch.zeros(len(x), dtype=torch.bool)
        mask[len(prefix):] = True
        with torch.no_grad():
            o = model(x[None], output_hidden_states=True)
        aux = torch.stack([o.hidden_states[k][0] for k in ids], dim=1)
        samples.append(dict(input_ids=x, loss_mask=mask, aux=aux, last=o.hidden_states[-1][0],
                            target_argmax=o.logits[0].float().argmax(-1)))
    metas = [write_shard(out, j, samples[j * 16:(j + 1) * 16]) for j in range((n + 15) // 16)]
    write_manifest(out, {"kind": "hidden", "target": target, "target_config": cfg,
                         "aux_layer_ids": ids, "convention": "hf_hidden_states",
                         "hidden_size": cfg["hidden_size"], "teacher": "last"}, metas)
    return out


@pytest.fixture(scope="session")
def smollm2_dataset(tmp_path_factory):
    return build_hidden_dataset(tmp_path_factory.mktemp("hs") / "smollm2", "smollm2", 48)


@pytest.fixture(scope="session")
def tiny_llama_dataset(tmp_path_factory):
    return build_hidden_dataset(tmp_path_factory.mktemp("hs") / "tiny", "tiny-llama", 24)


@pytest.fixture(scope="session")
def nan_dataset(tmp_path_factory, tiny_llama_dataset):
    """The tiny dataset with NaN aux states in every sample (written without the finite check)."""
    from eyas.data.store.dataset import open_dataset
    src = open_dataset(tiny_llama_dataset)
    out = tmp_path_factory.mktemp("hs") / "nan"
    samples = []
    for i in range(len(src)):
        s = {k: v.clone() for k, v in src[i].items()}
        s["aux"][:, 1] = float("nan")
        samples.append(s)
    metas = [write_shard(out, 0, samples, check_finite=False)]
    write_manifest(out, dict(src.manifest), metas)
    return out


@pytest.fixture
def preset_hub_cache(hub_cache):
    """An offline HF cache holding, for each config-only preset's hub id, its config.json, a
    safetensors index naming two shards, and (a stub of) the one with the embedding and the
    lm_head: what the config check of a training-only job asks for, as a partial download of
    a large model leaves it (the other shard, the decoder layers, is absent)."""
    from eyas.data.common.targets import HUB_IDS
    for preset, repo in HUB_IDS.items():
        index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "s1.safetensors",
                                                "lm_head.weight": "s1.safetensors",
                                                "model.layers.0.mlp.up_proj.weight":
                                                    "s2.safetensors"}}
        hub_cache(repo, {"config.json": json.dumps(load_target_config(preset)).encode(),
                         "model.safetensors.index.json": json.dumps(index).encode(),
                         "s1.safetensors": b"stub"})
    return hub_cache
