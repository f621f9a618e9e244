"""Numerical check of an export: the engines' math on the exported tensors reproduces the trainer.

The exported directory is loaded the way vLLM/SGLang load it (layout-A names, d2t scatter onto
the target vocabulary, the target's embedding) into `models.serving.reference.EngineDrafter`, which
decodes a few random packed documents with a KV cache, step by step (`serve_packed`). The same
rows go through the training forward (`models.drafter.Eagle3Drafter`, TTT unroll, eager
attention) built from the exported tensors, or from the trainer's own state dict when one is
given (then a corrupted export is caught too, e.g. a transposed square `o_proj`). Both run in
fp32 on identical inputs, so any difference above float noise means the trained function is
not the served one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from eyas.data.store.vocab_map import VocabMap
from eyas.models.serving.contract import ERROR, Finding, TensorDir, read_config

log = logging.getLogger(__name__)


def target_embedding(target_weights: str | Path, vocab_size: int, hidden: int) -> torch.Tensor:
    """The target's input embedding [V, H] from its safetensors (any `*embed_tokens.weight`)."""
    tdir = TensorDir(target_weights)
    names = [n for n in tdir.names if n.endswith("embed_tokens.weight")
             and tdir.shape(n) == (vocab_size, hidden)]
    if len(names) != 1:
        seen = [(n, tdir.shape(n)) for n in tdir.names if n.endswith("embed_tokens.weight")]
        raise ValueError(f"{target_weights}: expected one embed_tokens.weight of shape "
                         f"[{vocab_size}, {hidden}], found {seen}")
    return tdir.load(names[0])


