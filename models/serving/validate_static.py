"""The static rules of the serving contract (models/serving/CONTRACT.md §1-§3), one function
per file.

`check_config(cfg, target_cfg)` reads only the two config dicts; `check_tensors(tdir, cfg,
target_cfg)` reads safetensors headers, the (small) vocabulary mapping (its rules are in
`validate_vocab`) and, optionally, every weight in chunks for NaN/inf. Each rule emits a
`Finding` with a stable code; the codes are listed in `CODES` with their severity so that
documentation and tests can enumerate them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from eyas.models.serving.contract import (ERROR, FLOAT_DTYPES, LAYOUT_A_ARCH,
                                          WARNING, Finding, Findings, TensorDir, all_finite,
                                          config_dims, expected_shapes, is_int,
                                          layout_tensors)
from eyas.models.serving.validate_integrity import INTEGRITY_CODES, magnitude_findings
from eyas.models.serving.validate_rope import ROPE_CODES, check_rope, rope_legacy_findings
from eyas.models.serving.validate_vocab import VOCAB_CODES, check_vocab_map

#: settings that SGLang cannot parse (speculators format) or that one engine reads and the other
#: ignores (use_aux_norm: SGLang's legacy spelling of fc_norm; vLLM knows only fc_norm)
FORBIDDEN_KEYS = ("use_aux_norm", "quantization_config", "logit_scale", "speculators_config",
                  "transformer_layer_config", "speculators_model_type")

#: every code either function can emit -> the severity it is emitted with
CODES = {
    # config.json
    "CONFIG_MISSING": ERROR, "ARCH_NOT_EAGLE": ERROR, "ARCH_NOT_LAYOUT_A": WARNING,
    "MODEL_TYPE": ERROR, "NUM_LAYERS": ERROR, "TARGET_HIDDEN_NULL": ERROR,
    "TARGET_HIDDEN_MISMATCH": ERROR, "HIDDEN_3X": ERROR, "HIDDEN_MISMATCH": ERROR,
    "DIMS_MISSING": ERROR, "HEADS_INDIVISIBLE": ERROR, "HIDDEN_ACT": ERROR,
    "MAX_POS_SHORT": ERROR, "VOCAB_SIZE": ERROR, "DRAFT_VOCAB_MISSING": ERROR,
    "DRAFT_VOCAB_RANGE": ERROR, "TIE_EMBEDDINGS": ERROR, "BIAS_CONFIG": ERROR,
    "NORM_BEFORE_RESIDUAL": ERROR, "AUX_IDS_MISSING": ERROR, "AUX_IDS_MISMATCH": ERROR,
    "AUX_IDS_COUNT": ERROR, "AUX_IDS_ORDER": ERROR, "AUX_IDS_RANGE": ERROR,
    "USE_AUX_OFF": ERROR, "FORBIDDEN_KEY": ERROR, "EAGLE31_FLAG": ERROR, "TORCH_DTYPE": WARNING,
    "ROPE_LEGACY": WARNING, "SPECULATORS_FORMAT": WARNING, **ROPE_CODES,
    # model.safetensors
    "WEIGHTS_MISSING": ERROR, "SHARD_INDEX": ERROR, "SHARD_DUPLICATE": ERROR,
    "NAME_LAYERS0": ERROR, "NAME_MODEL_PREFIX": ERROR, "NAME_FUSED": ERROR,
    "EXTRA_LAYER": ERROR, "BIAS_TENSOR": ERROR, "EXTRA_TENSOR": ERROR, "MISSING_TENSOR": ERROR,
    "LM_HEAD_MISSING": ERROR, "EMBED_SHIPPED": WARNING, "EMBED_WIDTH": ERROR, "SHAPE": ERROR,
    "DTYPE_MIXED": ERROR, "DTYPE_NOT_BF16": WARNING, **VOCAB_CODES, "NONFINITE": ERROR,
    # numerical check (validate_numeric.py)
    "NUMERIC_MISMATCH": ERROR, "NUMERIC_LOAD": ERROR,
    # files and magnitudes (validate_integrity.py)
    **INTEGRITY_CODES,
}

_REEXPORT = "re-export with `eyas export` (it writes this field/tensor correctly)"

#: the `add(code, msg, why, fix, severity=None)` callback each rule group emits its findings to
_Add = Callable[..., None]


def _short(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (f" … (+{len(names) - n})" if len(names) > n else "")


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------

def check_config(cfg: dict[str, Any], tcfg: dict[str, Any] | None) -> list[Finding]:
    """Findings on config.json alone (`tcfg`: the target's text config, or None)."""
    out = Findings(CODES)
    add = out.add
    _config_architecture(cfg, add)
    _config_dims(cfg, tcfg, add)
    _config_sizes(cfg, tcfg, add)
    _config_flags(cfg, add)
    _check_aux_ids(cfg, tcfg, add)
    bad = [k for k in FORBIDDEN_KEYS if k in cfg]
    if bad:
        add("FORBIDDEN_KEY", f"config.json carries {bad}",
            "SGLang cannot parse speculators-format keys; use_aux_norm turns fc_norm on in "
            "SGLang only, so the engines compute different functions",
            "remove them (fc_norm: write \"fc_norm\": true; a speculators config goes in a "
            "separate vLLM-only export)")
    _check_eagle31(cfg, add)
    dt = cfg.get("torch_dtype", cfg.get("dtype"))
    if dt != "bfloat16":
        add("TORCH_DTYPE", f"torch_dtype = {dt!r}; expected 'bfloat16'",
            "engines may serve the drafter in this dtype; the DeepSeek fp16 path rescales "
            "hidden states", 'set "torch_dtype": "bfloat16"')
    return out + rope_legacy_findings(cfg) + check_rope(cfg, tcfg)


def _config_architecture(cfg: dict[str, Any], add: _Add) -> None:
    """ARCH_NOT_EAGLE / ARCH_NOT_LAYOUT_A, MODEL_TYPE and NUM_LAYERS."""
    arch = cfg.get("architectures")
    if not (isinstance(arch, list) and arch and any("Eagle" in str(a) for a in arch)):
        add("ARCH_NOT_EAGLE", f"architectures = {arch!r}; expected [{LAYOUT_A_ARCH!r}]",
            "SGLang loads a class without 'Eagle' as the target model (KeyError 'midlayer…' "
            "or random weights); vLLM renames it to Eagle3<arch>",
            f'set "architectures": ["{LAYOUT_A_ARCH}"]')
    elif arch != [LAYOUT_A_ARCH]:
        add("ARCH_NOT_LAYOUT_A", f"architectures = {arch!r}; layout A uses [{LAYOUT_A_ARCH!r}]",
            f"{LAYOUT_A_ARCH} is the one Llama EAGLE-3 class registered in both vLLM and SGLang",
            f'set "architectures": ["{LAYOUT_A_ARCH}"]')
    if cfg.get("model_type") != "llama":
        add("MODEL_TYPE", f"model_type = {cfg.get('model_type')!r}; expected 'llama'",
            "vLLM rewrites deepseek_v3 drafters to DeepSeek MTP; other types build the wrong "
            "config class", 'set "model_type": "llama"')
    if cfg.get("num_hidden_layers") != 1:
        add("NUM_LAYERS", f"num_hidden_layers = {cfg.get('num_hidden_layers')!r}; expected 1",
            "LlamaConfig defaults to 32 when it is omitted; older SGLang raises unless it is 1",
            'set "num_hidden_layers": 1')


def _config_dims(cfg: dict[str, Any], tcfg: dict[str, Any] | None, add: _Add) -> None:
    """DIMS_MISSING, HEADS_INDIVISIBLE, the TARGET_HIDDEN_* and HIDDEN_* widths, HIDDEN_ACT."""
    d = config_dims(cfg)
    H = d["H"]
    for key, sev in (("hidden_size", ERROR), ("num_attention_heads", ERROR),
                     ("intermediate_size", ERROR), ("num_key_value_heads", WARNING),
                     ("head_dim", WARNING)):
        if not is_int(cfg.get(key)):
            add("DIMS_MISSING", f"{key} = {cfg.get(key)!r}; expected an explicit int",
                "engines fill a missing value from LlamaConfig defaults (e.g. intermediate_size "
                "11008, head_dim = hidden_size // heads), which need not match the weights",
                f"write {key} explicitly", severity=sev)
    if d["nh"] and d["nkv"] and d["nh"] % d["nkv"]:
        add("HEADS_INDIVISIBLE", f"num_attention_heads={d['nh']} is not a multiple of "
            f"num_key_value_heads={d['nkv']}", "grouped-query attention cannot be built",
            "fix the head counts to the trained ones")
    th_raw = cfg.get("target_hidden_size", "absent")
    th = th_raw if is_int(th_raw) else (H if th_raw == "absent" else None)
    if th_raw == "absent":
        add("TARGET_HIDDEN_NULL", "target_hidden_size is absent",
            "engines then assume fc fan-in 3*hidden_size; correct only when the widths match",
            "write target_hidden_size = the target's hidden size (an int)", severity=WARNING)
    elif not is_int(th_raw):
        add("TARGET_HIDDEN_NULL", f"target_hidden_size = {th_raw!r}; expected an int",
            "both vLLM and SGLang crash building fc from None",
            "write target_hidden_size = the target's hidden size (an int)")
    t_hidden = tcfg.get("hidden_size") if tcfg else None
    if t_hidden is not None and th is not None and th != t_hidden:
        add("TARGET_HIDDEN_MISMATCH", f"target_hidden_size = {th} but the target's hidden_size "
            f"is {t_hidden}", "fc's fan-in must be 3 x the target's hidden size: both engines "
            "raise on the fc shape", f"set target_hidden_size = {t_hidden} and retrain fc")
    if H is not None and th is not None and H == 3 * th:
        add("HIDDEN_3X", f"hidden_size = {H} = 3 x target_hidden_size",
            "SGLang then treats the aux states as already fused and skips fc",
            "use the target's hidden size as the drafter width")
    if H is not None and t_hidden is not None and H != t_hidden:
        add("HIDDEN_MISMATCH", f"hidden_size = {H} but the target's hidden_size is {t_hidden}",
            "the drafter runs on the target's embedding table (never shipped): its width must "
            "equal the drafter width, or both engines fail on the embedding shape",
            f"train the drafter with hidden_size = {t_hidden}")
    act = cfg.get("hidden_act")
    if act != "silu":
        add("HIDDEN_ACT", f"hidden_act = {act!r}; expected 'silu'",
            "only the SwiGLU MLP exists in both engines' EAGLE-3 classes",
            'set "hidden_act": "silu" (and train with it)',
            severity=WARNING if act is None else ERROR)


def _config_sizes(cfg: dict[str, Any], tcfg: dict[str, Any] | None, add: _Add) -> None:
    """MAX_POS_SHORT, VOCAB_SIZE and DRAFT_VOCAB_MISSING / DRAFT_VOCAB_RANGE."""
    mpe = cfg.get("max_position_embeddings")
    t_ctx = tcfg.get("max_position_embeddings") if tcfg else None
    if not is_int(mpe) or (t_ctx and mpe < t_ctx):
        add("MAX_POS_SHORT", f"max_position_embeddings = {mpe!r}; the target serves up to "
            f"{t_ctx if t_ctx else 'its context length'}",
            "LlamaConfig defaults to 2048; vLLM before 0.33 hits a device-side assert on longer "
            "prompts", f"set max_position_embeddings >= {t_ctx or 'the target context'}")
    V, Vd = cfg.get("vocab_size"), cfg.get("draft_vocab_size")
    t_vocab = tcfg.get("vocab_size") if tcfg else None
    if not is_int(V) or (t_vocab is not None and V != t_vocab):
        add("VOCAB_SIZE", f"vocab_size = {V!r}; the target's vocabulary is {t_vocab}",
            "vocab_size sizes the target embedding lookup and vLLM's scattered logits; a "
            "mismatch misindexes tokens", f"set vocab_size = {t_vocab or 'the target vocab'}")
    if not is_int(Vd):
        add("DRAFT_VOCAB_MISSING", f"draft_vocab_size = {Vd!r}; expected an int",
            "older SGLang crashes without it; null makes SGLang use the target's head",
            "write draft_vocab_size = lm_head rows")
    elif Vd < 1 or (is_int(V) and Vd > V):
        add("DRAFT_VOCAB_RANGE", f"draft_vocab_size = {Vd} outside [1, vocab_size={V}]",
            "the draft vocabulary is a subset of the target's", "write the lm_head row count")


def _config_flags(cfg: dict[str, Any], add: _Add) -> None:
    """TIE_EMBEDDINGS, BIAS_CONFIG and NORM_BEFORE_RESIDUAL."""
    if cfg.get("tie_word_embeddings", False) is not False:
        add("TIE_EMBEDDINGS", f"tie_word_embeddings = {cfg.get('tie_word_embeddings')!r}",
            "a tied head would reuse the (target) embedding instead of the shipped lm_head",
            'set "tie_word_embeddings": false')
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False) is not False:
            add("BIAS_CONFIG", f"{key} = {cfg.get(key)!r}",
                "vLLM's fused QKV drops q/k/v biases silently; SGLang has no MLP bias",
                f'set "{key}": false and train without biases')
    nbr = cfg.get("norm_before_residual", "absent")
    if nbr == "absent":
        add("NORM_BEFORE_RESIDUAL", "norm_before_residual is not written",
            "vLLM's speculators path defaults it to true; write it so every reader agrees",
            'write "norm_before_residual": false', severity=WARNING)
    elif nbr is not False:
        add("NORM_BEFORE_RESIDUAL", f"norm_before_residual = {nbr!r}",
            "vLLM applies it, SGLang ignores it: the two engines compute different functions, "
            "and eyas trains the un-normed residual", 'set "norm_before_residual": false')


