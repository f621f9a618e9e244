"""Load EAGLE-3 drafter directories with SGLang's own loader on CPU. Runs INSIDE the SGLang venv.

    <sglang-venv>/bin/python -I probe_sglang.py JOBS.json OUT.jsonl

The call sequence is SGLang's draft-worker path: ServerArgs(target, speculative_algorithm="EAGLE3",
draft) → publish the runtime context → init the parallel runtime (gloo, once per process) →
ModelConfig.from_server_args(is_draft_model=True) → get_model, which builds the class named by the
draft's `architectures` and runs its `load_weights`. One substitution: the rotary layer is told it
runs on CPU (otherwise it imports `vllm._custom_ops`). `SGLANG_USE_CPU_ENGINE` must stay unset (the
CUDA sgl-kernel then wants libcuda). Around the engine's `DefaultModelLoader.load_weights_only` the
probe sentinel-fills the parameters and records which checkpoint tensor reached which parameter
(_probe_common.py).
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # -I drops the script dir

import torch  # noqa: E402

import _probe_common as pc  # noqa: E402

import sglang  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.configs.device_config import DeviceConfig  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.distributed.bootstrap import init_parallel_runtime  # noqa: E402
from sglang.srt.layers.rotary_embedding import base as rotary_base  # noqa: E402
from sglang.srt.model_loader import get_model  # noqa: E402
from sglang.srt.model_loader.loader import DefaultModelLoader  # noqa: E402
from sglang.srt.model_loader.weight_utils import default_weight_loader  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

rotary_base._is_cpu = True  # the one substitution (module docstring): no vllm._custom_ops

# ---- instrumentation around the engine's own weight loading -----------------------------------
_job: dict[str, Any] = {}
_orig_load_only = DefaultModelLoader.load_weights_only


def _instrumented_load_only(model, weights, target_device):
    sentinels = pc.Sentinels(model)
    recorder = pc.LoadRecorder()
    recorder.wrap_loaders(model, default_weight_loader)
    _job["recorder"] = recorder
    _orig_load_only(model, recorder.wrap_iterator(weights), target_device)
    _job["unwritten"] = sentinels.unwritten(model)   # before postprocessing repacks anything
    _job["nonfinite"] = pc.nonfinite(model)


DefaultModelLoader.load_weights_only = staticmethod(_instrumented_load_only)

_dist_ready = False


def _server_args(job: dict[str, Any]) -> ServerArgs:
    k = int(job.get("num_speculative_tokens", 3))
    return ServerArgs(model_path=job["target"], speculative_algorithm="EAGLE3",
                      speculative_draft_model_path=job["draft"], device="cpu", dtype="bfloat16",
                      tp_size=1, disable_cuda_graph=True, speculative_num_steps=k,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=k + 1,
                      skip_tokenizer_init=True)


def _aux_layers(target_hf_config, draft_hf_config) -> list[int]:
    """The target layers SGLang captures (HF hidden_states indices): the target class's own
    `set_eagle3_layers_to_capture` applied to the ids the draft worker reads from
    `eagle_config` (spec_aux_hidden_state.py); the layer loop captures them in ascending order.
    [] when `use_aux_hidden_state` is false (fc is then skipped)."""
    from sglang.srt.models.registry import ModelRegistry
    ec = getattr(draft_hf_config, "eagle_config", None)
    try:
        if ec.get("use_aux_hidden_state", True) is False:
            return []
    except Exception:
        pass
    try:
        ids = ec["eagle_aux_hidden_state_layer_ids"]
    except Exception:
        ids = None
    text = getattr(target_hf_config, "text_config", None) or target_hf_config
    archs = list(getattr(text, "architectures", None) or target_hf_config.architectures)
    cls, _ = ModelRegistry.resolve_model_cls(archs)
    stub = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), config=text,
                           model=SimpleNamespace())
    types.MethodType(cls.set_eagle3_layers_to_capture, stub)(ids)
    return sorted(set(int(i) for i in stub.model.layers_to_capture))


def _from_target(model) -> dict[str, str]:
    """Parameters SGLang's EAGLE worker takes from the target (eagle_worker_v2.init_lm_head)."""
    out = {}
    cfg = model.config
    if getattr(model, "load_lm_head_from_target", False):
        out["lm_head.weight"] = "the target's lm_head (draft_vocab_size is null)"
        out["model.embed_tokens.weight"] = "the target's embed_tokens"
    elif not (hasattr(cfg, "target_hidden_size") and cfg.target_hidden_size != cfg.hidden_size):
        # LlamaForCausalLM.set_embed: shared unless the widths differ
        out["model.embed_tokens.weight"] = "the target's embed_tokens"
    return out


