"""The text of an export's model card, rendered from its provenance record (models/serving/card.py).

Every section renders what the record holds and says so when something is unknown: a drafter
exported from a bare state dict has no data card, an eval record without context buckets has
no bucket table.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import yaml

_NONE = "—"
#: resolved-config entries shown in the card's training table (all of it is in the JSON)
CONFIG_SHOWN = ("optim.lr", "optim.schedule", "optim.warmup_steps", "optim.grad_accum",
                "data.token_budget", "data.eval_fraction", "loss.kind", "train.seed",
                "dist.backend")


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return _NONE
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x, digits) for x in v) if v else _NONE
    if isinstance(v, Mapping):       # sorted: the card does not depend on the record's order
        return ", ".join(f"{k}={_fmt(x, digits)}" for k, x in sorted(v.items())) or _NONE
    return str(v)


def _plain(v: Any) -> str:
    """A setting as written (0.0003, 0.7), not rounded like a measured figure."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, Mapping):
        return ", ".join(f"{k}={_plain(x)}" for k, x in sorted(v.items())) or _NONE
    return _fmt(v)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows] + [""]


def front_matter(prov: Mapping[str, Any], **extra: Any) -> str:
    """YAML front matter: `base_model`, tags, and the headline facts (and `extra`) under
    `eyas:`."""
    dr, ev, tr = prov.get("drafter") or {}, prov.get("eval") or {}, prov.get("training") or {}
    sel = prov.get("selected") or {}
    facts = {"target": (prov.get("target") or {}).get("name"),
             "architecture": dr.get("architecture"), "aux_layer_ids": dr.get("aux_layer_ids"),
             "draft_vocab_size": dr.get("draft_vocab_size"), "vocab_size": dr.get("vocab_size"),
             "vocab_coverage": dr.get("vocab_coverage"), "ttt_steps": dr.get("ttt_steps"),
             "training_steps": tr.get("steps"), "training_tokens": tr.get("tokens_seen"),
             "selected_step": sel.get("step"), "tau": ev.get("tau"),
             "tau_trajectory": ev.get("tau_trajectory"),
             "datasets": [{"path": ds.get("path"), "manifest_sha256": ds.get("manifest_sha256")}
                          for ds in prov.get("datasets") or []], **extra}
    meta = {"tags": ["eagle3", "speculative-decoding", "eyas"], "eyas": facts}
    if facts["target"]:
        meta = {"base_model": facts["target"], **meta}
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, default_flow_style=None) + "---\n"


def _drafter_section(prov: Mapping[str, Any], sglang: bool = True) -> list[str]:
    dr = prov.get("drafter") or {}
    cov = dr.get("vocab_coverage")
    rows = [["architecture", dr.get("architecture")],
            ["aux layer ids (vLLM / HF hidden_states)", dr.get("aux_layer_ids")],
            *([["aux layer ids (SGLang)", dr.get("aux_layer_ids_sglang")]] if sglang else []),
            ["hidden size / target hidden size",
             f"{_fmt(dr.get('hidden_size'))} / {_fmt(dr.get('target_hidden_size'))}"],
            ["attention heads / KV heads",
             f"{_fmt(dr.get('num_attention_heads'))} / {_fmt(dr.get('num_key_value_heads'))}"],
            ["draft vocabulary", f"{_fmt(dr.get('draft_vocab_size'))} of "
                                 f"{_fmt(dr.get('vocab_size'))} target ids"],
            ["coverage of the training tokens", _NONE if cov is None else f"{100 * cov:.2f}%"],
            ["TTT steps trained (K)", dr.get("ttt_steps")],
            ["RoPE", f"theta {_plain(dr.get('rope_theta'))}, scaling "
                     f"{_fmt(dr.get('rope_scaling'))}"]]
    return ["## Drafter", ""] + _table(["field", "value"], rows)


def _serving_section(commands: tuple[str, str]) -> list[str]:
    vllm, sglang = commands
    return ["## Serving", "",
            "Replace `DRAFTER_DIR` with this directory's path (or its hub id).", "",
            "vLLM:", "", "```bash", vllm, "```", "", "SGLang:", "", "```bash", sglang, "```",
            ""]


def _vllm_serving_section(vllm: str, k: int) -> list[str]:
    return ["## Serving", "",
            "Replace `DRAFTER_DIR` with this directory's path (or its hub id). SGLang does not "
            "load the speculators format: serve SGLang the layout-A export this directory was "
            "written from.", "",
            f"vLLM, {k} speculative tokens (`speculative_tokens` of config.json):", "",
            "```bash", vllm, "```", "",
            "With a verifier named by a hub id, `vllm serve DRAFTER_DIR` alone also works: "
            "vLLM then takes the verifier and K from config.json.", ""]


