"""benchmarks/side_by_side_table.py: eyas's own train_step.py output (a real CPU run) and the
peer harnesses' record format are grouped by T, compared against the peers of the same length,
and failed or skipped runs stay in the table with their reason (CPU)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


table = _load("side_by_side_table")


def _peer(path: Path, runs: list[dict]) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(dict(meta={}, runs=runs, errors=[])))


def test_real_eyas_rows_and_peer_records_give_per_length_ratios(tmp_path):
    train_step = _load("train_step")
    assert train_step.main(["--target", "tiny-llama", "--tokens", "128", "--ttt", "2",
                            "--cases", "base", "--device", "cpu", "--iters", "1",
                            "--warmup", "1", "--json", str(tmp_path / "eyas-T128.json")]) == 0
    eyas = json.loads((tmp_path / "eyas-T128.json").read_text())["results"][0]
    _peer(tmp_path / "sp-T128" / "speculators_bench.json", [    # wall time: what eyas's is
        dict(mode="fused_adamw", T=128, median_ms=dict(total=40.0, wall=50.0),
             tokens_per_s=3200.0, tokens_per_s_wall=2560.0, MFU_vs_989_sfformula=0.3125,
             peak_mem_GiB=3.5),
        dict(mode="fused_adamw", T=4096, skipped="time budget")])
    _peer(tmp_path / "sf-T128" / "specforge_bench.json", [
        dict(optimizer="fused_adamw", T=128, median_ms=dict(total=80.0), tokens_per_s=1600.0,
             MFU_vs_989=0.2, peak_mem_GiB=4.0)])

    by_t = table.collect(tmp_path)
    assert list(by_t) == [128, 4096]
    rows = {r["name"]: r for r in by_t[128]}
    assert set(rows) == {"eyas `base`", "speculators", "SpecForge"}
    mine = rows["eyas `base`"]
    assert mine["step_ms"] == eyas["step_ms"] and mine["mfu_eyas"] == eyas["mfu_eyas"]
    assert mine["vs_speculators"] == pytest.approx(eyas["tokens_per_s"] / 2560.0, rel=1e-12)
    assert mine["vs_SpecForge"] == pytest.approx(eyas["tokens_per_s"] / 1600.0, rel=1e-12)
    assert rows["SpecForge"]["vs_speculators"] == pytest.approx(0.625)
    assert (rows["speculators"]["step_ms"], rows["speculators"]["clock"]) == (50.0, "wall")
    assert rows["speculators"]["mfu_sf"] == pytest.approx(0.25)       # at the wall-time rate
    assert rows["SpecForge"]["clock"] == "events"          # a file without wall times
    assert rows["speculators"]["vs_SpecForge"] == pytest.approx(1.6)
    assert by_t[4096] == [dict(who="speculators", name="speculators", T=4096,
                               source=str(tmp_path / "sp-T128" / "speculators_bench.json"),
                               error="time budget")]

    text = table.format_tables(by_t)
    assert "| 128 | SpecForge | 80.0 | 1600 | 625.00 | 20.0 % | – | 4.00 | 0.625× | 1.000× |" in text
    assert "| 4096 | speculators | time budget |" in text

    assert table.main([str(tmp_path), "--json", str(tmp_path / "merged.json")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert sorted(merged) == ["128", "4096"] and len(merged["128"]) == 3


def test_an_eyas_case_that_failed_is_listed_with_its_error_and_no_ratio(tmp_path):
    (tmp_path / "eyas-T8192.json").write_text(json.dumps(dict(results=[
        dict(case="fp8-host", tokens=8192, ttt_steps=7, error="OOM: out of memory")])))
    _peer(tmp_path / "sp" / "speculators_bench.json", [
        dict(T=8192, median_ms=dict(total=245.0), tokens_per_s=33439.0)])
    row = table.collect(tmp_path)[8192][0]
    assert row["error"] == "OOM: out of memory" and "vs_speculators" not in row
    assert "| 8192 | eyas `fp8-host` | OOM: out of memory |" in table.format_tables(
        table.collect(tmp_path))


def test_a_folder_without_results_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="no eyas.*json.*nothing to tabulate"):
        table.collect(tmp_path)
    with pytest.raises(SystemExit, match="no such folder"):
        table.collect(tmp_path / "missing")


def test_a_case_that_raises_becomes_its_own_error_row(tmp_path, monkeypatch):
    train_step = _load("train_step")
    real = train_step.run_case

    def flaky(cfg, case, *args, **kwargs):
        if case == "compile":
            raise RuntimeError("inductor: no valid\n  config")
        return real(cfg, case, *args, **kwargs)
    monkeypatch.setattr(train_step, "run_case", flaky)
    out = tmp_path / "eyas.json"
    assert train_step.main(["--target", "tiny-llama", "--tokens", "128", "--ttt", "2",
                            "--cases", "compile,base", "--device", "cpu", "--iters", "1",
                            "--warmup", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["case"] for r in rows] == ["compile", "base"]       # the later case still ran
    assert rows[0]["error"] == "RuntimeError: inductor: no valid config"
    assert "error" not in rows[1] and rows[1]["step_ms"] > 0