def _check_aux_ids(cfg: dict[str, Any], tcfg: dict[str, Any] | None, add: _Add) -> None:
    """Both spellings present, consistent (vLLM = SGLang + 1), ascending, within the target."""
    ec = cfg.get("eagle_config")
    sg = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
    vl = cfg.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ec, dict) and ec.get("use_aux_hidden_state", True) is not True:
        add("USE_AUX_OFF", f"eagle_config.use_aux_hidden_state = {ec['use_aux_hidden_state']!r}",
            "SGLang then feeds the last hidden state only and skips fc",
            'set eagle_config.use_aux_hidden_state: true')
    fix = ("write both: eagle_aux_hidden_state_layer_ids = [a, b, c] (vLLM, hidden_states "
           "indices) and eagle_config.eagle_aux_hidden_state_layer_ids = [a-1, b-1, c-1] (SGLang)")
    if sg is None:
        add("AUX_IDS_MISSING", "eagle_config.eagle_aux_hidden_state_layer_ids is absent",
            "SGLang then picks its default layers, not necessarily the trained ones", fix)
    if vl is None:
        add("AUX_IDS_MISSING", "top-level eagle_aux_hidden_state_layer_ids is absent",
            "vLLM then reads eagle_config's ids as they are (one layer below SGLang's) or, "
            "without them, its default layers: not the trained ones", fix)
    lists = {}
    for key, ids in (("eagle_aux_hidden_state_layer_ids", vl),
                     ("eagle_config.eagle_aux_hidden_state_layer_ids", sg)):
        if ids is None:
            continue
        if not (isinstance(ids, list) and len(ids) == 3 and all(is_int(i) for i in ids)):
            add("AUX_IDS_COUNT", f"{key} = {ids!r}; expected three ints",
                "fc takes exactly three concatenated target states", fix)
        else:
            lists[key] = ids
    vl, sg = (lists.get("eagle_aux_hidden_state_layer_ids"),
              lists.get("eagle_config.eagle_aux_hidden_state_layer_ids"))
    if vl is not None and sg is not None and vl != [s + 1 for s in sg]:
        same = " (the same ids in both: one key is off by one)" if vl == sg else ""
        add("AUX_IDS_MISMATCH", f"vLLM ids {vl} != SGLang ids {sg} + 1{same}",
            "vLLM uses the top-level ids as is, SGLang adds 1 to eagle_config's: one engine "
            "feeds different layers than trained; loads fine, acceptance collapses silently", fix)
    N = tcfg.get("num_hidden_layers") if tcfg else None
    checks = [("eagle_aux_hidden_state_layer_ids", vl, 0)] if vl is not None else []
    if sg is not None and (vl is None or vl != [s + 1 for s in sg]):
        checks.append(("eagle_config.eagle_aux_hidden_state_layer_ids", sg, 1))
    for key, ids, shift in checks:  # shift: 1 for the SGLang spelling (k-1)
        if any(b <= a for a, b in zip(ids, ids[1:])):
            add("AUX_IDS_ORDER", f"{key} = {ids} is not strictly ascending",
                "both engines concatenate the states in ascending layer order; fc was trained "
                "on [h_a | h_b | h_c] with a < b < c", fix)
        lo, hi = 2 - shift, (N - 1 - shift) if N else None
        if min(ids) < lo or (hi is not None and max(ids) > hi):
            conv = "SGLang (k-1)" if shift else "vLLM / hidden_states[k]"
            add("AUX_IDS_RANGE", f"{key} = {ids} outside [{lo}, {hi if hi is not None else 'N-1'}]"
                f" for a {N or '?'}-layer target in the {conv} convention",
                "ids below the range are usually the other engine's spelling; ids past the "
                "target's depth do not exist; SGLang's DeepSeek path adds 1 only when its first "
                "id is 1", fix)


