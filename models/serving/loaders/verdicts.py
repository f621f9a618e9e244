"""A markdown table of which faults each engine's own loader catches, for a set of exports.

    rows = [(case, validator_codes, {"vllm": EngineReport, "sglang": EngineReport}), ...]
    print(verdict_table(rows))

Each engine cell says what happened when the engine loaded the export:
  **raises** `Type` — the engine's own code refuses it (a server would not start);
  *silent* → probe `CODE` — the engine loads it without a word and only the eyas probe
      (sentinels, weight-loader recording, smoke logits, resolved aux layers) notices;
  silent — loads and nothing notices: only the static validator (`eyas validate`) can.
"""

from __future__ import annotations

from typing import Sequence

from eyas.models.serving.loaders.check import ENGINE_NAMES, EngineReport

_SHORT = {"ENGINE_DROPPED": "dropped", "ENGINE_UNWRITTEN": "unwritten",
          "ENGINE_LM_HEAD_FROM_TARGET": "lm_head from target", "ENGINE_NONFINITE": "NaN",
          "ENGINE_SMOKE": "smoke", "ENGINE_AUX_LAYERS": "aux layers",
          "ENGINE_NORM_BEFORE_RESIDUAL": "norm_before_residual differs",
          "ENGINE_EMBED_SOURCE": "embedding source differs"}


def verdict(rep: EngineReport) -> tuple[str, str]:
    """(category, cell text): category is "raises", "probe", "silent" or "unavailable"."""
    codes = [f.code for f in rep.findings]
    if "ENGINE_UNAVAILABLE" in codes:
        return "unavailable", "n/a (engine unavailable)"
    if "ENGINE_LOAD_ERROR" in codes or "ENGINE_CRASH" in codes:
        kind = (rep.error or {}).get("type", "crash")
        stage = "config" if (rep.error or {}).get("stage") == "config" else "load"
        return "raises", f"**raises** `{kind}` ({stage})"
    if codes:
        probe = []
        for c in codes:
            text = _SHORT.get(c, c)
            if c == "ENGINE_SMOKE" and (rep.error or {}).get("stage") == "smoke":
                text = f"smoke: `{rep.error['type']}` at first use"
            if text not in probe:
                probe.append(text)
        return "probe", "*silent* → probe: " + ", ".join(probe)
    return "silent", "silent"


def verdict_table(rows: Sequence[tuple[str, Sequence[str], dict[str, EngineReport]]],
                  title: str = "") -> str:
    """Markdown: one row per export, a cell per engine, then who catches it."""
    engines = [e for e in ENGINE_NAMES if any(e in r for _, _, r in rows)]
    versions = {e: next(r[e].version for _, _, r in rows if e in r) for e in engines}
    head = ["fault", "`eyas validate`"] + [f"{ENGINE_NAMES[e]} {versions[e]}" for e in engines]
    lines = [title.rstrip("\n"), ""] if title else []
    lines += ["| " + " | ".join(head + ["caught by"]) + " |",
              "|" + "---|" * (len(head) + 1)]
    counts = {"engine raises": 0, "probe only": 0, "validator only": 0, "none": 0}
    for case, codes, reports in rows:
        cells, cats = [], {}
        for e in engines:
            cat, text = verdict(reports[e]) if e in reports else ("unavailable", "n/a")
            cats[e] = cat
            cells.append(text)
        raisers = [ENGINE_NAMES[e] for e in engines if cats[e] == "raises"]
        if raisers:
            who, key = " + ".join(raisers) + " (own code)", "engine raises"
        elif any(c == "probe" for c in cats.values()):
            who, key = "eyas engine probe", "probe only"
        elif codes:
            who, key = "eyas validator only", "validator only"
        elif all(c == "silent" for c in cats.values()):
            who, key = "— (clean: nothing to catch)", None
        else:
            who, key = "nothing", "none"
        if key:
            counts[key] += 1
        vcodes = ", ".join(f"`{c}`" for c in sorted(codes)) or "—"
        lines.append("| " + " | ".join([f"`{case}`", vcodes] + cells + [who]) + " |")
    lines.append("")
    lines.append(f"{sum(counts.values())} broken exports: an engine's own loader raises on "
                 f"{counts['engine raises']}"
                 f", only the eyas probe around the engines' loaders catches "
                 f"{counts['probe only']}, only the static validator catches "
                 f"{counts['validator only']}"
                 + (f", nothing catches {counts['none']}" if counts["none"] else "") + ".")
    return "\n".join(lines) + "\n"
