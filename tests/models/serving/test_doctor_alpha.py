"""Expected acceptance α of an export on a dataset: `eyas doctor --data`, `eyas evaluate --data`
(offline_eval) and a float64 reference written here from the definition agree."""

import math

import pytest
import torch

from eyas.data.common.targets import load_embedding_and_head
from eyas.data.store.dataset import open_dataset
from eyas.models.serving.doctor import diagnose, format_report
from eyas.models.serving.doctor_alpha import alpha_on_data
from eyas.models.serving.importer import load_training_drafter
from eyas.models.objective import metric_mask
from eyas.train.evaluate.offline import offline_eval
from tests.train.conftest import build_hidden_dataset

K = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_hidden_dataset(tmp_path_factory.mktemp("hs") / "tiny", "tiny-llama", 6)


def reference(export, data) -> list[float]:
    """α_k from the definition: per sample, float64 softmaxes of the draft logits and of the
    target's logits over the draft vocabulary, Σ_v min, mean over the counted rows."""
    drafter = load_training_drafter(export, "tiny-llama", attention="eager")
    _, head = load_embedding_and_head("tiny-llama")
    ids = torch.arange(drafter.d2t.numel()) + drafter.d2t
    ds = open_dataset(data)
    sums, rows = torch.zeros(K, dtype=torch.float64), torch.zeros(K)
    for i in range(len(ds)):
        s = ds[i]
        T = s["input_ids"].shape[0]
        with torch.no_grad():
            out = drafter(s["input_ids"], s["aux"].reshape(T, -1).float(),
                          torch.zeros(T, dtype=torch.int32),
                          torch.arange(T), K)
        mask = metric_mask(out.valid, s["loss_mask"].bool())
        q = torch.softmax(out.hidden.double() @ drafter.lm_head.weight.double().T, -1)
        p = torch.softmax(s["last"].double() @ head[ids].double().T, -1)            # [T, Vd]
        for k in range(K):
            pk = torch.cat([p[1 + k:], torch.zeros(1 + k, p.shape[1])])[:T]        # index t+1+k
            alpha = torch.minimum(pk, q[k]).sum(-1)
            sums[k] += alpha[mask[k]].sum()
            rows[k] += mask[k].sum()
    return (sums / rows).tolist()


def test_doctor_evaluate_and_reference_agree(small_export, data):
    ref = reference(small_export, data)
    res = alpha_on_data(small_export, data, "tiny-llama", K, samples=100)
    assert res["samples"] == 6 and len(res["alpha"]) == K
    for got, want in zip(res["alpha"], ref):
        assert math.isclose(got, want, rel_tol=5e-3), (res["alpha"], ref)   # bf16 teacher
    assert math.isclose(res["tau_alpha"], 1 + ref[0] + ref[0] * ref[1], rel_tol=1e-2)
    off = offline_eval(small_export, data, k=K, token_budget=4096, target="tiny-llama")
    for j in range(K):
        assert math.isclose(off[f"alpha_{j}"], res["alpha"][j], rel_tol=1e-6)
    report = diagnose(small_export, "tiny-llama", data=data, num_speculative_tokens=K,
                      alpha_samples=100)
    assert report.stats["alpha"] == res
    line = [c for c in report.checked if c.startswith("expected acceptance α per position")]
    assert line and f"chain τ {res['tau_alpha']:.3f} at K {K}" in line[0], \
        format_report(report, small_export)


def test_dataset_without_teacher_is_not_checked(small_export, data, tmp_path):
    import json
    import shutil
    bare = tmp_path / "bare"
    shutil.copytree(data, bare)
    manifest = json.loads((bare / "manifest.json").read_text())
    ds = open_dataset(data)
    from eyas.data.store.shards import write_manifest, write_shard
    samples = [{k: v for k, v in ds[i].items() if k != "last"} for i in range(len(ds))]
    shutil.rmtree(bare)
    meta = write_shard(bare, 0, samples)
    write_manifest(bare, {**manifest, "teacher": "none"}, [meta])
    report = diagnose(small_export, "tiny-llama", data=bare, num_speculative_tokens=K,
                      alpha_samples=8)
    assert "alpha" not in report.stats
    assert any("stores no teacher" in c for c in report.not_checked)