# ---------------------------------------------------------------------------------------------
# model.safetensors
# ---------------------------------------------------------------------------------------------

def check_tensors(tdir: TensorDir, cfg: dict[str, Any], tcfg: dict[str, Any] | None, *,
                  check_values: bool = True) -> list[Finding]:
    """Findings on tensor names, shapes, dtypes, the vocabulary mapping and (optionally) values."""
    out = Findings(CODES)
    add = out.add
    if not tdir.files:
        add("WEIGHTS_MISSING", f"no *.safetensors file in {tdir.path}",
            "both engines load the drafter's weights from safetensors", _REEXPORT)
        return out
    shapes = expected_shapes(cfg)
    canon, groups, embed = _group_names(tdir.names, shapes)
    _name_findings(groups, add)
    V = (tcfg or {}).get("vocab_size") or config_dims(cfg)["V"]
    _shape_findings(tdir, cfg, tcfg, V, canon, shapes, embed, add)
    _dtype_findings(tdir, canon, add)
    out += check_vocab_map(tdir, canon, cfg, V)
    if check_values:
        bad = [n for n in tdir.names if tdir.dtype(n) in FLOAT_DTYPES
               and not all(all_finite(chunk) for chunk in tdir.chunks(n))]
        if bad:
            add("NONFINITE", f"NaN/inf values in {_short(bad)}",
                "both engines load them without complaint; every draft is garbage",
                "export from a checkpoint before the loss diverged")
        out += magnitude_findings(tdir, canon)
    return out


