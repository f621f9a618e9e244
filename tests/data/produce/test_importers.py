"""Importers: SpecForge .ckpt and speculators hs_*.safetensors fixtures (generated in their exact
layouts) converted to eyas datasets and compared tensor by tensor."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from eyas.data.store.format import DatasetError
from eyas.data.produce.importers import import_hidden_states
from eyas.data.store.shards import open_dataset
from eyas.data.common.targets import load_target_config
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "import")

TH = 64          # tiny-llama hidden size (real: 4096 for Llama-3.1-8B)
LAYERS = [2, 4, 5]  # default_aux_layer_ids(8)


def _sample(T, gen):
    return (torch.randint(0, 49152, (T,), generator=gen), torch.randint(0, 2, (T,), generator=gen),
            torch.randn(T, 3 * TH, generator=gen).bfloat16(),
            torch.randn(T, TH, generator=gen).bfloat16())


def _write_specforge(root, lengths, *, renamed=False):
    """Files as SpecForge's prepare_hidden_states.py saves them: rows_<a>-<b>/data_<idx>.ckpt."""
    gen = torch.Generator().manual_seed(0)
    ref = []
    for idx, T in enumerate(lengths):
        ids, mask, aux, last = _sample(T, gen)
        if renamed:   # the offline dataset's in-memory names
            d = {"input_ids": ids, "loss_mask": mask, "hidden_state": aux[None],
                 "target": last[None]}
        else:
            d = {"input_ids": ids, "loss_mask": mask, "hidden_state": last[None],
                 "aux_hidden_state": aux[None]}
        sub = root / "rows_0-5000"
        sub.mkdir(parents=True, exist_ok=True)
        torch.save(d, sub / f"data_{idx}.ckpt")
        ref.append((ids, mask, aux, last))
    return ref


@pytest.mark.parametrize("renamed", [False, True])
def test_specforge_round_trip(tmp_path, renamed):
    # 12 files: data_10 / data_11 must sort after data_2 (natural order = sample order)
    ref = _write_specforge(tmp_path / "sf", [3 + i for i in range(12)], renamed=renamed)
    m = import_hidden_states("specforge", tmp_path / "sf", tmp_path / "out", target="tiny-llama",
                             shard_bytes=4000)
    assert m["n_samples"] == 12 and m["n_shards"] > 1
    assert m["aux_layer_ids"] == LAYERS and m["convention"] == "hf_hidden_states"
    assert m["teacher"]["last"] == "post_norm" and m["import"]["source"] == "specforge"
    ds = open_dataset(tmp_path / "out", verify="checksum")
    for i, (ids, mask, aux, last) in enumerate(ref):
        s = ds[i]
        assert torch.equal(s["input_ids"], ids) and torch.equal(s["loss_mask"], mask.bool())
        assert torch.equal(s["aux"], aux.reshape(-1, 3, TH))   # [h_a | h_b | h_c] -> [T, 3, tH]
        assert torch.equal(s["aux"][:, 1], aux[:, TH:2 * TH])
        assert torch.equal(s["last"], last)


def test_specforge_errors(tmp_path):
    _write_specforge(tmp_path / "sf", [4])
    with pytest.raises(DatasetError, match=r"\[4, 3\*4096\].*wrong --target") as e:
        import_hidden_states("specforge", tmp_path / "sf", tmp_path / "o", target="llama-3.1-8b")
    assert "data_0.ckpt" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"no \*.ckpt"):
        import_hidden_states("specforge", tmp_path / "empty", tmp_path / "o2", target="tiny-llama")
    torch.save({"input_ids": torch.zeros(3)}, tmp_path / "sf" / "rows_0-5000" / "data_1.ckpt")
    with pytest.raises(DatasetError, match="expected input_ids, loss_mask and aux_hidden_state"):
        import_hidden_states("specforge", tmp_path / "sf", tmp_path / "o3", target="tiny-llama")
    with pytest.raises(ValueError, match="three strictly ascending"):
        import_hidden_states("specforge", tmp_path / "sf", tmp_path / "o4", target="tiny-llama",
                             layers=[4, 2, 5])


