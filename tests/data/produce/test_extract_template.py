"""`eyas extract` refuses a target whose chat template is not the one the token dataset was
rendered with (both capture paths), naming both hashes and the fix; a target with the same
template, or with none to compare, is extracted."""

import json
import shutil
import subprocess
import sys

import pytest

from eyas.data.produce.extract import extract
from eyas.data.produce.prepare import prepare
from eyas.data.common.capture import ExtractError
from eyas.data.common.targets import load_target, load_tokenizer, resolve_target
from eyas.data.common.templates import load_template, template_sha256
from eyas.data.store.shards import open_dataset

CONVS = [[{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."}],
         [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    src = tmp_path_factory.mktemp("conv") / "conv.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVS))
    return src


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory, conversations):
    out = tmp_path_factory.mktemp("tokens") / "ds"
    prepare(conversations, "tiny-llama", out, tokenizer=load_tokenizer("tiny-llama"))
    return out


def own_template():
    return (resolve_target("tiny-llama", need="tokenizer") / "chat_template.jinja").read_text()


def drifted_target(root, where="chat_template.jinja"):
    """A copy of the tiny-llama target whose chat template puts a space after each role marker,
    kept in chat_template.jinja or (that file removed) in tokenizer_config.json."""
    d = root / "drifted"
    shutil.copytree(resolve_target("tiny-llama"), d)
    edited = own_template().replace("<|im_start|>", "<|im_start|> ")
    if where == "tokenizer_config.json":
        (d / "chat_template.jinja").unlink()
        cfg = json.loads((d / where).read_text())
        (d / where).write_text(json.dumps(dict(cfg, chat_template=edited)))
    else:
        (d / where).write_text(edited)
    return d, template_sha256(edited)


def expected(dataset, used, used_sha, target, target_sha, target_dir=None, after=""):
    target_dir = target_dir or target
    return (f"{dataset} was rendered with {used} (sha256 {used_sha[:12]}…, tokenizer "
            f"{resolve_target('tiny-llama')}) but target {target} applies another (sha256 "
            f"{target_sha[:12]}…, in {target_dir}): the drafter would be trained on other turn "
            f"markers than it meets when served. Fix: prepare the conversations again with this "
            f"target's template (`eyas prepare --target {target}`, no --chat-template){after}, "
            f"or, if the server is to apply the dataset's template, write it to "
            f"{target_dir / 'chat_template.jinja'}")


OWN = "its tokenizer's own chat template"


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_cli_refuses_a_target_with_another_template(tmp_path, tokens_dir, where):
    target, sha = drifted_target(tmp_path, where)
    out = tmp_path / "hid"
    r = subprocess.run([sys.executable, "-m", "eyas.train.cli", "extract", "--tokens",
                        str(tokens_dir), "--target", str(target), "--out", str(out),
                        "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "eyas extract: " + expected(
        tokens_dir, OWN, template_sha256(own_template()), target, sha)
    assert not list(out.glob("*.safetensors")) and not (out / "manifest.json").exists()


def test_engine_path_refuses_before_starting_anything(tmp_path, tokens_dir):
    target, sha = drifted_target(tmp_path)
    with pytest.raises(ExtractError) as e:
        extract(tokens_dir, target, tmp_path / "hid", capture="endpoint",
                endpoint="http://127.0.0.1:9")
    assert str(e.value) == expected(tokens_dir, OWN, template_sha256(own_template()), target, sha)


def test_shipped_template_named_in_the_refusal(tmp_path, conversations):
    tokens = tmp_path / "llama-tokens"
    prepare(conversations, "tiny-llama", tokens, chat_template="llama-3.1",
            tokenizer=load_tokenizer("tiny-llama"))
    with pytest.raises(ExtractError) as e:
        extract(tokens, "tiny-llama", tmp_path / "hid", model=load_target("tiny-llama")[0])
    assert str(e.value) == expected(tokens, "chat template 'llama-3.1'",
                                    template_sha256(load_template("llama-3.1")), "tiny-llama",
                                    template_sha256(own_template()),
                                    resolve_target("tiny-llama"))


def test_same_template_or_none_to_compare_is_extracted(tmp_path, tokens_dir):
    model = load_target("tiny-llama")[0]
    extract(tokens_dir, "tiny-llama", tmp_path / "same", model=model)
    bare = tmp_path / "bare"
    shutil.copytree(resolve_target("tiny-llama"), bare)
    (bare / "chat_template.jinja").unlink()          # a target without a template of its own
    extract(tokens_dir, bare, tmp_path / "none", model=model)
    for out in ("same", "none"):
        assert len(open_dataset(tmp_path / out)) == len(CONVS)
