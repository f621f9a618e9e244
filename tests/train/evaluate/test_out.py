"""`eyas evaluate` without --out: the result goes beside the drafter directory (a run's export:
into its run directory), named by the UTC time, never over an earlier result. With --engine: a
missing engine venv is refused before any work, and one that fails after decoding keeps the
decoding's result."""

import json
import re
import time

import pytest

from eyas.data.common.checksums import unlisted
from eyas.data.common.targets import load_target_config
from eyas.models.serving.export import export_drafter
from eyas.train.evaluate.cli import default_out
from functools import partial
from eyas.train.cli import call

cli_main = partial(call, "evaluate")


def test_default_out_takes_the_next_free_name(tmp_path):
    drafter = tmp_path / "run" / "export"
    drafter.mkdir(parents=True)
    while True:   # the two names within one second of UTC time
        first = default_out(drafter)
        first.write_text("{}")
        second = default_out(drafter)
        if second.name.startswith(first.stem):
            break
        first.unlink()
    assert re.fullmatch(r"export-eval-\d{8}-\d{6}\.json", first.name), first.name
    assert first.parent == tmp_path / "run"
    assert second == first.with_name(f"{first.stem}-2.json")


def test_cli_without_out_writes_beside_the_drafter(tiny_drafter, tiny_llama_dataset, tmp_path,
                                                    capsys):
    drafter = tiny_drafter(load_target_config("tiny-llama"), seed=3)
    out = export_drafter(drafter.state_dict(), drafter.config, drafter.d2t, drafter.t2d,
                         tmp_path / "run" / "export",
                         target_config=load_target_config("tiny-llama"))
    before = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    args = ["--drafter", str(out), "--data", str(tiny_llama_dataset), "--k", "2",
            "--token-budget", "256", "--eval-fraction", "0.25"]
    assert cli_main(args) == 0
    assert cli_main(args) == 0
    written = sorted((tmp_path / "run").glob("export-eval-*.json"))
    assert len(written) == 2, written                  # the second run kept the first result
    assert all(json.loads(f.read_text())["num_samples"] == 6 for f in written)
    assert written[0].name[len("export-eval-"):][:15] >= before
    printed = capsys.readouterr().out
    assert [line for line in printed.splitlines() if line.startswith("wrote ")] == [
        f"wrote {f}" for f in sorted(written, key=lambda f: printed.index(str(f)))]
    assert unlisted(out) == []                          # the export itself is unchanged


def _tiny_export(tiny_drafter, path):
    cfg = load_target_config("tiny-llama")
    drafter = tiny_drafter(cfg, seed=3)
    return export_drafter(drafter.state_dict(), drafter.config, drafter.d2t, drafter.t2d, path,
                          target_config=cfg)


def test_engine_without_its_venv_is_refused_before_anything_is_loaded(tiny_drafter, tmp_path,
                                                                     monkeypatch):
    from eyas.data.produce.prompts import prompts_path
    from eyas.data.engine.runner import EngineError
    monkeypatch.setenv("EYAS_ENGINES_ROOT", str(tmp_path / "no-engines"))
    out = _tiny_export(tiny_drafter, tmp_path / "export")
    # a target that cannot load: only a check made before loading it can answer first
    with pytest.raises(EngineError, match=r"eyas engines setup --runtime"):
        cli_main(["--drafter", str(out), "--target", str(tmp_path / "no-such-target"),
                  "--prompts", str(prompts_path("heldout")), "--engine", "vllm", "--k", "2",
                  "--out", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()


def test_an_engine_that_fails_after_decoding_keeps_what_was_computed(tiny_drafter, tmp_path,
                                                                     monkeypatch):
    from eyas.data.produce.prompts import prompts_path
    from eyas.data.engine.runner import EngineError
    from eyas.data.engine.venvs import READY, runtime_engine, venv_dir
    root = tmp_path / "engines"
    venv = venv_dir(runtime_engine(), root=root)
    (venv / "bin").mkdir(parents=True)
    (venv / READY).write_text("{}")          # marked ready, but its interpreter cannot start
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\necho 'a broken engine venv' >&2\nexit 1\n")
    python.chmod(0o755)
    monkeypatch.setenv("EYAS_ENGINES_ROOT", str(root))
    out = _tiny_export(tiny_drafter, tmp_path / "export")
    result = tmp_path / "r.json"
    with pytest.raises(EngineError):
        cli_main(["--drafter", str(out), "--target", "tiny-llama", "--prompts",
                  str(prompts_path("heldout")), "--num-prompts", "1", "--max-new-tokens", "4",
                  "--k", "2", "--engine", "vllm", "--out", str(result)])
    kept = json.loads(result.read_text())
    assert kept["tau"] >= 1.0 and "engine" not in kept