def _positions(ev: Mapping[str, Any]) -> list[list[Any]]:
    ks = sorted(int(m.group(1)) for k in ev if (m := re.fullmatch(r"acc_(\d+)", k)))
    return [[k, ev.get(f"acc_{k}"), ev.get(f"cond_acc_{k}")] for k in ks]


def _buckets(rows: list[Mapping[str, Any]]) -> list[list[Any]]:
    return [[b.get("bucket"), b.get("tau"), b.get("cond_acc"), b.get("tokens"), b.get("rounds")]
            for b in rows if isinstance(b, Mapping)]


def _acceptance_section(prov: Mapping[str, Any]) -> list[str]:
    ev, sel = prov.get("eval") or {}, prov.get("selected") or {}
    out = ["## Acceptance (held-out data)", ""]
    if sel:
        how = sel.get("by") or "last"
        out += [f"Exported checkpoint: step {_fmt(sel.get('step'))} (selected: {how}"
                + (f", τ {_fmt(sel.get('tau'))}" if sel.get("tau") is not None else "")
                + (f"; last step {_fmt(sel.get('last_step'))}, τ {_fmt(sel.get('last_tau'))}"
                   if sel.get("last_step") is not None else "") + ").", ""]
    if not ev:
        return out + ["No evaluation record (the drafter was exported without one).", ""]
    out += [f"τ (acceptance length, all starts) {_fmt(ev.get('tau'))}; decoder walk "
            f"{_fmt(ev.get('tau_trajectory'))}; per-position independent "
            f"{_fmt(ev.get('tau_independent'))}.", ""]
    if _positions(ev):
        out += ["By draft position:", ""]
        out += _table(["position", "acceptance", "conditional acceptance"], _positions(ev))
    if isinstance(ev.get("by_context"), list) and ev["by_context"]:
        out += ["By context (position in the sequence where a round starts):", ""]
        out += _table(["bucket", "τ", "conditional acceptance by position", "tokens", "rounds"],
                      _buckets(ev["by_context"]))
    if isinstance(ev.get("by_temperature"), list) and ev["by_temperature"]:
        out += ["By temperature:", ""]
        out += _table(["temperature", "τ", "τ standard error", "offline τ"],
                      [[_plain(t.get("temperature")), t.get("tau"), t.get("tau_se"),
                        t.get("offline_tau")]
                       for t in ev["by_temperature"] if isinstance(t, Mapping)])
    return out


def _speedup_section(prov: Mapping[str, Any]) -> list[str]:
    sp = prov.get("predicted_speedup") or {}
    out = ["## Predicted speedup", ""]
    if not sp.get("rows"):
        return out + [f"Not predicted: {sp.get('skipped') or 'not recorded'}.", ""]
    out += [f"Tokens/s with speculation over tokens/s without, by K (rows) and concurrency "
            f"(columns), from the conditional acceptance by draft position above: "
            f"{sp.get('assumptions')}. Measure it on the deployment with "
            f"`{sp.get('measure')}`.", ""]
    return out + _table(["K"] + [f"concurrency {c}" for c in sp.get("concurrency") or []],
                        [[r[0]] + [None if x is None else f"{x:.2f}" for x in r[1:]]
                         for r in sp["rows"]])


