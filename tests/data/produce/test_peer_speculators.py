"""benchmarks/peer_speculators.py: vLLM speculators' own scripts/train.py (commit c05b95b3)
trains a drafter on a real tiny eyas export (tiny-llama: prepare + extract --teacher last +
export-data --vocab), on the CPU through the script's shims, and eyas's importer reads the
checkpoint it writes (speculators' native format).

Needs the peer source (`$EYAS_SPECULATORS_REPO`, or `.peers/speculators-c05b95b3`, which
`benchmarks/peer_speculators.py --speculators GITDIR` extracts once) and speculators' own
dependencies (pydantic-settings, loguru, datasets); skips without them.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.data.produce.export_data import export_speculators
from eyas.data.produce.extract import extract
from eyas.data.produce.prepare import prepare
from eyas.data.produce.vocab import build_vocab, save_vocab
from eyas.data.common.targets import load_tokenizer, resolve_target
from eyas.data.store.shards import open_dataset
from tests.data.produce.test_export_data import write_conversations

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "peer_speculators.py"
VD = 40
CONVS = [[(f"Question {i}: name a fruit.", "Apple, banana and cherry are fruits. " * (1 + i % 3))]
         for i in range(10)]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _script():
    spec = importlib.util.spec_from_file_location("peer_speculators", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def peer():
    for dep in ("pydantic_settings", "loguru", "datasets"):
        if importlib.util.find_spec(dep) is None:
            pytest.skip(f"speculators' trainer needs {dep}: pip install pydantic-settings loguru "
                        f"'datasets>=4'")
    mod = _script()
    repo = os.environ.get("EYAS_SPECULATORS_REPO")
    if not ((repo and mod._complete(Path(repo))) or mod._complete(mod.PEER_DIR)):
        pytest.skip(f"no speculators source: set EYAS_SPECULATORS_REPO to a checkout at "
                    f"{mod.COMMIT}, or run benchmarks/peer_speculators.py --speculators GITDIR "
                    f"once (extracts it into {mod.PEER_DIR})")
    return mod


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer")
    write_conversations(root / "conv.jsonl", CONVS)
    target = resolve_target("tiny-llama")
    prepare(root / "conv.jsonl", str(target), root / "tokens", tokenizer=load_tokenizer(target))
    extract(root / "tokens", str(target), root / "hidden", teacher="last")
    d2t, t2d = build_vocab(open_dataset(root / "hidden"), VD)
    save_vocab(root / "vocab.safetensors", d2t, t2d)
    export_speculators(root / "hidden", root / "spec", vocab=root / "vocab.safetensors")
    return root, t2d


def test_speculators_trains_and_eyas_imports(peer, export, tmp_path):
    root, t2d = export
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data", str(root / "spec"),
                           "--out", str(run), "--epochs", "1", "--token-budget", "128",
                           "--ttt-steps", "2", "--lr", "1e-3", "--no-check-import"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((run / "result.json").read_text())
    assert r["steps"] >= 1 and r["logged_train_steps"] == r["steps"]
    assert 0 < r["tokens_seen"] <= 128 * r["steps"]
    assert r["settings"]["ttt_steps"] == 2 and r["settings"]["norm_before_residual"] is False
    ckpt = Path(r["checkpoint_dir"])
    assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()

    from eyas.models.serving.importer import import_drafter
    from safetensors.torch import load_file
    d = import_drafter(ckpt)
    assert d.source_format == "speculators"
    assert (d.config.draft_vocab_size, d.config.aux_layer_ids) == (VD, [2, 4, 5])
    assert not d.config.norm_before_fc and not d.config.norm_output
    assert torch.equal(d.t2d, t2d)
    # speculators freezes its lm_head: the target's head rows of the draft vocabulary
    head = load_file(resolve_target("tiny-llama") / "model.safetensors")["lm_head.weight"]
    assert torch.equal(d.state_dict["lm_head.weight"], head[t2d].to(torch.bfloat16))
