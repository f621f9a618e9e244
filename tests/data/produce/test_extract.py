"""data.produce.extract: prepare -> extract -> read reproduces the target's own forward exactly.

References are plain transformers forwards of each sample alone:
`model(ids, output_hidden_states=True)`; HF's `hidden_states[k]` is the residual stream entering
decoder layer k and `hidden_states[-1]` is the final POST-norm state (checked below against the
text model's `last_hidden_state`), `logits` the full-vocabulary logits.
"""

import json
import os

import pytest
import torch
from torch import nn

from eyas.data.common.capture import ExtractError, check_aux_layers, chunked_argmax_topk, find_text_model
from eyas.data.produce.extract import extract, finalize
from eyas.data.produce.prepare import prepare
from eyas.data.store.shards import open_dataset, shard_name
from eyas.data.common.targets import load_target, load_tokenizer

CONVS = [
    [("Name a fruit.", "Apple.")],
    [("Name a fruit.", "Apple.")],          # same length as the previous: a batch of two
    [("What is 2+2?", "4."), ("And 3+3?", "6.")],
    [("Hi", "Hello! How can I help?")],
    [("Say something short.", "Short.")],
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    src = root / "conv.jsonl"
    with open(src, "w") as f:
        for turns in CONVS:
            msgs = [m for u, a in turns for m in ({"role": "user", "content": u},
                                                  {"role": "assistant", "content": a})]
            f.write(json.dumps({"messages": msgs}) + "\n")
    prepare(src, "smollm2", root / "ds", tokenizer=load_tokenizer("smollm2"), shard_samples=2)
    return root / "ds"


_MODELS = {}


def target(name):
    if name not in _MODELS:
        _MODELS[name] = load_target(name)[0]
    return _MODELS[name]


def reference(model, ids):
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


@pytest.mark.parametrize("name,teacher,n", [("smollm2", "last", 3), ("tiny-llama", "both", None),
                                            ("tiny-deepseek-v3", "both", None)])
def test_round_trip_is_bitwise_the_targets_forward(tmp_path, tokens_dir, name, teacher, n):
    model = target(name)
    summary = extract(tokens_dir, name, tmp_path / "hid", model=model, teacher=teacher, topk=4,
                      shard_tokens=70, vocab_chunk=10_000, row_chunk=16, max_samples=n)
    ds, toks = open_dataset(tmp_path / "hid"), open_dataset(tokens_dir)
    n_layers = model.config.num_hidden_layers
    aux_ids = [2, n_layers // 2, n_layers - 3]
    m = ds.manifest
    assert (m["kind"], m["aux_layer_ids"], m["convention"]) == ("hidden", aux_ids,
                                                                "hf_hidden_states")
    assert m["hidden_size"] == model.config.hidden_size and m["teacher"]["kind"] == teacher
    assert m["tokenizer"] == toks.manifest["tokenizer"]
    assert len(ds) == (n or len(CONVS)) and summary["shards"] == ds.num_shards > 1
    for i in range(len(ds)):
        s = ds[i]
        assert s["input_ids"].equal(toks[i]["input_ids"])
        assert s["loss_mask"].equal(toks[i]["loss_mask"])
        hs, logits = reference(model, s["input_ids"])
        assert s["aux"].dtype == torch.bfloat16
        for j, k in enumerate(aux_ids):
            assert torch.equal(s["aux"][:, j], hs[k]), (i, k)
        assert torch.equal(s["target_argmax"], logits.argmax(-1))
        if teacher != "topk":
            assert torch.equal(s["last"], hs[-1])
        if teacher != "last":
            assert torch.equal(s["topk_ids"][:, 0], logits.argmax(-1))
            assert torch.equal(s["topk_logits"], logits.float().topk(4, dim=-1).values)
    if name == "tiny-llama":   # HF's hidden_states[-1] is the post-norm state lm_head consumes
        ids = ds[0]["input_ids"][None]
        with torch.no_grad():
            post_norm = model.model(ids).last_hidden_state[0]
        assert torch.equal(post_norm, reference(model, ids[0])[0][-1])


def test_padded_batches_are_close_not_exact(tmp_path, tokens_dir):
    model = target("tiny-llama")
    extract(tokens_dir, "tiny-llama", tmp_path / "hid", model=model, pad_batches=True)
    ds = open_dataset(tmp_path / "hid")
    for i in range(len(ds)):
        s = ds[i]
        hs, _ = reference(model, s["input_ids"])
        for j, k in enumerate([2, 4, 5]):
            ref = hs[k].float()
            assert (s["aux"][:, j].float() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_fp8_aux_within_stated_bound(tmp_path, tokens_dir):
    """|read - aux| <= (2^-4 + 2^-8)|aux| + 2^-9 scale, scale = max|row| / 448 (FORMAT.md)."""
    model = target("tiny-llama")
    extract(tokens_dir, "tiny-llama", tmp_path / "hid", model=model, aux_format="fp8")
    ds = open_dataset(tmp_path / "hid")
    assert ds.aux_format == "fp8"
    for i in range(len(ds)):
        s = ds[i]
        hs, _ = reference(model, s["input_ids"])
        ref = torch.stack([hs[k] for k in (2, 4, 5)], dim=1).float()      # [T, 3, tH]
        scale = ref.abs().amax(-1, keepdim=True) / 448
        err = (s["aux"].float() - ref).abs()
        assert bool((err <= (2**-4 + 2**-8) * ref.abs() + 2**-9 * scale).all())
        assert torch.equal(s["last"], hs[-1])                             # last stays bf16


def test_resume_recomputes_only_the_missing_shard(tmp_path, tokens_dir):
    model = target("tiny-llama")
    out = tmp_path / "hid"
    first = extract(tokens_dir, "tiny-llama", out, model=model, shard_tokens=70)
    n = first["shards"]
    assert n >= 3 and first["computed"] == list(range(n))
    before = {j: os.stat(out / shard_name(j)) for j in range(n)}
    ref = [dict(s) for s in (open_dataset(out)[i] for i in range(len(CONVS)))]
    (out / shard_name(1)).unlink()
    (out / "manifest.json").unlink()
    again = extract(tokens_dir, "tiny-llama", out, model=model, shard_tokens=70)
    assert again["computed"] == [1] and again["resumed"] == [j for j in range(n) if j != 1]
    for j in range(n):
        if j != 1:
            st = os.stat(out / shard_name(j))
            assert (st.st_ino, st.st_mtime_ns) == (before[j].st_ino, before[j].st_mtime_ns)
    ds = open_dataset(out)
    for i, r in enumerate(ref):
        assert all(torch.equal(ds[i][k], v) for k, v in r.items())
    with pytest.raises(ExtractError, match="started with different settings.*aux_layer_ids"):
        extract(tokens_dir, "tiny-llama", out, model=model, shard_tokens=70, layers=[2, 3, 5])


def test_tokens_path_is_recorded_absolute_and_old_relative_plans_resume(
        tmp_path, tokens_dir, monkeypatch):
    model = target("tiny-llama")
    monkeypatch.chdir(tokens_dir.parent)
    first = extract("ds", "tiny-llama", tmp_path / "hid", model=model, shard_tokens=70)
    plan_file, absolute = tmp_path / "hid" / "extract_plan.json", str(tokens_dir.resolve())
    assert json.loads(plan_file.read_text())["tokens_dir"] == absolute
    want = {"path": absolute, "n_samples": len(CONVS)}
    assert open_dataset(tmp_path / "hid").manifest["tokens_dataset"] == want
    plan = json.loads(plan_file.read_text())        # a plan that recorded the path as typed
    plan["tokens_dir"] = plan["manifest"]["tokens_dataset"]["path"] = "ds"
    plan_file.write_text(json.dumps(plan))
    (tmp_path / "hid" / shard_name(1)).unlink()
    (tmp_path / "hid" / "manifest.json").unlink()
    monkeypatch.chdir(tmp_path)
    again = extract(tokens_dir, "tiny-llama", tmp_path / "hid", model=model, shard_tokens=70)
    assert again["computed"] == [1] and len(again["resumed"]) == first["shards"] - 1
    assert json.loads(plan_file.read_text())["tokens_dir"] == absolute
    assert open_dataset(tmp_path / "hid").manifest["tokens_dataset"] == want


def test_data_parallel_ranks_then_finalize(tmp_path, tokens_dir):
    model = target("tiny-llama")
    single = tmp_path / "single"
    extract(tokens_dir, "tiny-llama", single, model=model, shard_tokens=70)
    out = tmp_path / "dp"
    r0 = extract(tokens_dir, "tiny-llama", out, model=model, shard_tokens=70, rank=0,
                 world_size=2)
    assert r0["computed"] == list(range(0, r0["shards"], 2))
    assert not (out / "manifest.json").exists()
    with pytest.raises(ExtractError, match="planned shard.*missing.*re-run extract"):
        finalize(out)
    extract(tokens_dir, "tiny-llama", out, model=model, shard_tokens=70, rank=1, world_size=2)
    finalize(out)
    a, b = open_dataset(single), open_dataset(out)
    assert len(a) == len(b) == len(CONVS)
    for i in range(len(a)):
        assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])


def test_aux_layer_validation_names_the_override(tmp_path, tokens_dir):
    assert check_aux_layers(None, 30) == [2, 15, 27]
    for bad in ([0, 3, 5], [1, 3, 5], [2, 5, 8], [5, 3, 6], [2, 3]):
        with pytest.raises(ExtractError, match=r"8 decoder layers.*2 <= a < b < c < N.*--layers"):
            extract(tokens_dir, "tiny-llama", tmp_path / "x", model=target("tiny-llama"),
                    layers=bad)
    # a target too shallow for the default still gets the override's own error
    with pytest.raises(ExtractError, match=r"\[1, 2, 3\] are invalid for a target with 5 "
                                           r"decoder layers: the lowest id 1 is below 2.*no default"):
        check_aux_layers([1, 2, 3], 5)


class Wrapper(nn.Module):
    """A multimodal-style model: text decoder under `model.language_model`, plus a vision stack
    that also has layers/norm/embed_tokens (must not be picked)."""

    def __init__(self, lm, vision):
        super().__init__()
        self.model = nn.Module()
        self.model.vision_model = vision
        self.model.language_model = lm.model
        self.lm_head = lm.lm_head
        self.config = lm.config

    def get_output_embeddings(self):
        return self.lm_head


def test_multimodal_wrapper_finds_the_text_model(tmp_path, tokens_dir):
    lm = target("tiny-llama")
    from eyas.data.common.targets import build_random_target
    wrapper = Wrapper(lm, build_random_target("tiny-llama", seed=1).model)
    text, layers, norm, head = find_text_model(wrapper)
    assert text is lm.model and layers is lm.model.layers and head is lm.lm_head
    extract(tokens_dir, "wrapped", tmp_path / "w", model=wrapper)
    extract(tokens_dir, "tiny-llama", tmp_path / "p", model=lm)
    a, b = open_dataset(tmp_path / "w"), open_dataset(tmp_path / "p")
    assert all(torch.equal(a[i][k], b[i][k]) for i in range(len(a)) for k in a[i])
    with pytest.raises(ExtractError, match="cannot find the decoder stack"):
        find_text_model(nn.Sequential(nn.Linear(2, 2)))


def test_chunked_argmax_ties_and_topk():
    torch.manual_seed(0)
    W = torch.randn(50, 16)
    W[40] = W[3]                                     # identical rows in different vocab chunks
    head = nn.Linear(16, 50, bias=False).to(torch.bfloat16)
    head.weight.data.copy_(W)
    h = torch.cat([5 * W[3:4], torch.randn(9, 16)]).to(torch.bfloat16)
    logits = head(h)
    for vocab_chunk, row_chunk in ((7, 3), (50, 4), (64, 100)):
        arg, ids, vals = chunked_argmax_topk(h, head, topk=5, vocab_chunk=vocab_chunk,
                                             row_chunk=row_chunk)
        assert torch.equal(arg, logits.argmax(-1)) and arg[0] == 3
        assert torch.equal(vals, logits.float().topk(5, dim=-1).values)
        assert torch.equal(ids[:, 0], arg) and ids[0, :2].tolist() == [3, 40]


def test_float32_target_is_recorded_and_guards_resume(tmp_path, tokens_dir):
    out = tmp_path / "hid"
    extract(tokens_dir, "tiny-llama", out, dtype="float32", device="cpu")
    ds = open_dataset(out)
    assert ds.manifest["target_dtype"] == "float32"
    model = load_target("tiny-llama", dtype=torch.float32)[0]
    for i in range(len(ds)):
        s = ds[i]
        hs, logits = reference(model, s["input_ids"])
        assert torch.equal(s["aux"][:, 0], hs[2].to(torch.bfloat16))
        assert torch.equal(s["target_argmax"], logits.argmax(-1))
    with pytest.raises(ExtractError, match="different settings.*target_dtype: 'float32' -> "
                                           "'bfloat16'"):
        extract(tokens_dir, "tiny-llama", out, model=target("tiny-llama"))
    plan = json.loads((out / "extract_plan.json").read_text())   # a plan from before the key
    del plan["target_dtype"]
    (out / "extract_plan.json").write_text(json.dumps(plan))
    assert extract(tokens_dir, "tiny-llama", out, model=target("tiny-llama"))["computed"] == []
    with pytest.raises(ExtractError, match="dtype='fp16': expected one of bfloat16, float32"):
        extract(tokens_dir, "tiny-llama", tmp_path / "other", dtype="fp16", device="cpu")


def test_cli_dtype_auto_is_the_trainers_rule(tmp_path, tokens_dir):
    """`eyas extract --dtype` defaults to target.dtype's auto: float32 on the CPU (as the
    trainer extracts there); an explicit alias such as bf16 is kept."""
    from functools import partial

    from eyas.train.cli import call
    cli_main = partial(call, "extract")
    base = ["--tokens", str(tokens_dir), "--target", "tiny-llama", "--device", "cpu"]
    assert cli_main(base + ["--out", str(tmp_path / "auto")]) == 0
    assert open_dataset(tmp_path / "auto").manifest["target_dtype"] == "float32"
    assert cli_main(base + ["--out", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert open_dataset(tmp_path / "bf16").manifest["target_dtype"] == "bfloat16"
