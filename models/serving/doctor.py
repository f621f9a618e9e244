"""`eyas doctor`: the likely causes of low acceptance of an exported drafter, in words.

    eyas doctor DIR --target-config TARGET [--data DATASET_DIR] [--num-speculative-tokens K]
                [--concurrency C] [--hardware h100] [--gpus N] [--weight-bytes 2] [--json]

Low acceptance almost never comes with an error message: the engines load a wrong drafter and
serve it. The doctor collects what can be checked offline, before a server starts; what it
checks, its options and its JSON: docs/acceptance.md ("`eyas doctor`").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.data.common.options import option
from eyas.data.common.templates import target_chat_template, template_drift
from eyas.models.serving.contract import (ERROR, WARNING, Finding, TensorDir, is_int,
                                          read_config, require_dir, resolve_target_config)
from eyas.models.serving.doctor_alpha import check_alpha
from eyas.models.serving.doctor_capture import (check_capture, check_served,
                                                 check_trained_target)
from eyas.models.serving.doctor_coverage import vocab_coverage
from eyas.models.serving.doctor_speedup import (check_speedup, deployment_error,
                                                recorded_eval)
from eyas.models.serving.validate import validate
from eyas.models.speedup import HARDWARE

COVERAGE_WARN = 0.95   # below this share of the target's choices in the draft vocabulary: a cause
AGREEMENT_WARN = 0.5   # below this share of trained tokens = target argmax: not target-written


@dataclass
class Report:
    """Likely causes (`findings`), what was checked and found fine, what could not be checked."""

    findings: list[Finding] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def add(self, code: str, severity: str, message: str, why: str, fix: str) -> None:
        self.findings.append(Finding(code, severity, message, why, fix))


def _target_dir(target_config: Any) -> Path | None:
    """A local directory of the target (for its tokenizer files), when one is at hand."""
    if isinstance(target_config, (str, Path)):
        p = Path(target_config).expanduser()
        if p.is_dir():
            return p
        if p.is_file():
            return p.parent
        from eyas.data.common.targets import DEFAULT_CACHE_DIR, LOADABLE
        cached = DEFAULT_CACHE_DIR / "targets" / str(target_config)
        if str(target_config) in LOADABLE and (cached / "config.json").is_file():
            return cached
    return None


def _check_ttt(report: Report, meta: dict[str, Any] | None, k: int | None) -> None:
    ttt = (meta or {}).get("ttt_steps")
    if ttt is None:
        report.not_checked.append("TTT depth: the export has no eyas_export.json with ttt_steps")
        return
    report.stats["ttt_steps"] = ttt
    if k is None:
        report.checked.append(f"trained with a {ttt}-step TTT unroll (serve with "
                              f"num_speculative_tokens <= {ttt})")
    elif k > ttt:
        report.add("TTT_SHORT", WARNING,
                   f"serving {k} speculative tokens but the drafter was trained with {ttt} TTT "
                   f"steps", f"draft positions {ttt + 1}..{k} run on hidden states the drafter "
                   f"never saw in training: their acceptance is near zero and they cost time",
                   f"serve with num_speculative_tokens (vLLM) / speculative-num-steps (SGLang) "
                   f"<= {ttt}, or train with drafter.ttt_steps >= {k}")
    else:
        report.checked.append(f"{k} speculative tokens <= {ttt} TTT steps trained")


def _ints(ids: Any) -> list[int] | None:
    return [int(i) for i in ids] if isinstance(ids, list) and all(map(is_int, ids)) else None


def engine_aux_ids(cfg: dict[str, Any], n_layers: int | None
                   ) -> dict[str, tuple[list[int] | None, str, bool]]:
    """engine -> (the hidden_states ids it captures for this config, where they come from, whether
    they come from the engine's own key). vLLM reads the top-level ids, else eagle_config's ids as
    is, else its default 2, N//2, N-3; SGLang reads eagle_config's ids + 1, else the same default.
    The ids are None when they cannot be known (a default of a target of unknown depth, or ids
    that are not a list of ints: the validator names those)."""
    vl = cfg.get("eagle_aux_hidden_state_layer_ids")
    ec = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    sg = ec.get("eagle_aux_hidden_state_layer_ids")
    default = [2, n_layers // 2, n_layers - 3] if n_layers else None
    absent = "no {} in config.json: its default 2, N//2, N-3"
    if vl:
        vllm = (_ints(vl), "top-level eagle_aux_hidden_state_layer_ids", True)
    elif sg:
        vllm = (_ints(sg), "no top-level eagle_aux_hidden_state_layer_ids: it reads "
                           "eagle_config's (SGLang-spelled) ids as is", False)
    else:
        vllm = (default, absent.format("aux layer ids"), False)
    if sg is not None:
        sg_ids = _ints(sg)
        sglang = (None if sg_ids is None else [i + 1 for i in sg_ids],
                  "eagle_config.eagle_aux_hidden_state_layer_ids + 1", True)
    else:
        sglang = (default, absent.format("eagle_config.eagle_aux_hidden_state_layer_ids"), False)
    return {"vLLM": vllm, "SGLang": sglang}


def _check_aux_ids(report: Report, manifest: dict[str, Any], cfg: dict[str, Any],
                   tcfg: dict[str, Any] | None) -> None:
    """The aux layers the features came from vs the layers each engine will capture."""
    ids = manifest.get("aux_layer_ids")
    conv = manifest.get("convention", "hf_hidden_states")
    if ids is None:
        report.not_checked.append("aux layers: the dataset manifest records no aux_layer_ids")
        return
    if conv != "hf_hidden_states":
        report.not_checked.append(f"aux layers: the manifest uses convention {conv!r}")
        return
    ids = list(ids)
    engines = engine_aux_ids(cfg, (tcfg or {}).get("num_hidden_layers")
                             or manifest.get("num_layers"))
    wrong = {e: (got, src) for e, (got, src, _) in engines.items()
             if got is not None and sorted(set(got)) != sorted(ids)}
    if wrong:
        sg = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        hint = (" — the dataset's ids equal the export's SGLang spelling: the export is off by "
                "one" if cfg.get("eagle_aux_hidden_state_layer_ids") and sg == ids else "")
        report.add("DATA_AUX_IDS", ERROR,
                   f"the drafter was trained on hidden_states{ids} but " + "; ".join(
                       f"{e} captures hidden_states{got} ({src})"
                       for e, (got, src) in wrong.items()) + hint,
                   "fc was fitted to the features of the training layers; fed other layers it "
                   "drafts near-random tokens (reported: position-0 acceptance ~10% instead of "
                   "~45%); nothing fails at load time",
                   f"export with aux ids {ids} (vLLM, top-level "
                   f"eagle_aux_hidden_state_layer_ids) and {[i - 1 for i in ids]} (SGLang, "
                   f"eagle_config.eagle_aux_hidden_state_layer_ids)")
    for e, (got, src, keyed) in engines.items():
        if got is None:
            report.not_checked.append(f"aux layers ({e}): {src}; the ids it captures are not "
                                      f"known here (pass the target's config)")
        elif not keyed and e not in wrong:
            report.not_checked.append(f"aux layers ({e}): {src}, which happen to be the "
                                      f"dataset's hidden_states{ids}: write the key so that "
                                      f"no fallback decides")
    if not wrong and all(keyed and got is not None for got, _, keyed in engines.values()):
        report.checked.append(f"dataset aux layers {ids} = the layers vLLM (top-level ids) and "
                              f"SGLang (eagle_config ids + 1) capture")


def _check_data_target(report: Report, manifest: dict[str, Any],
                       tcfg: dict[str, Any] | None) -> None:
    """The shape of the target the features were extracted from vs the served target's."""
    mt = manifest.get("target_config") or {}
    mt = mt.get("text_config") or mt
    if tcfg is not None:
        pairs = [("hidden_size", manifest.get("hidden_size", mt.get("hidden_size"))),
                 ("vocab_size", manifest.get("vocab_size", mt.get("vocab_size"))),
                 ("num_hidden_layers", manifest.get("num_layers", mt.get("num_hidden_layers")))]
        diff = [(k, v, tcfg.get(k)) for k, v in pairs if v is not None and v != tcfg.get(k)]
        if diff:
            report.add("DATA_TARGET", ERROR,
                       "the dataset was extracted from another target: " + ", ".join(
                           f"{k} {v} (data) vs {t} (target)" for k, v, t in diff),
                       "the drafter learned another model's hidden states and distribution",
                       "extract the features with the target you serve (same weights and "
                       "precision where possible)")
        elif any(v is not None for _, v in pairs):
            report.checked.append(f"dataset target shape matches (manifest target "
                                  f"{manifest.get('target')!r})")


def _check_tokenizer(report: Report, tok: dict[str, Any], tcfg: dict[str, Any] | None,
                     target_dir: Path | None) -> None:
    """The tokenizer and chat template the conversations were rendered with vs the target's."""
    if not tok:
        report.not_checked.append("tokenizer/chat template: the manifest records no tokenizer "
                                  "identity")
        return
    t_vocab = (tcfg or {}).get("vocab_size")
    if t_vocab is not None and tok.get("vocab_size", 0) > t_vocab:
        report.add("DATA_TOKENIZER", ERROR,
                   f"the dataset's tokenizer {tok.get('name_or_path')!r} has {tok['vocab_size']} "
                   f"tokens, more than the target's vocabulary {t_vocab}",
                   "the training tokens come from another tokenizer than the target's",
                   "prepare the conversations with the target's tokenizer")
    if not tok.get("chat_template_sha256"):
        report.not_checked.append("chat template: the manifest records no template hash")
        return
    template = target_chat_template(target_dir) if target_dir else None
    if template is None:
        report.not_checked.append("chat template: no target directory with a tokenizer at "
                                  "hand (pass --target-config as the target's directory)")
        return
    drift = template_drift(tok, template)
    if drift is not None:
        report.add("DATA_TEMPLATE", WARNING,
                   f"the dataset was rendered with chat template {tok.get('chat_template')!r} "
                   f"(sha256 {drift[0][:12]}…) but the target directory's "
                   f"template differs (sha256 {drift[1][:12]}…)",
                   "at serving the tokens around turns (role headers, end-of-turn, thinking "
                   "markers) differ from the ones the drafter was trained on",
                   "prepare the data with the template the server applies (data.produce.prepare "
                   "chat_template=…), or serve with the dataset's template")
    else:
        report.checked.append("dataset chat template = the target's")


def require_dataset(data: str | Path) -> Path:
    """`data` as a finished dataset directory (with its manifest.json), or the usage error
    (exit 2) a command reports for a wrong path."""
    d = require_dir(data, "dataset directory")
    if not (d / "manifest.json").is_file():
        raise FileNotFoundError(f"{d}: no manifest.json in this dataset directory (--data); a "
                                f"finished `eyas extract` output directory has one: pass that "
                                f"directory, or run the extraction to its end")
    return d


def _check_agreement(report: Report, agreement: float | None) -> None:
    """Whether the trained tokens are the target's own greedy choices (target-written data)."""
    if agreement is not None and agreement < AGREEMENT_WARN:
        report.add("DATA_OFF_POLICY", WARNING,
                   f"only {agreement:.1%} of the trained tokens are the target's own greedy "
                   f"choice: the conversations were not written by this target",
                   "at serving the drafter continues the target's own text; trained on another "
                   "model's (or human) text it sees a shifted distribution, and offline "
                   "acceptance measured on this data overstates or misstates the served one",
                   "regenerate the responses with the target (eyas prepare --generate) and "
                   "re-extract")
    elif agreement is not None:
        report.checked.append(f"{agreement:.1%} of the trained tokens are the target's own "
                              f"greedy choice (target-generated data)")


def _check_data(report: Report, data: Path, cfg: dict[str, Any], t2d: torch.Tensor | None,
                tcfg: dict[str, Any] | None, target_dir: Path | None, max_samples: int) -> None:
    """The dataset vs the export; `t2d` None: the draft vocabulary is the full target's."""
    manifest = json.loads((data / "manifest.json").read_text())   # diagnose: require_dataset
    _check_aux_ids(report, manifest, cfg, tcfg)     # the manifest vs the export and the target
    check_capture(report, manifest)
    _check_data_target(report, manifest, tcfg)
    _check_tokenizer(report, manifest.get("tokenizer") or {}, tcfg, target_dir)
    try:
        from eyas.data.store.shards import open_dataset
    except ImportError as e:
        report.not_checked.append(f"draft vocabulary coverage: the dataset reader is not "
                                  f"available ({e})")
        return
    full = t2d is None
    if full:   # every target token can be drafted; the off-policy check still runs
        t2d = torch.ones(int(cfg["vocab_size"]), dtype=torch.bool)
    cov = vocab_coverage(open_dataset(data), t2d, max_samples)
    report.stats["coverage"] = cov
    if cov["token_coverage"] is None:
        report.not_checked.append("draft vocabulary coverage: the dataset has no loss-masked "
                                  "tokens")
        return
    _check_agreement(report, cov["target_agreement"])
    if full:
        report.checked.append("draft vocabulary = the full target vocabulary (coverage 100%)")
        return
    # what a greedy target emits at serving is its own choice: that coverage bounds acceptance
    key = cov["argmax_coverage"] if cov["argmax_coverage"] is not None else cov["token_coverage"]
    text = (f"the draft vocabulary covers {cov['token_coverage']:.1%} of {cov['tokens']} "
            f"assistant tokens" + (f" and {cov['argmax_coverage']:.1%} of the target's own "
                                   f"choices for them" if cov["argmax_coverage"] is not None
                                   else "") + f" ({cov['samples']} samples)")
    if key < COVERAGE_WARN:
        report.add("VOCAB_COVERAGE", WARNING, text,
                   f"a token outside the draft vocabulary can never be drafted: every position "
                   f"where the target wants one is a rejection ({1 - key:.1%} here)",
                   "rebuild the draft vocabulary from data like the served traffic "
                   "(eyas vocab), force in special/template tokens, or use a larger "
                   "draft_vocab_size; a fine-tuned drafter must keep its own mapping")
    else:
        report.checked.append(text)


def diagnose(export_dir: str | Path, target_config: dict | str | Path, *,
             data: str | Path | None = None, num_speculative_tokens: int | None = None,
             max_samples: int = 2000, check_values: bool = True, concurrency: int = 1,
             hardware: str = "h100", gpus: int | None = None, weight_bytes: float = 2.0,
             alpha_samples: int = 0) -> Report:
    """Everything the doctor can tell offline about an export's acceptance (see module doc);
    `concurrency`, `hardware`, `gpus`, `weight_bytes`: the deployment the speedup is predicted
    for (models/serving/doctor_speedup.py); `alpha_samples`: with `data`, score the export's
    expected acceptance α per position on that many samples (models/serving/doctor_alpha.py)."""
    export_dir = Path(export_dir)
    if data is not None:
        data = require_dataset(data)   # a wrong --data is a usage error, before any work
    report = Report()
    report.findings += validate(export_dir, target_config, check_values=check_values)
    if any(f.code == "CONFIG_MISSING" for f in report.findings):
        return report
    if not report.findings:
        report.checked.append("serving contract (config.json and tensors): no findings")
    cfg = read_config(export_dir)
    tcfg = resolve_target_config(target_config)
    meta_file = export_dir / "eyas_export.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    _check_ttt(report, meta, num_speculative_tokens)
    check_trained_target(report, export_dir, target_config, tcfg)
    check_served(report, tcfg)
    check_speedup(report, recorded_eval(export_dir), cfg, tcfg,
                  num_speculative_tokens or (meta or {}).get("ttt_steps"),
                  concurrency=concurrency, hardware=hardware, gpus=gpus,
                  weight_bytes=weight_bytes)
    if data is not None:
        tdir = TensorDir(export_dir)
        t2d = None
        if "t2d" in tdir.names:
            t2d = tdir.load("t2d").bool()
        elif "d2t" in tdir.names:
            from eyas.data.store.vocab_map import VocabMap
            t2d = VocabMap.from_d2t(tdir.load("d2t"), int(cfg["vocab_size"])).t2d
        _check_data(report, data, cfg, t2d, tcfg, _target_dir(target_config), max_samples)
        if alpha_samples:
            manifest = json.loads((data / "manifest.json").read_text())
            check_alpha(report, export_dir, data, manifest.get("target") or target_config,
                        num_speculative_tokens or (meta or {}).get("ttt_steps"), alpha_samples)
    else:
        report.not_checked.append("training data (aux layers, tokenizer, vocabulary coverage): "
                                  "pass --data DATASET_DIR")
    return report


def format_report(report: Report, export_dir: str | Path) -> str:
    lines = []
    n = len(report.findings)
    trained = report.stats.get("trained_target")
    where = f"{export_dir}" + (f" (trained for target {trained})" if trained else "")
    lines.append(f"{n} likely cause(s) of low acceptance for {where}" if n
                 else f"no likely cause of low acceptance found for {where}")
    for i, f in enumerate(sorted(report.findings, key=lambda f: f.severity != ERROR), 1):
        lines += [f"\n{i}. [{f.severity}] {f.code}: {f.message}", f"   why: {f.why}",
                  f"   fix: {f.fix}"]
    if report.checked:
        lines.append("\nchecked and fine:")
        lines += [f"  - {c}" for c in report.checked]
    if report.not_checked:
        lines.append("\nnot checked:")
        lines += [f"  - {c}" for c in report.not_checked]
    return "\n".join(lines)


def report_json(report: Report, export_dir: str | Path) -> str:
    """The report as one JSON object (`eyas doctor --json`): the findings in `eyas validate
    --json`'s form, what was checked, what was not, and the measurements."""
    return json.dumps({"export": str(export_dir),
                       "trained_target": report.stats.get("trained_target"),
                       "findings": [f.__dict__ for f in report.findings],
                       "checked": report.checked, "not_checked": report.not_checked,
                       "stats": report.stats}, indent=2, allow_nan=False)


@dataclass(kw_only=True)
class DoctorOptions:
    """Explain the likely causes of low acceptance of an exported drafter: contract violations,
    data/export mismatches, the target it was trained for, draft vocabulary coverage, TTT depth.
    Exit 0 = nothing found, 1 = likely causes listed, 2 = usage error (e.g. a mistyped path)."""

    dir: str = option(help="the exported drafter directory", positional=True)
    target_config: str = option(help="the target's config.json, its directory (also gives its "
                                "chat template), hub id (org/name[@revision]) or preset name")
    data: str | None = option(
        None, "the hidden-state dataset the drafter was trained on: a finished `eyas extract` "
        "output directory, with its manifest.json (default: none, the data checks are skipped)")
    num_speculative_tokens: int | None = option(
        None, "K you serve with (vLLM num_speculative_tokens, SGLang speculative-num-steps; "
        "default: none, the TTT steps trained are reported)")
    max_samples: int = option(
        2000, "samples read for the vocabulary coverage (spread over the dataset)")
    concurrency: int = option(1, "sequences served at once, for the predicted speedup")
    hardware: str = option("h100", "the GPU the speedup is predicted for",
                           choices=sorted(HARDWARE))
    gpus: int | None = option(
        None, "GPUs the target is spread over (default: the fewest of --hardware whose memory "
        "holds its weights at --weight-bytes, with 20%% to spare)")
    weight_bytes: float = option(2.0, "bytes per target weight (bf16 2, fp8 1, int4 0.5)")
    alpha_samples: int = option(
        64, "with --data: samples on which the export's expected acceptance α per position is "
        "measured against the dataset's stored teacher (loads the target's embedding and "
        "lm_head; 0 skips it)")
    json: bool = option(False, "print the report as one JSON object (findings, checked, not "
                        "checked, stats) instead of text")


    def check(self) -> str | None:
        return deployment_error(self.concurrency, self.gpus, self.weight_bytes)


def main(args: DoctorOptions) -> int:
    """`eyas doctor DIR --target-config FILE [--data DATASET_DIR] [--num-speculative-tokens K]
    [--json]`."""
    require_dir(args.dir)  # a mistyped path is a usage error (2), not a finding (1)
    # a wrong or unfinished --data is refused by diagnose first (require_dataset): exit 2
    report = diagnose(args.dir, args.target_config, data=args.data,
                      num_speculative_tokens=args.num_speculative_tokens,
                      max_samples=args.max_samples, concurrency=args.concurrency,
                      hardware=args.hardware, gpus=args.gpus, weight_bytes=args.weight_bytes,
                      alpha_samples=args.alpha_samples)
    print(report_json(report, args.dir) if args.json else format_report(report, args.dir))
    return 1 if report.findings else 0