def random_embedding(vocab_size: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """A seeded N(0, 1) embedding [V, H] (fp32): enough for a self-consistency check."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, hidden, generator=g)


def _packed_rows(cfg: dict[str, Any], lengths: tuple[int, ...], seed: int):
    """input_ids, aux, doc_ids, positions of documents of `lengths` packed back to back."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    doc_ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    input_ids = torch.randint(0, int(cfg["vocab_size"]), (T,), generator=g)
    aux = torch.randn(T, 3 * int(cfg["target_hidden_size"]), generator=g)
    return input_ids, aux, doc_ids, positions


def compare(cfg: dict[str, Any], tensors: Mapping[str, torch.Tensor], embedding: torch.Tensor,
            trainer_state_dict: Mapping[str, torch.Tensor] | None = None, *, ttt_steps: int = 3,
            lengths: tuple[int, ...] = (9, 7), seed: int = 0) -> dict[str, Any]:
    """Max |Δ| between engine-math and training-forward draft logits per step, and the scale.

    Returns {"max_abs_diff": [K floats], "max_abs_logit": float, "argmax_agree": [K floats]}.
    """
    from eyas.models.config import Eagle3Config
    from eyas.models.drafter import Eagle3Drafter
    from eyas.models.serving.reference import EngineDrafter, serve_packed

    f32 = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    emb = embedding.float()
    engine = EngineDrafter.from_tensors(cfg, f32, emb, dtype=torch.float32)

    dcfg = Eagle3Config.from_config_dict(cfg, ttt_steps=ttt_steps)
    # large drafters are built on the meta device (no init, no memory) and take the given
    # tensors by reference; small ones directly (meta init costs seconds of first-use imports)
    n_params = sum(t.numel() for t in f32.values()) + emb.numel()
    with torch.device("meta" if n_params > 100_000_000 else "cpu"):
        drafter = Eagle3Drafter(dcfg, attention="eager")
    # the trainer's tensors as the export must hold them: bf16-rounded, then fp32 like the engine
    if trainer_state_dict is not None:
        from eyas.models.serving.export import normalise_names
        trainer_state_dict = normalise_names(trainer_state_dict)
    src = f32 if trainer_state_dict is None else {
        k: (v.detach().to(torch.bfloat16).float() if v.is_floating_point() else v)
        for k, v in trainer_state_dict.items() if k != "embed_tokens.weight"}
    state = dict(src, **{"embed_tokens.weight": emb})
    if "d2t" not in state:  # full-vocabulary drafter: identity mapping
        state["d2t"] = torch.zeros(dcfg.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in state:
        state["t2d"] = VocabMap.from_d2t(state["d2t"], dcfg.vocab_size).t2d
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.eval()

    input_ids, aux, doc_ids, positions = _packed_rows(cfg, lengths, seed)
    with torch.no_grad():
        out = drafter(input_ids, aux, doc_ids, positions, ttt_steps)
        train_logits = drafter.draft_logits(out.hidden)                 # [K, T, Vd]
    ref = serve_packed(engine, input_ids, aux, doc_ids, positions, ttt_steps)  # [K, T, Vd]
    reached = ~torch.isnan(ref[..., 0])                                  # [K, T]
    if not torch.equal(reached, out.valid):
        raise AssertionError("the engine replay and the training forward disagree on which "
                             "(step, row) pairs exist: TTT alignment differs from serving")
    diffs, agree = [], []
    for k in range(ttt_steps):
        r, t = ref[k][reached[k]], train_logits[k][reached[k]]
        diffs.append(float((r - t).abs().max()) if r.numel() else 0.0)
        agree.append(float((r.argmax(-1) == t.argmax(-1)).float().mean()) if r.numel() else 1.0)
    scale = float(ref[reached].abs().max()) if bool(reached.any()) else 0.0
    return {"max_abs_diff": diffs, "max_abs_logit": scale, "argmax_agree": agree}


def check_numeric(path: str | Path, tcfg: dict[str, Any] | None, *,
                  cfg: dict[str, Any] | None = None,
                  target_weights: str | Path | None = None,
                  trainer_state_dict: Mapping[str, torch.Tensor] | None = None,
                  tol: float = 1e-3) -> list[Finding]:
    """Findings when the served function differs from the trained one (see module docstring).

    `cfg`: the layout-A config the engines read (`validate.served_config`: a speculators config
    flattened); default: the directory's config.json. `tol` is relative to the largest |logit|; with fp32 on both sides agreement is ~1e-6, so
    any real mismatch (alignment, RoPE, residual, name mapping) is orders of magnitude above it.
    """
    path = Path(path)
    cfg = read_config(path) if cfg is None else cfg
    tensors = TensorDir(path).load_all()
    V, H = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    fix = ("report it: the trainer and the engines compute different functions for this config "
           "(or the export does not hold the checkpoint's weights: re-export it)")
    try:
        emb = (target_embedding(target_weights, V, H) if target_weights
               else random_embedding(V, H))
        res = compare(cfg, tensors, emb, trainer_state_dict)
    except (ValueError, KeyError, RuntimeError, AssertionError) as e:
        return [Finding("NUMERIC_LOAD", ERROR, f"the numerical check could not run: {e}",
                        "the engines' loading rules reject this export, or the training "
                        "forward cannot be built from it", fix)]
    log.info("numeric check: max |Δlogit| per step %s (max |logit| %.3g), argmax agreement %s",
             [f"{d:.2e}" for d in res["max_abs_diff"]], res["max_abs_logit"],
             [f"{a:.3f}" for a in res["argmax_agree"]])
    bound = tol * max(res["max_abs_logit"], 1e-6)
    bad = [k for k, d in enumerate(res["max_abs_diff"]) if not d <= bound]
    if not bad:
        return []
    return [Finding(
        "NUMERIC_MISMATCH", ERROR,
        f"engine-math logits differ from the training forward at steps {bad}: max |Δ| "
        f"{[f'{d:.3g}' for d in res['max_abs_diff']]} vs tolerance {bound:.3g}; argmax "
        f"agreement {[f'{a:.2f}' for a in res['argmax_agree']]}",
        "vLLM/SGLang would serve a different function than the one trained: acceptance "
        "drops without any error", fix)]