def test_import_applies_the_aux_layer_rule_before_reading(tmp_path):
    (tmp_path / "sf").mkdir()
    (tmp_path / "sf" / "data_0.ckpt").write_bytes(b"not a torch.save file")
    for layers, why in (([1, 4, 5], "the lowest id 1 is below 2"),
                        ([2, 4, 8], "the highest id 8 is not below the 8 decoder layers")):
        with pytest.raises(ValueError, match=rf"aux layer ids {re.escape(str(layers))} are "
                                             rf"invalid for a target with 8 decoder layers: "
                                             rf"{why}; expected .*\(the default is \[2, 4, 5\]\)"):
            import_hidden_states("specforge", tmp_path / "sf", tmp_path / "out",
                                 target="tiny-llama", layers=layers)
    assert list((tmp_path / "out").iterdir()) == []       # nothing written


def test_import_names_file_keys_and_fix(tmp_path, capsys):
    from eyas.data.common.log import run_command
    _write_specforge(tmp_path / "sf", [4])
    f = tmp_path / "sf" / "rows_0-5000" / "data_0.ckpt"
    d = torch.load(f)
    del d["loss_mask"]
    torch.save(d, f)
    with pytest.raises(DatasetError) as e:
        import_hidden_states("specforge", tmp_path / "sf", tmp_path / "o1", target="tiny-llama")
    assert str(e.value) == (
        f"{f}: keys ['aux_hidden_state', 'hidden_state', 'input_ids'] lack ['loss_mask']: "
        f"expected input_ids, loss_mask and aux_hidden_state (+ hidden_state), or input_ids, "
        f"loss_mask, hidden_state and target (SpecForge offline hidden states); check the source "
        f"type and folder, or re-create the file with that tool")
    torch.save({"input_ids": torch.zeros(3), "hidden_states": []}, tmp_path / "v1.pt")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1.pt").rename(tmp_path / "v1" / "data_0.pt")
    with pytest.raises(DatasetError, match=r"keys \['hidden_states', 'input_ids'\] lack "
                                           r"\['loss_mask'\]: expected input_ids, loss_mask and "
                                           r"hidden_states \(speculators per-sample .pt\)"):
        import_hidden_states("speculators", tmp_path / "v1", tmp_path / "o2",
                             target="tiny-llama", keep_prenorm=True)
    _write_speculators(tmp_path / "spec", [3, 4])
    hs = tmp_path / "spec" / "hidden_states" / "hs_1.safetensors"
    hs.write_bytes(hs.read_bytes()[:200])                     # truncated
    rc = run_command("eyas import", cli_main, [
        "speculators", str(tmp_path / "spec"), "--out", str(tmp_path / "o3"),
        "--target", "tiny-llama", "--loss-mask", "all", "--keep-prenorm"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"eyas import: {hs}: unreadable safetensors file (")
    assert err.endswith("); re-create it, or move it out of the folder to import the others\n")


def _local_target(root):
    """A target directory: tiny-llama's config.json + a safetensors with a random final norm."""
    root.mkdir()
    cfg = load_target_config("tiny-llama")
    (root / "config.json").write_text(json.dumps(cfg))
    w = (torch.rand(TH, generator=torch.Generator().manual_seed(3)) + 0.5).bfloat16()
    save_file({"model.norm.weight": w, "lm_head.weight": torch.zeros(4, TH).bfloat16()},
              str(root / "model.safetensors"))
    return w, cfg["rms_norm_eps"]


def _write_speculators(root, lengths):
    """vLLM extraction output as speculators reads it: hidden_states/hs_<i>.safetensors with
    token_ids [T] and hidden_states [T, 4, tH] (3 aux layers, then the last layer pre-norm)."""
    gen = torch.Generator().manual_seed(1)
    (root / "hidden_states").mkdir(parents=True)
    ref = []
    for i, T in enumerate(lengths):
        ids = torch.randint(0, 49152, (T,), generator=gen)
        hs = (torch.randn(T, 4, TH, generator=gen) * 4).bfloat16()
        save_file({"token_ids": ids, "hidden_states": hs},
                  str(root / "hidden_states" / f"hs_{i}.safetensors"))
        ref.append((ids, hs))
    return ref


def _reference_norm(x, w, eps):
    # transformers' LlamaRMSNorm: fp32 statistics, cast back, then the weight
    h = x.float()
    h = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    return w * h.bfloat16()


def test_speculators_round_trip(tmp_path):
    w, eps = _local_target(tmp_path / "target")
    ref = _write_speculators(tmp_path / "spec", [5, 9, 2, 7, 3, 4, 6, 8, 5, 5, 3])
    m = import_hidden_states("speculators", tmp_path / "spec", tmp_path / "out",
                             target=tmp_path / "target", loss_mask="all")
    assert m["teacher"]["last"] == "post_norm" and m["import"]["loss_mask"] == "all_ones"
    ds = open_dataset(tmp_path / "out", verify="checksum")
    assert len(ds) == 11
    for i, (ids, hs) in enumerate(ref):
        s = ds[i]
        assert torch.equal(s["input_ids"], ids) and s["loss_mask"].all()
        assert torch.equal(s["aux"], hs[:, :3])
        torch.testing.assert_close(s["last"], _reference_norm(hs[:, 3], w, eps), rtol=0, atol=0)
    m = import_hidden_states("speculators", tmp_path / "spec", tmp_path / "raw",
                             target=tmp_path / "target", loss_mask="all", keep_prenorm=True,
                             aux_format="fp8")
    assert m["teacher"]["last"] == "pre_norm" and m["aux_format"] == "fp8"
    ds = open_dataset(tmp_path / "raw")
    assert torch.equal(ds[1]["last"], ref[1][1][:, 3])


def test_speculators_needs_masks_or_opt_out(tmp_path):
    _local_target(tmp_path / "target")
    _write_speculators(tmp_path / "spec", [3])
    try:
        import datasets  # noqa: F401
        pytest.skip("datasets is installed: the preprocessed-dataset path is taken")
    except ImportError:
        pass
    with pytest.raises(DatasetError, match="pip install datasets.*--loss-mask all"):
        import_hidden_states("speculators", tmp_path / "spec", tmp_path / "out",
                             target=tmp_path / "target")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_speculators_v1_pt_layout(tmp_path):
    w, eps = _local_target(tmp_path / "target")
    gen = torch.Generator().manual_seed(2)
    (tmp_path / "v1").mkdir()
    ids, mask = torch.randint(0, 100, (6,), generator=gen), torch.tensor([0, 0, 1, 1, 1, 0])
    states = [torch.randn(6, TH, generator=gen).bfloat16() for _ in range(4)]
    torch.save({"input_ids": ids, "loss_mask": mask, "hidden_states": states},
               tmp_path / "v1" / "data_0.pt")
    import_hidden_states("speculators", tmp_path / "v1", tmp_path / "out",
                         target=tmp_path / "target")
    s = open_dataset(tmp_path / "out")[0]
    assert torch.equal(s["loss_mask"], mask.bool()) and torch.equal(s["aux"][:, 2], states[2])
    assert torch.equal(s["last"], _reference_norm(states[3], w, eps))


def test_cli(tmp_path, capsys):
    _write_specforge(tmp_path / "sf", [4, 5])
    assert cli_main(["specforge", str(tmp_path / "sf"), "--out", str(tmp_path / "out"),
                     "--target", "tiny-llama", "--layers", "2,3,6", "--aux-format", "fp8"]) == 0
    assert "imported 2 samples (9 tokens)" in capsys.readouterr().out
    ds = open_dataset(tmp_path / "out")
    assert ds.manifest["aux_layer_ids"] == [2, 3, 6] and ds.aux_format == "fp8"
    with pytest.raises(FileExistsError):
        cli_main(["specforge", str(tmp_path / "sf"), "--out", str(tmp_path / "out"),
                  "--target", "tiny-llama"])