def _group_names(names: list[str], shapes: dict[str, Any]
                 ) -> tuple[dict[str, str], dict[str, list[str]], str | None]:
    """(layout-A name -> name in the file, the off-layout names by kind, the embedding's name)."""
    canon: dict[str, str] = {}  # layout-A name -> name in the file
    groups: dict[str, list[str]] = {k: [] for k in
                                    ("prefix", "layers0", "layer_n", "fused", "bias", "extra")}
    embed = None
    for name in names:
        c = name
        if c.startswith("model."):
            groups["prefix"].append(name)
            c = c[len("model."):]
        m = re.match(r"layers\.(\d+)\.(.*)", c)
        if m and m.group(1) != "0":
            groups["layer_n"].append(name)
            continue
        if m:
            groups["layers0"].append(name)
            c = "midlayer." + m.group(2)
        if re.search(r"\.(qkv_proj|gate_up_proj)\.", c):
            groups["fused"].append(name)
        elif c.endswith(".bias"):
            groups["bias"].append(name)
        elif c == "embed_tokens.weight":
            embed = name
        elif c in shapes:
            canon[c] = name
        else:
            groups["extra"].append(name)
    return canon, groups, embed


def _name_findings(g: dict[str, list[str]], add: _Add) -> None:
    """NAME_MODEL_PREFIX, NAME_LAYERS0, EXTRA_LAYER, NAME_FUSED, BIAS_TENSOR and EXTRA_TENSOR."""
    if g["prefix"]:
        add("NAME_MODEL_PREFIX", f"names carry a 'model.' prefix: {_short(g['prefix'])}",
            "vLLM adds 'model.' itself and raises 'There is no module or parameter named …'",
            "strip the prefix (" + _REEXPORT + ")")
    if g["layers0"]:
        add("NAME_LAYERS0", f"decoder layer named 'layers.0.': {_short(g['layers0'])}",
            "SGLang before mid-2026 silently ignores 'layers.0.' names and serves a random layer",
            "rename 'layers.0.' to 'midlayer.' (" + _REEXPORT + ")")
    if g["layer_n"]:
        add("EXTRA_LAYER", f"more than one decoder layer: {_short(g['layer_n'])}",
            "both engines build exactly one layer; vLLM raises on the names, SGLang drops them",
            "export a one-layer drafter")
    if g["fused"]:
        add("NAME_FUSED", f"fused projections: {_short(g['fused'])}",
            "both engines fuse q/k/v and gate/up themselves from the separate tensors; a fused "
            "name raises in vLLM and is dropped by SGLang",
            "split into q_proj/k_proj/v_proj and gate_proj/up_proj")
    if g["bias"]:
        add("BIAS_TENSOR", f"bias tensors: {_short(g['bias'])}",
            "vLLM drops q/k/v biases silently and SGLang ignores them: the served function "
            "differs from the trained one", "train and export without biases")
    if g["extra"]:
        add("EXTRA_TENSOR", f"tensors outside layout A: {_short(g['extra'])}",
            "vLLM raises on unknown names; SGLang silently drops them",
            "ship only the layout-A tensors (" + _REEXPORT + ")")