def _dig(cfg: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(cfg, Mapping) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def _training_section(prov: Mapping[str, Any]) -> list[str]:
    tr, cfg = prov.get("training") or {}, prov.get("config") or {}
    if not tr and not cfg:
        return ["## Training", "", "Not recorded.", ""]
    rows = [["optimizer steps", f"{_fmt(tr.get('steps'))} of {_fmt(tr.get('total_steps'))}"],
            ["epochs", _fmt(tr.get("epochs"), 2)],
            ["training tokens (per epoch / seen)",
             f"{_fmt(tr.get('tokens_per_epoch'))} / {_fmt(tr.get('tokens_seen'))}"],
            ["processes", tr.get("world_size")]]
    rows += [[f"`{k}`", _plain(_dig(cfg, k))] for k in CONFIG_SHOWN if _dig(cfg, k) is not None]
    return (["## Training", ""] + _table(["field", "value"], rows)
            + ["The resolved configuration is in `eyas_provenance.json` (`config`).", ""])


def _data_section(prov: Mapping[str, Any]) -> list[str]:
    datasets = prov.get("datasets") or []
    out = ["## Data", ""]
    if not datasets:
        return out + ["Not recorded.", ""]
    for ds in datasets:
        out += [f"### {ds.get('role')}: `{ds.get('path')}`", ""]
        rows = [["manifest.json SHA-256", ds.get("manifest_sha256")],
                ["samples / tokens", f"{_fmt(ds.get('n_samples'))} / {_fmt(ds.get('n_tokens'))}"],
                ["target / weights fingerprint",
                 f"{_fmt(ds.get('target'))} / {_fmt(ds.get('target_fingerprint'))}"]]
        tok = ds.get("tokens_dataset") or {}
        if tok:
            rows.append(["token dataset (manifest SHA-256)",
                         f"`{tok.get('path')}` ({_fmt(tok.get('manifest_sha256'))})"])
        prep = ds.get("prepare") or {}
        if prep:
            rows.append(["prepared from (SHA-256)",
                         f"`{prep.get('input')}` ({_fmt(prep.get('input_sha256'))})"])
        gen = ds.get("generation") or {}
        if gen:
            rows += [["generated by", f"{_fmt(gen.get('model'))} at {_fmt(gen.get('endpoint'))}"],
                     ["generation settings", _plain(gen.get("sampling"))],
                     ["prompts (SHA-256)",
                      f"`{gen.get('prompts')}` ({_fmt(gen.get('prompts_sha256'))}), "
                      f"{_fmt(gen.get('samples_per_prompt'))} sample(s) each"]]
        out += _table(["field", "value"], rows)
    return out


def _checks_section(prov: Mapping[str, Any], of: str = "") -> list[str]:
    checks = prov.get("checks") or {}
    v = checks.get("validator")
    out = ["## Checks", ""] + ([of, ""] if of else [])
    if v is None:
        out.append("- static validator: not run")
    else:
        codes = sorted({f["code"] for f in v.get("findings") or []})
        out.append(f"- static validator (`eyas validate`): {v.get('errors')} error(s), "
                   f"{v.get('warnings')} warning(s)" + (f" ({', '.join(codes)})" if codes else ""))
    engines = checks.get("engines")
    if engines:
        out.append("- engine loaders: " + ", ".join(f"{e} {r}" for e, r in engines.items()))
    else:
        out.append("- engine loaders: not run with this export (`eyas validate DIR "
                   "--target-config TARGET --engines vllm,sglang`)")
    spec = checks.get("speculative")
    if isinstance(spec, Mapping) and spec.get("tau") is not None:
        out.append(f"- real speculative decoding on held-out prompts: τ {_fmt(spec.get('tau'))}, "
                   f"identical to the target alone: {_fmt(spec.get('tokens_identical'))}")
    served = checks.get("served")
    if isinstance(served, Mapping) and served.get("tau") is not None:
        out.append(f"- served by {served.get('build')} {served.get('version')} (speculative "
                   f"decoding, K={served.get('k')}, the same prompts): τ {_fmt(served.get('tau'))} "
                   f"by vLLM's own counters; eyas's counts equal: "
                   f"{_fmt(served.get('counts_equal'))}")
    return out + [""]


def _software_section(prov: Mapping[str, Any]) -> list[str]:
    sw = prov.get("software") or {}
    e = sw.get("eyas") or {}
    commit = e.get("commit")
    commit = _NONE if not commit else commit + (" (with local changes)" if e.get("dirty") else "")
    libs = ", ".join(f"{k} {v}" for k, v in sorted((sw.get("libraries") or {}).items())) or _NONE
    return ["## Software", "", f"- eyas {_fmt(e.get('version'))}, commit {commit}",
            f"- {libs}", ""]


def render_card(prov: Mapping[str, Any], commands: tuple[str, str], *,
                speculators: tuple[str, int] | None = None) -> str:
    """The README.md text of an export with provenance `prov` and serving `commands` (vLLM,
    SGLang). `speculators` = (architecture, K): the card of a speculators-format export (vLLM
    only, K speculative tokens) written from the layout-A export with provenance `prov`; the
    checks shown are those recorded for that export."""
    target = (prov.get("target") or {}).get("name") or "its target"
    if speculators is None:
        view, extra, of, title = prov, {}, "", ""
        loads = "; vLLM and SGLang load this directory as is"
        serving = _serving_section(commands)
    else:
        arch, k = speculators
        view = {**prov, "drafter": dict(prov.get("drafter") or {}, architecture=arch,
                                        aux_layer_ids_sglang=None)}
        extra, of = {"speculative_tokens": k}, ("Recorded for the layout-A export this "
                                                "directory was written from:")
        title = " (speculators format, vLLM only)"
        loads = ", in the speculators format: vLLM loads this directory as is, SGLang does not"
        serving = _vllm_serving_section(commands[0], k)
    lines = [f"# EAGLE-3 drafter for {target}{title}", "",
             f"A speculative-decoding drafter trained with eyas{loads}. Every figure below is "
             "also in `eyas_provenance.json`.", ""]
    for section in (_drafter_section(view, sglang=speculators is None), serving,
                    _acceptance_section(view), _speedup_section(view), _training_section(view),
                    _data_section(view), _checks_section(view, of), _software_section(view)):
        lines += section
    return front_matter(view, **extra) + "\n" + "\n".join(lines).rstrip() + "\n"
