"""`eyas inspect --samples`: golden renderings of the loss mask under every shipped chat template.

Fixed conversations (system + user + assistant; a two-turn one; for Qwen3 also an assistant turn
with `reasoning_content`, with thinking on and off) are prepared with each shipped template
(`data/common/templates/`) and with SmolLM2's own, then rendered as `eyas inspect` shows them: decoded
run by run, trained runs in ``[[ ]]``. The templates' own tokenizers (Llama-3.1, Qwen3,
DeepSeek-V3) are not available offline, so every case uses the real SmolLM2 tokenizer; its bos
token is ``<|im_start|>`` (hence the one the Llama and DeepSeek templates write first) and it
tokenises ``<think>`` as plain text.

What the goldens show, by `data/produce/prepare.py`'s rule: each ``[[ ]]`` holds exactly what the model
generates in one assistant turn (reasoning, content, end-of-turn marker), never the system or
user text or the assistant header; the newline Qwen3 writes after ``<|im_end|>`` is outside.
Qwen3 with thinking off puts ``<think>\\n\\n</think>\\n\\n`` in the generation prompt, so that
empty block is context; a stored turn with reasoning then differs from the prompt after
``<think>\\n`` and its span starts there (the longest common prefix).

Set EYAS_UPDATE_GOLDEN=1 to rewrite the golden files; read them before committing.
"""

import json
import os
import re
from pathlib import Path

import pytest

from eyas.data.store.dataset import open_dataset
from eyas.data.produce.prepare import prepare
from eyas.data.store.render import ANSI_ON, render_sample
from eyas.data.store.shards import write_manifest, write_shard
from eyas.data.common.targets import load_tokenizer
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "inspect")

GOLDEN = Path(__file__).parent / "golden"


def render_samples(tokenizer, samples, style="brackets"):
    """`render_sample` of each (ids, mask), separated by blank lines (as `eyas inspect` prints)."""
    return "\n\n".join(render_sample(tokenizer, i, ids, mask, style)
                       for i, (ids, mask) in enumerate(samples))
SYSTEM, USER, USER2 = "You are terse.", "Capital of France?", "And of Italy?"

SINGLE = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER},
                       {"role": "assistant", "content": "Paris."}]}
TWO_TURNS = {"messages": [*SINGLE["messages"], {"role": "user", "content": USER2},
                          {"role": "assistant", "content": "Rome."}]}
REASONING = {"messages": [*SINGLE["messages"][:2],
                          {"role": "assistant", "content": "Paris.",
                           "reasoning_content": "France's capital is Paris."}]}
CONVERSATIONS = {"single": SINGLE, "two-turns": TWO_TURNS, "reasoning": REASONING}
EOT = {"llama-3.1": "<|eot_id|>", "deepseek-v3": "<｜end▁of▁sentence｜>", "qwen3": "<|im_end|>",
       None: "<|im_end|>"}

#: (golden name, shipped template or None for the tokenizer's own, conversation, template kwargs)
CASES = [
    ("llama-3.1-single", "llama-3.1", "single", {}),
    ("llama-3.1-two-turns", "llama-3.1", "two-turns", {}),
    ("deepseek-v3-single", "deepseek-v3", "single", {}),
    ("deepseek-v3-two-turns", "deepseek-v3", "two-turns", {}),
    ("smollm2-single", None, "single", {}),
    ("smollm2-two-turns", None, "two-turns", {}),
    *[(f"qwen3-{conv}-thinking-{'on' if on else 'off'}", "qwen3", conv, {"enable_thinking": on})
      for conv in CONVERSATIONS for on in (True, False)],
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def _prepare(tmp_path, tok, conv, template, kwargs):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "in.jsonl").write_text(json.dumps(conv) + "\n")
    prepare(tmp_path / "in.jsonl", "smollm2", tmp_path / "out", tokenizer=tok,
            chat_template=template, template_kwargs=kwargs)
    ds = open_dataset(tmp_path / "out")
    return tmp_path / "out", [(ds[i]["input_ids"].tolist(), ds[i]["loss_mask"].tolist())
                              for i in range(len(ds))]


def _golden(name: str, text: str | None = None) -> str:
    """The golden rendering `name`; with EYAS_UPDATE_GOLDEN=1 and `text`, written first."""
    path = GOLDEN / f"{name}.txt"
    if text is not None and os.environ.get("EYAS_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
    return path.read_text(encoding="utf-8")[:-1]


def _shift(mask, by):
    n = len(mask)
    return [False] * by + mask[:n - by] if by > 0 else mask[-by:] + [False] * -by


@pytest.mark.parametrize("name,template,conv,kwargs", CASES, ids=[c[0] for c in CASES])
def test_rendering_matches_golden(tmp_path, tok, name, template, conv, kwargs):
    _, samples = _prepare(tmp_path, tok, CONVERSATIONS[conv], template, kwargs)
    text = render_samples(tok, samples)
    assert text == _golden(name, text)
    # a mask one token off either way renders differently
    for by in (1, -1):
        assert render_samples(tok, [(ids, _shift(m, by)) for ids, m in samples]) != text
    # every trained run is one assistant turn's output ending in its end-of-turn marker, and
    # holds no system or user text
    spans = re.findall(r"\[\[(.*?)\]\]", text, flags=re.S)
    assert spans and all(s.endswith(EOT[template]) for s in spans)
    assert not any(t in s for s in spans for t in (SYSTEM, USER, USER2, "assistant", "User"))


def test_markers_removed_give_the_rendered_conversation(tmp_path, tok):
    """The rendering loses nothing: without its markers it is the template's own text."""
    _, samples = _prepare(tmp_path, tok, TWO_TURNS, "llama-3.1", {})
    body = render_samples(tok, samples).split("\n", 1)[1].rsplit("\n", 1)[0]
    from eyas.data.common.templates import load_template
    want = tok.apply_chat_template(TWO_TURNS["messages"], tokenize=False,
                                   chat_template=load_template("llama-3.1"))
    assert body.replace("[[", "").replace("]]", "") == want


def test_cli_renders_samples_colours_and_falls_back(tmp_path, tok, capsys):
    out, samples = _prepare(tmp_path / "d", tok, SINGLE, "llama-3.1", {})
    assert cli_main([str(out), "--samples", "3"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip("\n").endswith(_golden("llama-3.1-single"))  # piped: brackets
    assert cli_main([str(out), "--samples", "1", "--color", "always"]) == 0
    coloured = capsys.readouterr().out
    assert f"{ANSI_ON}Paris.<|eot_id|>" in coloured and "[[" not in coloured
    assert cli_main([str(out), "--samples", "1", "--raw"]) == 0
    raw = capsys.readouterr().out
    assert "[0] tokens 121  trained 9 (7.4%)  input_ids [121]" in raw and "ids [" in raw
    # a target whose tokenizer cannot be loaded: one line, then ids
    bad = tmp_path / "bad"
    ids, mask = samples[0]
    import torch
    meta = write_shard(bad, 0, [{"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask)}])
    write_manifest(bad, {"kind": "tokens", "target": str(tmp_path / "no-such-model")}, [meta])
    assert cli_main([str(bad), "--samples", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    why = [line for line in lines if line.startswith("showing token ids: no tokenizer loads")]
    assert len(why) == 1 and "no-such-model" in why[0] and "[0] tokens 121" in "\n".join(lines)
    assert cli_main([str(bad), "--samples", "1", "--target", "smollm2"]) == 0
    assert "[[Paris.<|eot_id|>]]" in capsys.readouterr().out