def _shape_findings(tdir: TensorDir, cfg: dict[str, Any], tcfg: dict[str, Any] | None,
                    V: int | None, canon: dict[str, str], shapes: dict[str, Any],
                    embed: str | None, add: _Add) -> None:
    """EMBED_WIDTH / EMBED_SHIPPED, LM_HEAD_MISSING / MISSING_TENSOR and SHAPE."""
    t_hidden = tcfg.get("hidden_size") if tcfg else None
    if embed is not None:
        shp, want_w = tdir.shape(embed), t_hidden or config_dims(cfg)["H"]
        if len(shp) != 2 or (want_w and shp[1] != want_w) or (V and shp[0] != V):
            add("EMBED_WIDTH", f"{embed} has shape {list(shp)}; the target's table is "
                f"[{V}, {want_w}]", "vLLM raises (KeyError 'embed_tokens.weight' / shape "
                "assert) and SGLang fails on the shape", "do not ship embed_tokens")
        else:
            add("EMBED_SHIPPED", f"{embed} is shipped",
                "vLLM uses a shipped embedding instead of the target's while SGLang always "
                "uses the target's: the engines agree only if it is the target's exact table",
                "do not ship embed_tokens (eyas trains with the target's, frozen)")
    for c in layout_tensors(cfg):
        if c not in canon:
            if c == "lm_head.weight":
                add("LM_HEAD_MISSING", "lm_head.weight is not shipped",
                    "vLLM then borrows the target's full head and keeps its first "
                    "draft_vocab_size rows (wrong logits); SGLang leaves it uninitialised",
                    "ship the trained lm_head [draft_vocab_size, hidden_size]")
            else:
                add("MISSING_TENSOR", f"{c} is not shipped",
                    "neither engine reports missing drafter tensors: the parameter stays "
                    "uninitialised memory", _REEXPORT)
    for c, name in canon.items():
        want = shapes.get(c)
        if want is not None and tdir.shape(name) != want:
            add("SHAPE", f"{name} has shape {list(tdir.shape(name))}; config.json implies "
                f"{list(want)}", "vLLM and SGLang raise on a weight of the wrong shape (fc "
                "fan-in, lm_head rows, q_proj input 2H); the config and the weights disagree",
                "export config and weights from the same checkpoint")


