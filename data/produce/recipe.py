"""The main job's own datasets: the embedded default and the held-out check's, each built once.

    embedded_dataset(data, target, seed=, target_dtype=) -> DatasetPaths   the training set
    heldout_dataset(eval_cfg, data, target, device) -> Path                   held-out states

`data`, `target` and `eval_cfg` are the job's config groups (`train.config`: `DataConfig`
holds the `data.common.settings` groups this module reads, plus prompts, num_prompts and
cache_dir). The embedded default (the target answering the shipped prompts, then hidden states
extracted from its answers) is cached under `data.cache_dir/datasets/<key>`, where the key
hashes every setting that changes its bytes. A dataset that differs from a finished one only in
what is extracted (aux layers, storage format, teacher, padded batches) copies that one's
prompts, answers and tokens instead of generating them again. The held-out check's prompts are
answered in float32 (the precision of real decoding) and cached under
`data.cache_dir/heldout/<key>`; each step resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from eyas.data.common.settings import Capture, KVCache
from eyas.data.common.utils import atomic_path, atomic_write_bytes, atomic_write_dir
from eyas.data.produce.prompts import prompts_path

log = logging.getLogger(__name__)


@dataclass
class DatasetPaths:
    train: Path
    eval: Path | None
    conversations: Path | None = None
    tokens: Path | None = None      # with data.stream: what the trainer captures `train` from


def _embedded_key(data, target, seed: int, target_dtype) -> str:
    """The dataset's directory name: a hash of every setting that changes its bytes.
    target_dtype: what target.dtype resolved to; target.dtype=auto is keyed by it unless it is
    float32 (the resolution the keys of existing caches were made with)."""
    ids = None if target.aux_layer_ids is None else list(target.aux_layer_ids)
    # str(enum) is "AuxFormat.bf16": the spelling the keys of existing caches were made with
    fields = [target.name, target.dtype, ids, data.num_prompts, data.max_new_tokens,
              data.max_length, str(data.aux_format), str(data.teacher), seed]
    fields += _answer_extras(data)
    resolved = str(target_dtype).removeprefix("torch.")
    if target.dtype == "auto" and resolved != "float32":
        fields += ["auto", resolved]
    if data.extract_pad_batches:
        fields += ["pad_batches"]
    if data.endpoint:                 # answers from a served target
        fields += ["endpoint", data.endpoint, data.endpoint_model]
    if data.capture != Capture.hf:          # states captured by the engine
        fields += ["capture", data.capture.value]
    return _hash(data, fields)


def _answers_key(data, target, seed: int, target_dtype) -> str:
    """A hash of the settings the prompts, answers and tokens depend on: two datasets that
    differ only in what is extracted from those tokens (aux layers, storage format, teacher,
    padded batches) share it, and the second reuses the first's answers (`_reuse_answers`).
    target_dtype: the dtype the target generated in (target.dtype=auto resolves by device)."""
    fields = ["answers", target.name, str(target_dtype), data.num_prompts, data.max_new_tokens,
              data.max_length, seed, *_answer_extras(data)]
    if data.endpoint:
        fields += ["endpoint", data.endpoint, data.endpoint_model]
    return _hash(data, fields)


def _answer_extras(data) -> list:
    """The key fields of the optional generation settings, each appended only when it is not
    the default, so caches built before it existed keep their key."""
    fields: list = []
    if data.samples_per_prompt > 1:
        fields += [data.samples_per_prompt, data.temperature, data.top_p]
    if KVCache(data.generation_cache) != KVCache.dynamic and not data.endpoint:
        fields += ["cache", KVCache(data.generation_cache).value]   # its answers differ
    if data.samples_per_prompt > 1 and not data.endpoint:
        fields += ["batch", data.generation_batch_size]   # chunk c of answers is seeded by c
    if data.synthetic_prompts > 0:
        fields += ["synthetic", data.synthetic_prompts, data.synthetic_temperature,
                   data.generation_batch_size]   # batch b of prompts is seeded by b
        if data.synthetic_opener_words > 0:
            fields += ["openers", data.synthetic_opener_words]
        if data.synthetic_examples > 0:
            fields += ["examples", data.synthetic_examples]
    return fields


def _hash(data, fields: list) -> str:
    prompts = Path(data.prompts or prompts_path("default"))
    if not prompts.is_file():
        raise FileNotFoundError(f"data.prompts={prompts}: no such file (set data.prompts to a "
                                f"prompts .jsonl file, or leave it null for the shipped ones)")
    h = hashlib.sha256()
    h.update(prompts.read_bytes())
    h.update(json.dumps(fields).encode())
    return h.hexdigest()[:16]


# What a dataset directory holds before extraction: reused whole by a dataset with the same
# answers key (tokens/ last: its manifest marks the answers complete).
_ANSWER_FILES = ("prompts.synthetic.jsonl", "prompts.jsonl", "prompts.sampled.jsonl",
                 "answers.greedy.jsonl", "answers.greedy.card.json", "answers.sampled.jsonl",
                 "answers.sampled.card.json", "conversations.jsonl", "conversations.card.json")
_ANSWERS_KEY_FILE = "answers.key"


def _reuse_answers(root: Path, key: str) -> Path | None:
    """Copy the prompts, answers and tokens of a complete sibling cache with answers key `key`
    into `root`, each file whole or not at all; the sibling, or None if there is none."""
    for other in sorted(root.parent.iterdir()):
        mark = other / _ANSWERS_KEY_FILE
        if (other == root or not mark.is_file() or mark.read_text().strip() != key
                or not (other / "tokens" / "manifest.json").is_file()):
            continue
        for name in _ANSWER_FILES:
            if (other / name).is_file():
                with atomic_path(root / name) as tmp:
                    shutil.copyfile(other / name, tmp)
        atomic_write_dir(root / "tokens", lambda tmp: shutil.copytree(
            other / "tokens", tmp, dirs_exist_ok=True, copy_function=shutil.copyfile),
            if_exists="replace")
        return other
    return None


def _write_lines(path: Path, lines: list[str]) -> None:
    atomic_write_bytes(path, "".join(line + "\n" for line in lines).encode("utf-8"))


def _sampled_prompts(subset: Path, extra: int) -> list[str]:
    """Each record of `subset` `extra` times, ids `<id>#s1` .. `<id>#s<extra>`.

    The base id is the one data.produce.generate gives the record in `subset` (its "id", else
    `<file name>:<line>`), so answer j of prompt X is stored as `X#sj` next to the greedy `X`.
    """
    from eyas.data.produce.records import read_conversations
    return [json.dumps({**rec, "id": f"{conv.id}#s{j}"}, ensure_ascii=False)
            for rec, conv in read_conversations(subset) for j in range(1, extra + 1)]


def _synthetic_prompts(data, seed: int, root: Path, model, tokenizer,
                       prompts: Path) -> list[str]:
    """`data.synthetic_prompts` prompts sampled from the target (cached in root), as JSONL lines;
    none repeats a shipped prompt or a held-out one."""
    from eyas.data.produce.synthesize import prompt_openers, prompt_texts, synthesize_prompts
    path = root / "prompts.synthetic.jsonl"
    words, shots = data.synthetic_opener_words, data.synthetic_examples
    if not path.is_file():
        shipped = prompt_texts(prompts)
        synthesize_prompts(model, tokenizer, data.synthetic_prompts, path,
                           openers=prompt_openers(shipped, words) if words > 0 else [],
                           examples=shipped if shots > 0 else [], shots=max(shots, 1),
                           temperature=data.synthetic_temperature,
                           batch_size=data.generation_batch_size, seed=seed,
                           exclude=shipped + prompt_texts(prompts_path("heldout")))
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _served_answers(data, root: Path, subset: Path, sampled: Path | None,
                    conversations: Path, seed: int) -> None:
    """The embedded default's answers from `data.endpoint` (data.produce.served): answer 0 greedy into
    `conversations` (with its data card), answers 1.. sampled into a second file appended to it."""
    from eyas.data.produce.served import generate_from_endpoint
    kw = dict(model=data.endpoint_model, max_tokens=data.max_new_tokens, seed=seed,
              concurrency=data.endpoint_concurrency, api_key_env=data.endpoint_api_key_env)
    if sampled is None:
        generate_from_endpoint(subset, data.endpoint, conversations, temperature=0.0, **kw)
        return
    greedy, rest = root / "answers.greedy.jsonl", root / "answers.sampled.jsonl"
    generate_from_endpoint(subset, data.endpoint, greedy, temperature=0.0, **kw)
    generate_from_endpoint(sampled, data.endpoint, rest, temperature=data.temperature,
                           top_p=data.top_p, **kw)
    atomic_write_bytes(conversations, greedy.read_bytes() + rest.read_bytes())


def embedded_dataset(data, target, *, seed: int,
                           target_dtype) -> DatasetPaths:
    """The embedded dataset (`_build_embedded_dataset`); its cache directory is locked
    (data/common/lock.py) while it is written, so a second training building the same one at the same
    time fails at once naming the first. A complete cache is only read, without the lock."""
    from eyas.data.common.lock import dir_lock
    key = _embedded_key(data, target, seed, target_dtype)
    root = Path(data.cache_dir).expanduser() / "datasets" / key
    complete = (root / "hidden" / "manifest.json").is_file()
    with contextlib.nullcontext() if complete else dir_lock(root, what="embedded dataset cache"):
        return _build_embedded_dataset(data, target, root, seed=seed, target_dtype=target_dtype)


def _build_embedded_dataset(data, target, root: Path, *, seed: int,
                            target_dtype) -> DatasetPaths:
    """Generate conversations with the target, tokenise, extract hidden states (cached).

    Each prompt is answered `data.samples_per_prompt` times into one conversations file: answer
    0 greedily (id X), answers 1.. sampled at `data.temperature` / `data.top_p` (ids X#s1, ..).
    target_dtype: the torch dtype the target runs in (`Resolved.target_dtype`).
    """
    from eyas.data.produce import extract
    hidden = root / "hidden"
    conversations = root / "conversations.jsonl"
    if (hidden / "manifest.json").is_file():
        log.info("embedded dataset: cached at %s", hidden)
        return DatasetPaths(train=hidden, eval=None, conversations=conversations)
    root.mkdir(parents=True, exist_ok=True)
    tokens = root / "tokens"
    if data.stream.enabled and (tokens / "manifest.json").is_file():
        return DatasetPaths(train=hidden, eval=None, conversations=conversations, tokens=tokens)
    prompts = Path(data.prompts or prompts_path("default"))
    lines = [line for line in prompts.read_text().splitlines() if line.strip()][:data.num_prompts]
    from eyas.data.common.targets import default_device, load_target
    device = default_device().type
    model, tokenizer = load_target(target.name, dtype=target_dtype, device=device)
    akey = _answers_key(data, target, seed, target_dtype)
    if not (tokens / "manifest.json").is_file():
        donor = _reuse_answers(root, akey)
        if donor is not None:       # its tokens copied too
            log.info("embedded dataset: prompts, answers and tokens reused from %s (the same "
                     "prompts, target and generation settings; only the extraction differs)",
                     donor)
        else:
            n_synth = data.synthetic_prompts
            log.info("embedded dataset: %s answers %d prompts from %s%s %d time(s) each "
                     "(resumable; cached in %s)", target.name, len(lines), prompts.name,
                     f" and {n_synth} it writes itself" if n_synth else "",
                     data.samples_per_prompt, root)
            _answer_and_tokenise(data, target, seed, root, lines, prompts, model, tokenizer)
    atomic_write_bytes(root / _ANSWERS_KEY_FILE, (akey + "\n").encode())
    layers = None if target.aux_layer_ids is None else list(target.aux_layer_ids)
    paths = DatasetPaths(train=hidden, eval=None, conversations=conversations, tokens=tokens)
    if data.stream.enabled:
        return paths        # the trainer captures while it trains (data/produce/stream.py)
    extract.extract(tokens, target.name, hidden, layers=layers, **data.extract_kwargs(),
                    dtype=str(target_dtype).removeprefix("torch."),
                    model=model if data.capture == Capture.hf else None, device=device)
    return paths


def _answer_and_tokenise(data, target, seed: int, root: Path,
                         lines: list[str], prompts: Path, model, tokenizer) -> None:
    """The prompts (shipped, then synthesized), the target's answers to them (greedy, then
    sampled; each step resumable) and their tokens, into `root`."""
    from eyas.data.produce import generate, prepare
    samples, conversations = data.samples_per_prompt, root / "conversations.jsonl"
    subset = root / "prompts.jsonl"
    if not subset.is_file():
        if data.synthetic_prompts:
            lines = lines + _synthetic_prompts(data, seed, root, model, tokenizer, prompts)
        _write_lines(subset, lines)
    sampled = root / "prompts.sampled.jsonl"
    if samples > 1 and not sampled.is_file():
        _write_lines(sampled, _sampled_prompts(subset, samples - 1))
    if data.endpoint:
        _served_answers(data, root, subset, sampled if samples > 1 else None, conversations,
                        seed)
    else:
        generate.generate_conversations(
            subset, target.name, conversations, max_new_tokens=data.max_new_tokens,
            batch_size=data.generation_batch_size, temperature=0.0, seed=seed,
            cache=KVCache(data.generation_cache).value, model=model, tokenizer=tokenizer)
    if samples > 1 and not data.endpoint:   # answers 1.., sampled, appended to the same file
        generate.generate_conversations(sampled, target.name, conversations,
                                        **data.generate_kwargs(), seed=seed, model=model,
                                        tokenizer=tokenizer)
    prepare.prepare(conversations, target.name, root / "tokens", max_length=data.max_length,
                    on_error="skip")


def _heldout_key(eval_cfg, data, target,
                 prompts: Path) -> str:
    """The held-out cache's key: every setting its answers, tokens and hidden states depend on
    (data.max_length decides which answers the tokeniser keeps)."""
    h = hashlib.sha256(prompts.read_bytes())
    ids = None if target.aux_layer_ids is None else list(target.aux_layer_ids)
    h.update(json.dumps([target.name, ids, eval_cfg.num_prompts, heldout_length(eval_cfg),
                         "float32", data.max_length]).encode())
    return h.hexdigest()[:16]


def heldout_length(eval_cfg) -> int:
    """How many tokens the offline held-out check answers each prompt with."""
    return eval_cfg.heldout_max_new_tokens or eval_cfg.max_new_tokens


#: how long a run waits for another run that is building the same held-out cache
HELDOUT_WAIT_S = 3600.0


def heldout_prompts(eval_cfg) -> Path:
    """The held-out prompts: real decoding's, the served check's and the held-out walk's."""
    return Path(eval_cfg.prompts or prompts_path("heldout"))


