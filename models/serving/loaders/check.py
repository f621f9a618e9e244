"""Load an exported drafter with vLLM's and SGLang's own loaders and judge what they did.

`check_engines(export_dir, target_config)` runs `probe_<engine>.py` in each engine's private
venv (venvs.py; created on first use), over the export and a directory holding only the
target's config.json (no target weights, no tokenizer), and turns the probe's raw facts into
an `EngineReport` per engine with `Finding`s (the same type `eyas validate` reports).

Finding codes (all errors except ENGINE_EMBED_SOURCE, a warning):
  ENGINE_LOAD_ERROR     the engine raised while reading the config or loading the weights
  ENGINE_CRASH          the engine killed the probe process (segfault, abort, out of memory)
  ENGINE_DROPPED        checkpoint tensors that reached no parameter, silently
  ENGINE_UNWRITTEN      parameters never written that the engine does not take from the target
  ENGINE_LM_HEAD_FROM_TARGET  no lm_head loaded: the engine serves the target's head instead
  ENGINE_NONFINITE      NaN/inf in a loaded parameter
  ENGINE_SMOKE          logits not finite or of the wrong width, no or out-of-range id mapping
  ENGINE_AUX_LAYERS     the engine feeds other target layers than trained (eyas_export.json),
                        none, ones past the target's depth, or the two engines differ; or its
                        own code raised while resolving them
  ENGINE_NORM_BEFORE_RESIDUAL  vLLM applies the flag, SGLang does not: different functions
  ENGINE_EMBED_SOURCE   one engine uses the shipped embedding, the other the target's
  ENGINE_UNAVAILABLE    the engine's venv could not be created or the probe failed (no verdict)

The target's embed_tokens is supposed to be unwritten: both engines take it from the target
(reported in `from_target`, not a finding).
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from eyas.data.engine.venvs import (DEFAULT_VERSIONS, ENGINES, EngineSetupError, ensure_venv,
                                  venv_python)
from eyas.models.serving.contract import ERROR, WARNING, Finding

log = logging.getLogger(__name__)

#: printed by a probe once the engine is imported (probe_common.run_jobs)
READY_LINE = "eyas-probe: engine imported"
PROBES = {e: Path(__file__).resolve().parent / f"probe_{e}.py" for e in ENGINES}
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
_FIX = "run `eyas validate DIR --target-config TARGET` for the contract rule behind it"


@dataclass
class EngineReport:
    """What one engine's own loader made of an export (see the module docstring for codes)."""

    engine: str
    version: str
    loaded: bool = False
    """the engine built the drafter and loaded its weights without raising"""
    error: dict[str, Any] | None = None
    """{"stage": config|load|smoke|probe|crash, "type", "message" (the engine's), "where"}"""
    dropped: list[str] = field(default_factory=list)
    """checkpoint tensors that reached no parameter (t2d and SGLang's d2t are consumed otherwise)"""
    unwritten: dict[str, float] = field(default_factory=dict)
    """parameter -> fraction never written by the loader (includes those from the target)"""
    from_target: dict[str, str] = field(default_factory=dict)
    """unwritten-by-design parameters the engine takes from the target when serving"""
    nonfinite: list[str] = field(default_factory=list)
    smoke: dict[str, Any] = field(default_factory=dict)
    resolved: dict[str, Any] = field(default_factory=dict)
    """how the engine read the config: architectures, vocab sizes, aux layers, max length"""
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("findings", "raw")}
        d["findings"] = [f.__dict__ for f in self.findings]
        d["ok"] = self.ok
        return d


# ---------------------------------------------------------------------------------------------
# Target directory: the engines need only config.json
# ---------------------------------------------------------------------------------------------

