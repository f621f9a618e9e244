"""A real tiny training run's export carries its model card and provenance, and `eyas export`
of the run's checkpoint writes the same card (less the real decoding the run did afterwards)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from eyas.data.store.dataset import open_dataset
from eyas.data.store.shards import write_manifest, write_shard
from eyas.data.produce.vocab import count_tokens
from eyas.models.serving.card import CARD, PROVENANCE, serve_commands
from eyas.models.serving.validate import validate
from eyas.train.cli import main

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 512, "seed": 0}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def dataset_with_lineage(tmp_path_factory, tiny_llama_dataset):
    """The tiny hidden-state dataset, with the lineage a real pipeline records in its manifest:
    the token dataset it was extracted from and `eyas prepare`'s summary holding the data card
    of `eyas generate` (sampling settings, prompts' SHA-256)."""
    root = tmp_path_factory.mktemp("lineage")
    src = open_dataset(tiny_llama_dataset)
    tokens = root / "tokens"
    write_manifest(tokens, {"kind": "tokens", "target": "tiny-llama"},
                   [write_shard(tokens, 0, [{k: src[i][k] for k in ("input_ids", "loss_mask")}
                                            for i in range(len(src))])])
    hidden = root / "hidden"
    shutil.copytree(tiny_llama_dataset, hidden)
    card = {"kind": "eyas.generate.card", "file": "conv.jsonl", "sha256": "ab" * 32,
            "endpoint": "http://localhost:8000/v1", "model": "tiny-llama", "sampling": SAMPLING,
            "prompts": "prompts.jsonl", "prompts_sha256": "cd" * 32, "samples_per_prompt": 1,
            "matches_input": True}
    prepare = {"input": "conv.jsonl", "input_sha256": "ab" * 32, "records": len(src),
               "samples": len(src), "max_length": 2048, "generation_card": card}
    write_manifest(hidden, {**src.manifest, "prepare": prepare,
                            "tokens_dataset": {"path": str(tokens), "n_samples": len(src)}})
    return hidden, tokens


def _train(run_dir: Path, dataset: Path) -> None:
    args = [sys.executable, str(ROOT / "train" / "main.py"), "target=tiny_llama",
            f"data.dataset={dataset}", f"hydra.run.dir={run_dir}", "drafter.attention=eager",
            "drafter.ttt_steps=3", "drafter.draft_vocab_size=24", "data.token_budget=256",
            "data.num_workers=1", "train.max_steps=3", "train.log_every=1",
            "data.eval_fraction=0.2", "eval.speculative=true", "eval.num_prompts=1",
            "eval.max_new_tokens=4", "eval.engines=false"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    r = subprocess.run(args, cwd=run_dir.parent, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.slow
def test_the_runs_export_card_and_the_checkpoints_export_card(tmp_path, dataset_with_lineage):
    hidden, tokens = dataset_with_lineage
    run = tmp_path / "r"
    _train(run, hidden)
    export = run / "export"
    summary = json.loads((run / "summary.json").read_text())
    manifest = json.loads((hidden / "manifest.json").read_text())
    prov = json.loads((export / PROVENANCE).read_text())

    # provenance: the datasets' manifest hashes and lineage, the capture contract, the software
    (ds,) = prov["datasets"]
    assert ds["manifest_sha256"] == _sha256(hidden / "manifest.json")
    assert ds["tokens_dataset"]["manifest_sha256"] == _sha256(tokens / "manifest.json")
    assert ds["generation"]["sampling"] == SAMPLING and ds["prepare"]["input_sha256"] == "ab" * 32
    assert prov["capture"]["aux_layer_ids"] == manifest["aux_layer_ids"]
    assert prov["capture"]["fields"]["aux"]["shape"] == manifest["fields"]["aux"]["shape"]
    assert prov["config"]["drafter"]["ttt_steps"] == 3 and prov["config"]["train"]["max_steps"] == 3
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert prov["software"]["eyas"]["commit"] == head
    assert {"torch", "transformers", "accelerate"} <= set(prov["software"]["libraries"])

    # the card: the drafter, its vocabulary coverage, the training and the selected step's τ
    facts = yaml.safe_load((export / CARD).read_text().split("---\n")[1])["eyas"]
    t2d = load_file(str(export / "model.safetensors"))["t2d"]
    counts = count_tokens(open_dataset(hidden), t2d.numel())
    assert 0 < facts["vocab_coverage"] < 1        # 24 ids (17 forced special ids) miss some
    assert facts["vocab_coverage"] == pytest.approx(counts[t2d.numpy()].sum() / counts.sum())
    assert facts["aux_layer_ids"] == manifest["aux_layer_ids"]
    assert facts["draft_vocab_size"] == 24 and facts["target"] == "tiny-llama"
    assert facts["training_steps"] == 3 and facts["selected_step"] == 3
    assert facts["tau"] == pytest.approx(summary["tau"])
    assert facts["datasets"] == [{"path": str(hidden.resolve()),
                                  "manifest_sha256": ds["manifest_sha256"]}]
    text = (export / CARD).read_text()
    assert f"| 0 | {summary['eval']['acc_0']:.3f} | {summary['eval']['cond_acc_0']:.3f} |" in text
    assert "| generation settings | max_tokens=512, seed=0, temperature=0.7, top_p=0.95 |" in text
    assert "cd" * 32 in text and "| `optim.lr` | 0.0001 |" in text
    for cmd in serve_commands("DRAFTER_DIR", "tiny-llama", 3):
        assert cmd in text
    # the real decoding after the export is added to the card, and its SHA-256 re-recorded
    spec = (f"- real speculative decoding on held-out prompts: τ "
            f"{summary['speculative']['tau']:.3f}, identical to the target alone: "
            f"{summary['speculative']['tokens_identical']}\n")
    assert spec in text and prov["checks"]["speculative"]["tau"] == summary["speculative"]["tau"]
    assert validate(export, "tiny-llama") == []

    # `eyas export` of the final checkpoint: the same card, the same record
    ck = run / "checkpoints" / "step-000003"
    assert main(["export", str(ck), str(tmp_path / "again"), "--target-config", "tiny-llama"]) == 0
    # (less the run's own record of what export.select chose: by hand, the checkpoint is chosen)
    def chosen(card):
        return [ln for ln in card.splitlines() if ln.startswith("Exported checkpoint: step 3 ")]

    assert chosen(text) == ["Exported checkpoint: step 3 (selected: best, τ "
                            f"{summary['tau_trajectory']:.3f}; last step 3, τ "
                            f"{summary['tau_trajectory']:.3f})."]
    by_hand = (tmp_path / "again" / CARD).read_text()
    assert chosen(by_hand) == ["Exported checkpoint: step 3 (selected: checkpoint)."]
    assert by_hand.replace(chosen(by_hand)[0], chosen(text)[0]) == text.replace(spec, "")
    again = json.loads((tmp_path / "again" / PROVENANCE).read_text())
    prov["checks"].pop("speculative")
    assert again.pop("selected") == {"step": 3, "by": "checkpoint"}
    assert prov.pop("selected")["by"] == "best" and again == prov
    assert validate(tmp_path / "again", "tiny-llama") == []