def heldout_dataset(eval_cfg, data, target, device: str) -> Path:
    """The hidden states of the held-out prompts' own greedy answers: the first
    eval.num_prompts prompts answered by the target in float32, tokenised and extracted once
    (`_build_heldout`). Runs that finish side by side share the cache: the second waits for the
    first to write it (HELDOUT_WAIT_S), then reads it."""
    from eyas.data.common.lock import dir_lock
    prompts = heldout_prompts(eval_cfg)
    root = (Path(data.cache_dir).expanduser() / "heldout"
            / _heldout_key(eval_cfg, data, target, prompts))
    hidden = root / "hidden"
    if not (hidden / "manifest.json").is_file():
        with dir_lock(root, what="held-out dataset cache", wait=HELDOUT_WAIT_S):
            if not (hidden / "manifest.json").is_file():   # not written while this one waited
                _build_heldout(eval_cfg, data, target, prompts, root, device)
    return hidden


def _build_heldout(eval_cfg, data, target,
                   prompts: Path, root: Path, device: str) -> None:
    """Answer, tokenise and extract the held-out prompts into root (`heldout_dataset`)."""
    import torch

    from eyas.data.produce import extract, generate, prepare
    from eyas.data.common.targets import load_target
    log.info("held-out offline check: answering %d prompts of %s (<= %d tokens, float32, "
             "cached in %s)", eval_cfg.num_prompts, prompts.name, heldout_length(eval_cfg), root)
    model, tokenizer = load_target(target.name, dtype=torch.float32, device=device)
    subset = root / "prompts.jsonl"
    lines = [x for x in prompts.read_text().splitlines() if x.strip()]
    _write_lines(subset, lines[:eval_cfg.num_prompts])
    conversations = generate.generate_conversations(
        subset, target.name, root / "conversations.jsonl",
        max_new_tokens=heldout_length(eval_cfg), batch_size=data.generation_batch_size,
        temperature=0.0, model=model, tokenizer=tokenizer)
    if not (root / "tokens" / "manifest.json").is_file():
        prepare.prepare(conversations, target.name, root / "tokens",
                        max_length=data.max_length, on_error="skip")
    extract.extract(root / "tokens", target.name, root / "hidden",
                    layers=None if target.aux_layer_ids is None
                    else list(target.aux_layer_ids), model=model, device=device)
