"""The embedded dataset build: several answers per prompt (greedy, then sampled); cache keys."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eyas.data.produce.prompts import prompts_path
from eyas.data.store.shards import open_dataset
from eyas.data.common.targets import default_device
from eyas.train.config import ConfigError, check, register
from eyas.train.resolve import resolve
from eyas.data.produce.recipe import _embedded_key, embedded_dataset

CONF = Path(__file__).resolve().parents[2] / "conf"

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(*overrides):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=["target=tiny_llama", *overrides])


def _typed(cfg):
    cfg.output_dir = "unused"   # ${hydra:...} resolves only inside a Hydra job
    return OmegaConf.to_object(cfg)


def _key(cfg, target_dtype=torch.float32) -> str:
    c = _typed(cfg)
    return _embedded_key(c.data, c.target, c.train.seed, target_dtype)


def _build(cfg):
    c = _typed(cfg)
    return embedded_dataset(c.data, c.target, seed=c.train.seed,
                                  target_dtype=resolve(c, default_device()).target_dtype)


def _old_key(cfg) -> str:
    """The key formula before samples_per_prompt existed (caches built then must stay valid)."""
    h = hashlib.sha256()
    h.update(prompts_path("default").read_bytes())
    h.update(json.dumps([cfg.target.name, cfg.target.dtype, None, cfg.data.num_prompts,
                         cfg.data.max_new_tokens, cfg.data.max_length, str(cfg.data.aux_format),
                         str(cfg.data.teacher), cfg.train.seed]).encode())
    return h.hexdigest()[:16]


def _records(path: Path) -> dict[str, dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    out = {r["id"]: r for r in recs}
    assert len(out) == len(recs), "duplicate ids in the conversations file"
    return out


def test_key_unchanged_for_one_sample_and_distinct_for_several():
    one = _cfg("data.num_prompts=3", "data.max_new_tokens=8")
    assert _key(one) == _old_key(one)
    # sampling settings do not matter (nor enter the key) while there is only the greedy answer
    assert _key(_cfg("data.num_prompts=3", "data.max_new_tokens=8",
                     "data.temperature=1.3", "data.top_p=0.5")) == _old_key(one)
    keys = {_key(_cfg("data.num_prompts=3", "data.max_new_tokens=8", *o)) for o in (
        ["data.samples_per_prompt=2"], ["data.samples_per_prompt=3"],
        ["data.samples_per_prompt=2", "data.temperature=1.0"],
        ["data.samples_per_prompt=2", "data.top_p=0.5"])}
    assert len(keys) == 4 and _old_key(one) not in keys
    # the static KV cache's answers differ by kernel rounding: a key of their own
    static = _key(_cfg("data.num_prompts=3", "data.max_new_tokens=8",
                       "data.generation_cache=static"))
    assert static not in keys | {_old_key(one)}
    assert _key(_cfg("data.num_prompts=3", "data.max_new_tokens=8",
                     "data.generation_cache=dynamic")) == _old_key(one)
    served = ["data.num_prompts=3", "data.endpoint=http://127.0.0.1:1/v1"]   # no local cache
    assert _key(_cfg(*served, "data.generation_cache=static")) == _key(_cfg(*served))


def test_the_key_follows_what_auto_resolves_to_and_the_batch_that_seeds_sampled_answers():
    one = _cfg("data.num_prompts=3", "data.max_new_tokens=8")
    assert _key(one, torch.float32) == _old_key(one)          # existing CPU caches keep theirs
    assert _key(one, torch.bfloat16) != _key(one, torch.float32)
    explicit = _cfg("data.num_prompts=3", "data.max_new_tokens=8", "target.dtype=bfloat16")
    assert _key(explicit, torch.bfloat16) == _key(explicit, torch.float32)
    sampled = ["data.num_prompts=3", "data.max_new_tokens=8", "data.samples_per_prompt=2"]
    assert _key(_cfg(*sampled, "data.generation_batch_size=16")) != \
        _key(_cfg(*sampled, "data.generation_batch_size=64"))
    assert _key(_cfg("data.num_prompts=3", "data.max_new_tokens=8",
                     "data.generation_batch_size=16")) == _old_key(one)   # greedy: unchanged


def test_samples_per_prompt_appends_sampled_answers(tmp_path):
    base = ["data.num_prompts=3", "data.max_new_tokens=8", f"data.cache_dir={tmp_path}"]
    one = _build(_cfg(*base))
    two = _build(_cfg(*base, "data.samples_per_prompt=2"))
    assert one.train != two.train

    greedy, both = _records(one.conversations), _records(two.conversations)
    ids = [json.loads(line)["id"] for line in prompts_path("default").read_text().splitlines()[:3]]
    assert sorted(greedy) == sorted(ids)
    assert sorted(both) == sorted(ids + [f"{i}#s1" for i in ids])
    for i in ids:
        # answer 0 is the same greedy text a one-sample build writes
        assert both[i]["messages"] == greedy[i]["messages"]
        assert both[i]["generation"]["temperature"] == 0.0
        gen = both[f"{i}#s1"]["generation"]
        assert (gen["temperature"], gen["top_p"]) == (0.7, 0.95)
        assert both[f"{i}#s1"]["messages"][:-1] == greedy[i]["messages"][:-1]
    # sampled answers are not the greedy ones (a random tiny target is near uniform)
    assert any(both[f"{i}#s1"]["messages"][-1] != greedy[i]["messages"][-1] for i in ids)
    # greedy records were written first, then the sampled pass appended
    order = [json.loads(line)["id"] for line in two.conversations.read_text().splitlines()]
    assert set(order[:3]) == set(ids)
    assert len(open_dataset(one.train)) == 3 and len(open_dataset(two.train)) == 6


def test_sampled_ids_without_record_ids_follow_generate(tmp_path):
    """Records without an "id" get `<file name>:<line>` (as data.produce.generate), then `#sJ`."""
    src = tmp_path / "mine.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                           for q in ("Say hi.", "Name a color.")))
    from eyas.data.produce.recipe import _sampled_prompts
    out = [json.loads(x) for x in _sampled_prompts(src, 2)]
    assert [r["id"] for r in out] == ["mine.jsonl:1#s1", "mine.jsonl:1#s2",
                                      "mine.jsonl:2#s1", "mine.jsonl:2#s2"]
    assert out[1]["messages"] == [{"role": "user", "content": "Say hi."}]


@pytest.mark.parametrize("overrides,fix", [
    (["data.samples_per_prompt=0"], "data.samples_per_prompt=1"),
    (["data.samples_per_prompt=2", "data.temperature=0"], "data.temperature=0.7"),
    (["data.top_p=0"], "data.top_p=0.95"),
    (["data.top_p=1.5"], "data.top_p=0.95"),
    (["data.synthetic_opener_words=-1"], "data.synthetic_opener_words=2 (or 0: no openers)"),
    (["data.synthetic_examples=-1"], "data.synthetic_examples=4 (or 0: no example lists)"),
])
def test_bad_sampling_settings_name_the_fix(overrides, fix):
    with pytest.raises(ConfigError) as e:
        check(_cfg(*overrides))
    key = overrides[-1].split("=")[0]
    assert f"{key}=" in str(e.value) and f"Fix: {fix}" in str(e.value)


def test_greedy_only_accepts_temperature_zero():
    check(_cfg("data.temperature=0"))   # samples_per_prompt=1: nothing is sampled


@pytest.mark.slow
def test_synthetic_prompts_join_the_shipped_ones(tmp_path):
    """SmolLM2 writes two prompts itself; both are answered next to the shipped one."""
    base = ["target=smollm2", "data.num_prompts=1", "data.max_new_tokens=8",
            "data.synthetic_prompts=2", "data.generation_batch_size=4", "target.dtype=float32",
            f"data.cache_dir={tmp_path}"]
    cfg = _cfg(*base)
    check(cfg)
    assert _key(cfg) != _key(_cfg(*base[:-4], f"data.cache_dir={tmp_path}"))
    assert _key(cfg) != _key(_cfg(*base, "data.synthetic_opener_words=2"))
    assert _key(cfg) != _key(_cfg(*base, "data.synthetic_examples=4"))
    paths = _build(cfg)
    recs = _records(paths.conversations)
    first = json.loads(prompts_path("default").read_text().splitlines()[0])["id"]
    assert sorted(recs) == sorted([first, "synth-000000", "synth-000001"])
    held = {" ".join(t.lower().split()) for t in
            __import__("eyas.data.produce.synthesize", fromlist=["x"]).prompt_texts(prompts_path("heldout"))}
    for rid in ("synth-000000", "synth-000001"):
        user, answer = recs[rid]["messages"][-2:]
        assert user["role"] == "user" and user["content"].strip()
        assert " ".join(user["content"].lower().split()) not in held
        assert answer["role"] == "assistant"
    assert len(open_dataset(paths.train)) == 3


def test_generation_cache_reaches_the_greedy_answers(tmp_path, monkeypatch):
    from eyas.data.produce import generate
    seen, real = [], generate.generate_conversations

    def recording(*args, **kw):
        seen.append(kw.get("cache"))
        return real(*args, **kw)

    monkeypatch.setattr(generate, "generate_conversations", recording)
    built = _build(_cfg("data.num_prompts=3", "data.max_new_tokens=8",
                        f"data.cache_dir={tmp_path}", "data.generation_cache=static"))
    assert seen == ["static"]
    assert len(open_dataset(built.train)) == 3


def test_a_change_of_extraction_alone_reuses_the_answers(tmp_path, monkeypatch, caplog):
    """Other aux layers are a dataset of their own (its own key and hidden states), but the
    prompts, answers and tokens are copied from the finished one, not generated again."""
    from eyas.data.produce import generate
    base = ["data.num_prompts=3", "data.max_new_tokens=8", f"data.cache_dir={tmp_path}"]
    first = _build(_cfg(*base))
    assert _build(_cfg(*base)).train == first.train                     # the cache is read
    seen, real = [], generate.generate_conversations

    def recording(*args, **kw):
        seen.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(generate, "generate_conversations", recording)
    other = _cfg(*base, "target.aux_layer_ids=[2,3,6]")
    with caplog.at_level("INFO", logger="eyas.data.produce.recipe"):
        second = _build(other)
    assert seen == [] and "reused from" in caplog.text
    assert second.train != first.train and _key(other) != _key(_cfg(*base))
    assert second.conversations.read_bytes() == first.conversations.read_bytes()
    for name in ("prompts.jsonl", "answers.key", "tokens/manifest.json"):
        a, b = first.train.parent / name, second.train.parent / name
        assert a.read_bytes() == b.read_bytes(), name
    one, two = open_dataset(first.train), open_dataset(second.train)
    assert len(two) == len(one) == 3
    assert (one.manifest["aux_layer_ids"], two.manifest["aux_layer_ids"]) == ([2, 4, 5], [2, 3, 6])
    for i in range(3):
        assert (two[i]["input_ids"] == one[i]["input_ids"]).all()

    # a setting the answers depend on is generated anew, even with the same extraction
    third = _build(_cfg(base[0], "data.max_new_tokens=6", base[2],
                        "target.aux_layer_ids=[2,3,6]"))
    assert len(seen) == 1 and third.train.parent not in (first.train.parent, second.train.parent)
    assert (third.train.parent / "answers.key").read_text() != (
        first.train.parent / "answers.key").read_text()


def _heldout_setup(tmp_path, full_vocab_export, *, prompts: int):
    """A tiny-llama export and the overrides of a CPU held-out walk over `prompts` prompts
    answered to 4 tokens, cached under tmp_path."""
    from eyas.data.common.targets import load_target
    model, _ = load_target("tiny-llama", device="cpu")
    export = full_vocab_export(model, tmp_path / "export")
    return export, [f"eval.num_prompts={prompts}", "eval.max_new_tokens=4",
                    "eval.heldout_offline=true", "eval.target_device=cpu",
                    f"data.cache_dir={tmp_path}/cache"]


@pytest.mark.slow
def test_the_heldout_walk_over_longer_answers_carries_the_capped_one(tmp_path,
                                                                       full_vocab_export):
    """eval.heldout_max_new_tokens: one set of longer held-out answers gives the walk over them
    and the walk within their first eval.max_new_tokens tokens; the shorter answers of the
    default are those answers' greedy prefixes, cached apart."""
    from eyas.train.evaluate.offline import offline_eval
    from eyas.train.pipeline import heldout_walk_text
    from eyas.train.pipeline import run_heldout_offline
    export, base = _heldout_setup(tmp_path, full_vocab_export, prompts=2)
    short_cfg = _typed(_cfg(*base))
    long_cfg = _typed(_cfg(*base, "eval.heldout_max_new_tokens=10"))
    check(_cfg(*base, "eval.heldout_max_new_tokens=10"))
    short = run_heldout_offline(short_cfg.eval, short_cfg.data, short_cfg.target, export, k=3)
    long = run_heldout_offline(long_cfg.eval, long_cfg.data, long_cfg.target, export, k=3)
    assert short["max_new_tokens"] == 4 and "tau_trajectory_capped" not in short
    assert (long["max_new_tokens"], long["walk_cap"]) == (10, 4)

    roots = {p.parent.parent.name: p.parent.parent for p in
             (tmp_path / "cache" / "heldout").glob("*/hidden/manifest.json")}
    assert len(roots) == 2
    long_root = next(r for r in roots.values() if str(r) in long["dataset"])
    direct = offline_eval(export, long_root / "hidden", k=3,
                          token_budget=long_cfg.data.token_budget, walk_cap=4, target="tiny-llama")
    assert (long["tau_trajectory"], long["tau_trajectory_capped"]) == \
        (direct["tau_trajectory"], direct["tau_trajectory_capped"])
    assert heldout_walk_text(long) == (f"tau {long['tau_trajectory']:.3f} over answers of up to "
                                       f"10 tokens, {long['tau_trajectory_capped']:.3f} within "
                                       f"their first 4")
    assert heldout_walk_text(short) == f"tau {short['tau_trajectory']:.3f}"

    answers = {name: {rid: rec["messages"][-1]["content"]
                      for rid, rec in _records(root / "conversations.jsonl").items()}
               for name, root in roots.items()}
    short_answers, long_answers = (answers[name] for name in sorted(
        answers, key=lambda n: str(roots[n]) in long["dataset"]))
    assert sorted(short_answers) == sorted(long_answers) and len(short_answers) == 2
    for rid, text in short_answers.items():   # greedy: the short answers begin the long ones
        assert len(long_answers[rid]) > len(text) and long_answers[rid].startswith(text)


@pytest.mark.slow
def test_the_heldout_cache_is_keyed_by_data_max_length(tmp_path, full_vocab_export):
    """A held-out build whose data.max_length leaves prompts' samples out is cached apart: a run
    with the default length finds every prompt, not the shorter build's survivors."""
    from eyas.train.pipeline import run_heldout_offline
    export, base = _heldout_setup(tmp_path, full_vocab_export, prompts=6)
    full_cfg = _typed(_cfg(*base))
    full = run_heldout_offline(full_cfg.eval, full_cfg.data, full_cfg.target, export, k=3)
    lengths = sorted(len(s["input_ids"]) for s in open_dataset(full["dataset"]))
    assert full["num_samples"] == 6 and lengths[0] < lengths[-1]

    cut_cfg = _typed(_cfg(*base, f"data.max_length={lengths[0]}"))
    cut = run_heldout_offline(cut_cfg.eval, cut_cfg.data, cut_cfg.target, export, k=3)
    assert cut["num_samples"] == lengths.count(lengths[0]) < 6
    assert cut["dataset"] != full["dataset"]
    again = run_heldout_offline(full_cfg.eval, full_cfg.data, full_cfg.target, export, k=3)
    assert again == full