def _smoke(model, V: int) -> dict[str, Any]:
    """Draft logits = lm_head(norm(h)) on random rows; hot_token_id (= d2t + arange) in [0, V)."""
    hot = getattr(model, "hot_token_id", None)
    out = pc.mapping_record(None if hot is None else hot.long(), V)
    H = model.lm_head.weight.shape[-1]
    hidden = torch.randn(4, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        h = model.model.norm.forward_native(hidden)
        h = h[0] if isinstance(h, tuple) else h
        logits = torch.nn.functional.linear(h, model.lm_head.weight)
    out["logits_shape"] = list(logits.shape)
    out["logits_finite"] = bool(torch.isfinite(logits).all())
    out["width_ok"] = logits.shape[-1] == int(model.config.draft_vocab_size)
    return out


def check_one(job: dict[str, Any]) -> dict[str, Any]:
    global _dist_ready
    rec: dict[str, Any] = {"ok": False}
    _job.clear()
    try:
        args = _server_args(job)
        runtime_context.publish(args, role="scheduler",
                                ranks=runtime_context.SpawnRanks(world_rank=0, dp_rank=None,
                                                                 gpu_id=0))
        if not _dist_ready:
            init_parallel_runtime(server_args=args, device="cpu", dist_port=pc.free_port())
            _dist_ready = True
        target_cfg = ModelConfig.from_server_args(args)
        draft_cfg = ModelConfig.from_server_args(args, model_path=job["draft"],
                                                 is_draft_model=True)
    except Exception as e:
        rec["error"] = pc.error_record("config", e)
        return rec
    dh = draft_cfg.hf_config
    V = int(getattr(target_cfg.hf_text_config, "vocab_size", 0) or target_cfg.vocab_size)
    rec["resolved"] = {"architectures": list(getattr(dh, "architectures", None) or []),
                       "draft_vocab_size": getattr(dh, "draft_vocab_size", None),
                       "vocab_size": getattr(dh, "vocab_size", None), "target_vocab_size": V,
                       "norm_before_residual_applied": False,  # not implemented by SGLang
                       "max_model_len": draft_cfg.context_len,
                       "target_num_layers": int(target_cfg.num_hidden_layers)}
    try:
        rec["resolved"]["aux_layer_ids"] = _aux_layers(target_cfg.hf_config, dh)
    except Exception as e:
        rec["resolved"]["aux_layer_ids_error"] = f"{type(e).__name__}: {e}"
    try:
        model = get_model(model_config=draft_cfg, load_config=LoadConfig(load_format="auto"),
                          device_config=DeviceConfig("cpu"))
    except Exception as e:
        rec["error"] = pc.error_record("load", e)
        if "recorder" in _job:
            rec.update(_job["recorder"].report())
        return rec
    rec["resolved"]["model_class"] = type(model).__name__
    rec["resolved"]["eagle31"] = pc.eagle31(getattr(model, "model", None))
    pc.loaded_record(rec, _job, model)
    rec["from_target"] = _from_target(model)
    consumed = {}
    for n in rec["checkpoint"]:
        if "t2d" in n:
            consumed[n] = "ignored by SGLang (not needed to serve)"
        elif "d2t" in n and getattr(model, "hot_token_id", None) is not None:
            consumed[n] = "hot_token_id = d2t + arange (not a parameter)"
    rec["consumed"] = consumed
    return pc.finish(rec, model, lambda: _smoke(model, V), int(draft_cfg.context_len))


if __name__ == "__main__":
    pc.main_guard(lambda: pc.run_jobs(sys.argv, "sglang", sglang.__version__, check_one))