def write_target_dir(target_config: dict | str | Path, out: Path) -> Path:
    """`out/config.json` = the target's config (preset name, config.json, directory or dict).

    The full config is written (Kimi-K2.5's multimodal wrapper included): the engines resolve
    the target class from it as a server would."""
    from eyas.data.common.targets import load_target_config
    cfg = target_config if isinstance(target_config, dict) else load_target_config(target_config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------
# Running a probe over many jobs, surviving hard crashes
# ---------------------------------------------------------------------------------------------

def run_probe(engine: str, jobs: list[dict[str, Any]], python: Path, workdir: Path, *,
              timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
    """job id -> the probe's raw record. A job that kills the process gets a `crash` record
    (with the log tail) and the remaining jobs run in a fresh process."""
    results: dict[str, dict[str, Any]] = {}
    pending = list(jobs)
    attempt = 0
    while pending:
        attempt += 1
        jobs_file, out_file = workdir / f"{engine}-jobs-{attempt}.json", workdir / f"{engine}.jsonl"
        log_file = workdir / f"{engine}-{attempt}.log"
        jobs_file.write_text(json.dumps({"jobs": pending}))
        log.info("%s: loading %d drafter dir(s) with the engine's loader (~20 s import)",
                 engine, len(pending))
        with open(log_file, "w") as lf:
            try:
                rc = subprocess.run([str(python), "-I", str(PROBES[engine]), str(jobs_file),
                                     str(out_file)], stdout=lf, stderr=subprocess.STDOUT,
                                    cwd=workdir, timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if out_file.is_file():
            for line in out_file.read_text().splitlines():
                rec = json.loads(line)
                results[rec["id"]] = rec
        left = [j for j in pending if j["id"] not in results]
        if not left:
            break
        text = log_file.read_text()
        tail = text[-3000:]
        if rc == 0 or READY_LINE not in text:  # the probe never got going: not a verdict
            raise EngineSetupError(f"the {engine} probe stopped without a result (exit {rc}):"
                                   f"\n{tail}")
        crashed = left[0]
        results[crashed["id"]] = {"id": crashed["id"], "engine": engine, "ok": False,
                                  "error": {"stage": "crash", "type": f"exit {rc}",
                                            "message": tail, "where": []}}
        pending = left[1:]
    return results


# ---------------------------------------------------------------------------------------------
# Raw probe record -> EngineReport
# ---------------------------------------------------------------------------------------------

def _trained_aux_ids(export_dir: Path) -> list[int] | None:
    """Aux ids (HF hidden_states indices) the drafter was trained on, from eyas_export.json."""
    meta = export_dir / "eyas_export.json"
    try:
        ids = json.loads(meta.read_text()).get("aux_layer_ids")
    except (OSError, ValueError):
        return None
    return list(ids) if isinstance(ids, list) else None


def interpret(rec: dict[str, Any], engine: str, trained_aux: list[int] | None = None
              ) -> EngineReport:
    """Turn a probe record into an EngineReport with its findings."""
    name = ENGINE_NAMES[engine]
    rep = EngineReport(engine=engine, version=rec.get("version", "?"), raw=rec,
                       seconds=float(rec.get("seconds", 0.0)), resolved=rec.get("resolved", {}),
                       smoke=rec.get("smoke", {}), nonfinite=rec.get("nonfinite", []),
                       unwritten=rec.get("unwritten", {}), from_target=rec.get("from_target", {}))
    add = rep.findings.append
    if "probe_error" in rec:
        rep.error = rec["probe_error"]
        add(Finding("ENGINE_UNAVAILABLE", ERROR,
                    f"the {name} probe failed: {rep.error['type']}: {rep.error['message']}",
                    "an eyas probe bug or an unsupported engine version: no verdict",
                    "report it with the engine version; check with the pinned version"))
        return rep
    err = rec.get("error")
    rep.loaded = err is None or err.get("stage") == "smoke"
    rep.error = err
    _load_findings(rep, err, name)
    rep.dropped = [n for n, ps in rec.get("reached", {}).items()
                   if not ps and n not in rec.get("consumed", {})]
    _weight_findings(rep, name)
    _smoke_findings(rep, err, name)
    _aux_findings(rep, name, trained_aux)
    return rep


def _load_findings(rep: EngineReport, err: dict | None, name: str) -> None:
    """The engine crashed, or raised while reading the config or loading the weights."""
    if err and err["stage"] == "crash":
        rep.findings.append(Finding(
            "ENGINE_CRASH", ERROR, f"{name} crashed the process ({err['type']}) while loading "
            f"the export", f"log tail:\n{err['message'][-1500:]}", _FIX))
    elif err and err["stage"] in ("config", "load"):
        where = f" at {err['where'][-1]}" if err.get("where") else ""
        rep.findings.append(Finding(
            "ENGINE_LOAD_ERROR", ERROR,
            f"{name} raised {err['type']} while "
            f"{'reading the config' if err['stage'] == 'config' else 'loading'}"
            f"{where}: {err['message']}",
            f"{name} would refuse to start with this drafter", _FIX))


def _weight_findings(rep: EngineReport, name: str) -> None:
    """Tensors the loader dropped or never wrote, a head taken from the target, NaN/inf."""
    add = rep.findings.append
    if rep.dropped and rep.loaded:
        add(Finding("ENGINE_DROPPED", ERROR,
                    f"{name} silently dropped checkpoint tensors: {rep.dropped}",
                    f"{name}'s EAGLE-3 load_weights skips names it cannot place, without a "
                    "message: the served drafter differs from the exported one", _FIX))
    if not rep.loaded:
        return
    lost = {p: f for p, f in rep.unwritten.items() if p not in rep.from_target}
    if lost:
        add(Finding("ENGINE_UNWRITTEN", ERROR,
                    f"{name} never wrote parameters "
                    + ", ".join(f"{p} ({f:.0%} unwritten)" for p, f in lost.items()),
                    f"{name} does not check for missing tensors: these keep uninitialised "
                    "memory and every draft is garbage", _FIX))
    if "lm_head.weight" in rep.from_target:
        add(Finding("ENGINE_LM_HEAD_FROM_TARGET", ERROR,
                    f"{name} serves {rep.from_target['lm_head.weight']}",
                    "the drafter's trained head is not used: wrong draft logits", _FIX))
    if rep.nonfinite:
        add(Finding("ENGINE_NONFINITE", ERROR, f"NaN/inf in {rep.nonfinite} after {name} "
                    "loaded the export", "every draft is garbage; no engine complains",
                    "export from a checkpoint before the loss diverged"))


def _smoke_findings(rep: EngineReport, err: dict | None, name: str) -> None:
    """The engine's first draft step: raised, or gave non-finite, mis-shaped or unmapped logits."""
    if err and err["stage"] == "smoke":
        rep.findings.append(Finding(
            "ENGINE_SMOKE", ERROR, f"{name}'s logits computation raised {err['type']}: "
            f"{err['message']}", "the first draft step fails at serving time", _FIX))
        return
    if not rep.smoke:
        return
    s, bad = rep.smoke, []
    if not s.get("logits_finite", True):
        bad.append("non-finite draft logits")
    if not s.get("width_ok", True):
        bad.append(f"logits of shape {s.get('logits_shape')}")
    Vd, V = rep.resolved.get("draft_vocab_size"), rep.resolved.get("target_vocab_size")
    if s.get("has_mapping") is False and Vd and V and Vd < V:
        bad.append(f"no draft->target id mapping although draft_vocab_size {Vd} < {V}: "
                   f"draft id i is served as target id i")
    if s.get("mapped_in_range") is False:
        bad.append(f"draft ids mapped to [{s['mapped_min']}, {s['mapped_max']}], outside "
                   f"[0, {rep.resolved.get('target_vocab_size')})")
    if bad:
        rep.findings.append(Finding("ENGINE_SMOKE", ERROR, f"{name} smoke check: "
                                    + "; ".join(bad),
                                    "index errors or garbage at the first draft step", _FIX))


def _aux_findings(rep: EngineReport, name: str, trained_aux: list[int] | None) -> None:
    """The aux layers the engine feeds: unresolvable, none, past the target's depth, or not the
    trained ones."""
    aux = rep.resolved.get("aux_layer_ids")
    n_layers = rep.resolved.get("target_num_layers")
    add = rep.findings.append
    if rep.resolved.get("aux_layer_ids_error"):
        add(Finding("ENGINE_AUX_LAYERS", ERROR, f"{name} raised while resolving the target "
                    f"layers it captures: {rep.resolved['aux_layer_ids_error']}",
                    f"{name} runs the same code when it starts serving: it fails there, or "
                    "feeds the drafter layers it was not trained on",
                    "check that the target's architecture supports EAGLE-3 in "
                    f"{name} and eagle_config.eagle_aux_hidden_state_layer_ids; {_FIX}"))
    if not rep.loaded or aux is None:
        return
    if not aux:
        add(Finding("ENGINE_AUX_LAYERS", ERROR, f"{name} feeds no aux layers "
                    "(use_aux_hidden_state is false): fc is skipped",
                    "the drafter was trained on fc([h_a|h_b|h_c]); it now gets the last "
                    "hidden state only", _FIX))
    elif n_layers and any(i < 0 or i >= n_layers for i in aux):
        add(Finding("ENGINE_AUX_LAYERS", ERROR, f"{name} captures hidden_states{aux} of a "
                    f"{n_layers}-layer target: ids >= {n_layers} are never captured",
                    "fc then receives fewer than three states: a shape error at the first "
                    "draft step", _FIX))
    elif trained_aux and aux != sorted(set(trained_aux)):
        add(Finding("ENGINE_AUX_LAYERS", ERROR,
                    f"{name} feeds the target's hidden_states{aux}; the drafter was "
                    f"trained on hidden_states{sorted(trained_aux)} (eyas_export.json)",
                    "loads fine, acceptance collapses silently", _FIX))


def cross_check(reports: dict[str, EngineReport], trained_aux: list[int] | None) -> None:
    """Findings only visible when both engines ran: they would serve different functions."""
    if not {"vllm", "sglang"} <= set(reports):
        return
    v, s = reports["vllm"], reports["sglang"]
    if not (v.loaded and s.loaded):
        return
    va, sa = v.resolved.get("aux_layer_ids"), s.resolved.get("aux_layer_ids")
    if not trained_aux and va and sa and va != sa:
        for rep in (v, s):
            rep.findings.append(Finding(
                "ENGINE_AUX_LAYERS", ERROR, f"vLLM feeds hidden_states{va} but SGLang "
                f"feeds hidden_states{sa}", "at most one of them matches training: "
                "acceptance collapses silently in the other", _FIX))
    vn = v.resolved.get("norm_before_residual_applied")
    sn = s.resolved.get("norm_before_residual_applied")
    if vn is not None and sn is not None and vn != sn:
        for rep in (v, s):
            rep.findings.append(Finding(
                "ENGINE_NORM_BEFORE_RESIDUAL", ERROR,
                f"norm_before_residual is applied by vLLM ({vn}) but not by SGLang ({sn})",
                "the two engines compute different functions from the same weights",
                "export with norm_before_residual: false"))
    embed = "model.embed_tokens.weight"
    if (embed in v.from_target) != (embed in s.from_target):
        for rep in (v, s):
            rep.findings.append(Finding(
                "ENGINE_EMBED_SOURCE", WARNING,
                f"vLLM uses {'the target' if embed in v.from_target else 'the shipped'} "
                f"embedding, SGLang {'the target' if embed in s.from_target else 'the shipped'} "
                "one", "the engines agree only if the shipped table is the target's exactly",
                "do not ship embed_tokens"))


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------

def _unavailable(engine: str, version: str, why: str) -> EngineReport:
    rep = EngineReport(engine=engine, version=version)
    rep.findings.append(Finding("ENGINE_UNAVAILABLE", ERROR, f"{ENGINE_NAMES[engine]} {version} "
                                f"could not run: {why}", "no verdict from this engine",
                                "see the message; `eyas engines setup` builds the venv"))
    return rep


def check_engines_many(exports: Sequence[tuple[str | Path, dict | str | Path]],
                       engines: Sequence[str] = ENGINES, *, venv_root: str | Path | None = None,
                       versions: dict[str, str] | None = None, num_speculative_tokens: int = 3,
                       setup: bool = True, timeout_s: float | None = None,
                       ) -> list[dict[str, EngineReport]]:
    """`check_engines` for many (export_dir, target_config) pairs: one engine process each."""
    versions = {**DEFAULT_VERSIONS, **(versions or {})}
    with tempfile.TemporaryDirectory(prefix="eyas-engines-") as tmp:
        work = Path(tmp)
        targets: dict[str, Path] = {}
        jobs = []
        for i, (export_dir, tcfg) in enumerate(exports):
            key = json.dumps(tcfg, sort_keys=True) if isinstance(tcfg, dict) else str(tcfg)
            if key not in targets:
                targets[key] = write_target_dir(tcfg, work / f"target{len(targets)}")
            jobs.append({"id": str(i), "draft": str(Path(export_dir).resolve()),
                         "target": str(targets[key]),
                         "num_speculative_tokens": num_speculative_tokens})
        out: list[dict[str, EngineReport]] = [{} for _ in jobs]
        for engine in engines:
            if engine not in ENGINES:
                raise ValueError(f"unknown engine {engine!r}: choose from {', '.join(ENGINES)}")
            version = versions[engine]
            t0 = time.time()
            try:
                venv = ensure_venv(engine, version, root=venv_root) if setup else None
                if venv is None:
                    from eyas.data.engine.venvs import ready_info, venv_dir
                    venv = venv_dir(engine, version, venv_root)
                    if ready_info(venv) is None:
                        raise EngineSetupError(f"no venv at {venv} (run `eyas engines setup`)")
                raw = run_probe(engine, jobs, venv_python(venv), work, timeout_s=timeout_s)
            except (EngineSetupError, OSError) as e:
                log.error("%s unavailable: %s", engine, e)
                for rep in out:
                    rep[engine] = _unavailable(engine, version, str(e)[-3000:])
                continue
            log.info("%s: %d export(s) checked in %.0f s", engine, len(jobs), time.time() - t0)
            for job, rep in zip(jobs, out):
                rep[engine] = interpret(raw[job["id"]], engine,
                                        _trained_aux_ids(Path(job["draft"])))
        for (export_dir, _), rep in zip(exports, out):
            cross_check(rep, _trained_aux_ids(Path(export_dir)))
    return out


def check_engines(export_dir: str | Path, target_config_path: dict | str | Path,
                  engines: Sequence[str] = ENGINES, *, venv_root: str | Path | None = None,
                  **kwargs: Any) -> dict[str, EngineReport]:
    """Load `export_dir` with each engine's own loader, on CPU, and report what happened.

    `target_config_path`: the target's config.json, its directory, an eyas preset name, or the
    dict; only config.json is used. `engines`: any of "vllm", "sglang". `venv_root`: where the
    engine venvs live (default ~/.cache/eyas/engines); missing venvs are created first (several
    GB, minutes, once). Keyword arguments: `versions={"vllm": "0.33.0"}`,
    `num_speculative_tokens`, `setup=False` (never install), `timeout_s`.
    Returns {engine: EngineReport}; `report.ok` is True when the engine raised nothing, dropped
    nothing, left nothing unwritten and the smoke check passed.
    """
    export_dir = Path(export_dir)
    if not (export_dir / "config.json").is_file():
        raise FileNotFoundError(f"{export_dir} has no config.json: pass an exported drafter dir")
    return check_engines_many([(export_dir, target_config_path)], engines, venv_root=venv_root,
                              **kwargs)[0]


def format_reports(reports: dict[str, EngineReport]) -> str:
    lines = []
    for engine, rep in reports.items():
        head = f"{ENGINE_NAMES[engine]} {rep.version}: "
        head += "clean" if rep.ok else f"{len(rep.findings)} finding(s)"
        if rep.loaded:
            head += f" (loaded in {rep.seconds:.1f} s)"
        lines.append(head)
        for p, how in rep.from_target.items():
            lines.append(f"  from the target: {p} <- {how}")
        lines += ["  " + str(f).replace("\n", "\n  ") for f in rep.findings]
    return "\n".join(lines)