def _dtype_findings(tdir: TensorDir, canon: dict[str, str], add: _Add) -> None:
    """DTYPE_MIXED and DTYPE_NOT_BF16."""
    floats = sorted({tdir.dtype(n) for n in tdir.names if tdir.dtype(n) in FLOAT_DTYPES})
    if len(floats) > 1:
        add("DTYPE_MIXED", f"weights mix float dtypes {floats}",
            "engines cast per tensor; mixed dtypes mean parts of the export came from another "
            "source or precision than trained", "export every weight in bf16")
    elif floats and floats != ["BF16"]:
        add("DTYPE_NOT_BF16", f"weights are {floats[0]}, not BF16",
            "eyas trains in bf16; fp16 can overflow the trained bf16 range",
            "export in bf16")
    non_float = [n for c, n in canon.items() if c not in ("d2t", "t2d")
                 and tdir.dtype(n) not in FLOAT_DTYPES]
    if non_float:
        add("DTYPE_MIXED", f"non-float weights: {_short(non_float)}",
            "quantised or integer weights are not part of layout A", "export in bf16")


def _check_eagle31(cfg: dict, add: _Add) -> None:
    """The EAGLE-3.1 flags (norm_before_fc, fc_norm, norm_output): booleans, and norm_before_fc
    spelt alike at the top level and in eagle_config (both engines read eagle_config's first;
    a top-level value that disagrees is what an older reader would use)."""
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        for where, d in (("", cfg), ("eagle_config.", cfg.get("eagle_config") or {})):
            if key in d and not isinstance(d[key], bool):
                add("EAGLE31_FLAG", f"{where}{key} = {d[key]!r}", "the engines test it for "
                    "truth: a string such as \"false\" turns the norm on",
                    f'write "{key}": true or false')
    inner = (cfg.get("eagle_config") or {}).get("norm_before_fc")
    if inner is not None and "norm_before_fc" in cfg and bool(inner) != bool(cfg["norm_before_fc"]):
        add("EAGLE31_FLAG", f"norm_before_fc = {cfg['norm_before_fc']!r} but "
            f"eagle_config.norm_before_fc = {inner!r}", "vLLM and SGLang use eagle_config's "
            "value; other readers the top-level one", "write the same value in both places")
