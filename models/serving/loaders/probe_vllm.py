"""Load EAGLE-3 drafter directories with vLLM's own loader on CPU. Runs INSIDE the vLLM venv.

    <vllm-venv>/bin/python -I probe_vllm.py JOBS.json OUT.jsonl

The call sequence is vLLM's drafter-loading path: ModelConfig(target) →
SpeculativeConfig(method="eagle3", model=draft) → VllmConfig → get_model(draft config), which
builds `Eagle3LlamaForCausalLM`, runs its `load_weights` over the safetensors and then
`process_weights_after_loading`. Two substitutions make it run without a GPU or vLLM's CPU build:
the post-load CPU GEMM repacking is replaced by its plain `F.linear` fallback, and
`torch.accelerator.empty_cache()` (raises without a device) becomes a no-op. Around the engine's
`DefaultModelLoader.load_weights` the probe sentinel-fills the parameters and records which
checkpoint tensor reached which parameter (_probe_common.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# before importing vllm: otherwise no platform is detected ("Invalid attention backend for None")
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # -I drops the script dir

import torch  # noqa: E402

import _probe_common as pc  # noqa: E402

import vllm  # noqa: E402
from vllm.config import (DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig,  # noqa: E402
                         VllmConfig, set_current_vllm_config)
from vllm.distributed.parallel_state import (init_distributed_environment,  # noqa: E402
                                             initialize_model_parallel)
from vllm.model_executor.layers import utils as layer_utils  # noqa: E402
from vllm.model_executor.model_loader import get_model  # noqa: E402
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402


# ---- the two substitutions of the module docstring ---------------------------------------------
def _plain_cpu_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
    layer.cpu_linear = torch.nn.functional.linear


layer_utils.dispatch_cpu_unquantized_gemm = _plain_cpu_gemm
if not torch.cuda.is_available():
    torch.accelerator.empty_cache = lambda: None

# ---- instrumentation around the engine's own load_weights --------------------------------------
_job: dict[str, Any] = {}
_orig_load_weights = DefaultModelLoader.load_weights


def _instrumented_load_weights(self, model, model_config):
    sentinels = pc.Sentinels(model)
    recorder = pc.LoadRecorder()
    recorder.wrap_loaders(model, default_weight_loader)
    _job["recorder"] = recorder
    orig_get_all = self.get_all_weights
    self.get_all_weights = lambda mc, m: recorder.wrap_iterator(orig_get_all(mc, m))
    try:
        _orig_load_weights(self, model, model_config)
    finally:
        del self.get_all_weights
    # read before process_weights_after_loading, which may repack parameters
    _job["unwritten"] = sentinels.unwritten(model)
    _job["nonfinite"] = pc.nonfinite(model)


DefaultModelLoader.load_weights = _instrumented_load_weights

_dist_ready = False


def _ensure_distributed() -> None:
    global _dist_ready
    if not _dist_ready:  # once per process (gloo, world size 1)
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{pc.free_port()}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        _dist_ready = True


def _aux_layers(spec: SpeculativeConfig, target_layers: int) -> list[int]:
    """The target layers vLLM captures (HF hidden_states indices): the ids its model runner
    reads from the draft config, else the target's default (2, N//2, N-3); the target model
    sorts and de-duplicates them (SupportsEagle3._set_aux_hidden_state_layers). [] when
    `use_aux_hidden_state` is false (fc is then skipped)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    ec = getattr(spec.draft_model_config.hf_config, "eagle_config", None) or {}
    if isinstance(ec, dict) and ec.get("use_aux_hidden_state", True) is False:
        return []
    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(
        SimpleNamespace(speculative_config=spec))
    if not ids:
        ids = (2, target_layers // 2, target_layers - 3)
    return sorted(set(int(i) for i in ids))


def _from_target(model, target_hidden: int) -> dict[str, str]:
    """Parameters vLLM's proposer replaces with the target's (llm_base_proposer._maybe_share_*)."""
    out = {}
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(model, "has_own_embed_tokens", False) and emb is not None \
            and emb.weight.shape[-1] == target_hidden:
        out["model.embed_tokens.weight"] = "the target's embed_tokens"
    if not getattr(model, "has_own_lm_head", False):
        out["lm_head.weight"] = ("the target's lm_head (vLLM then keeps its first "
                                 "draft_vocab_size rows)")
    return out


def _smoke(model, V: int, H: int) -> dict[str, Any]:
    """compute_logits on random rows: finite, width V, every mapped id in [0, V)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, H, generator=g).to(torch.bfloat16)
    d2t = getattr(model, "draft_id_to_target_id", None)
    ids = None if d2t is None else torch.arange(d2t.numel()) + d2t.data.long()
    out = pc.mapping_record(ids, V)
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    out["logits_shape"] = list(logits.shape)
    # ids outside the draft vocabulary are -inf by design; the draft ids must be finite
    drafted = logits[:, ids] if ids is not None and out["mapped_in_range"] else logits
    out["logits_finite"] = bool(torch.isfinite(drafted).all())
    out["width_ok"] = logits.shape[-1] == V
    return out


def check_one(job: dict[str, Any]) -> dict[str, Any]:
    rec: dict[str, Any] = {"ok": False}
    _job.clear()
    try:
        target = ModelConfig(model=job["target"], dtype="bfloat16", skip_tokenizer_init=True)
        spec = SpeculativeConfig(method="eagle3", model=job["draft"],
                                 num_speculative_tokens=int(job.get("num_speculative_tokens", 3)),
                                 target_model_config=target,
                                 target_parallel_config=ParallelConfig())
        vc = VllmConfig(model_config=target, speculative_config=spec,
                        device_config=DeviceConfig("cpu"))
    except Exception as e:
        rec["error"] = pc.error_record("config", e)
        return rec
    dcfg = spec.draft_model_config.hf_config
    V = target.get_vocab_size()
    rec["resolved"] = {
        "architectures": list(getattr(dcfg, "architectures", None) or []),
        "draft_vocab_size": getattr(dcfg, "draft_vocab_size", None),
        "vocab_size": getattr(dcfg, "vocab_size", None), "target_vocab_size": V,
        "aux_layer_ids": _aux_layers(spec, target.get_total_num_hidden_layers()),
        "target_num_layers": target.get_total_num_hidden_layers(),
        "norm_before_residual": bool(getattr(dcfg, "norm_before_residual", False)),
        "max_model_len": spec.draft_model_config.max_model_len,
    }
    try:
        with set_current_vllm_config(vc):
            _ensure_distributed()
            model = get_model(vllm_config=vc, model_config=spec.draft_model_config)
    except Exception as e:
        rec["error"] = pc.error_record("load", e)
        if "recorder" in _job:
            rec.update(_job["recorder"].report())
        return rec
    pc.loaded_record(rec, _job, model)
    rec["from_target"] = _from_target(model, target.get_hidden_size())
    rec["consumed"] = {n: "ignored by vLLM (not needed to serve)" for n in rec["checkpoint"]
                       if "t2d" in n}
    rec["resolved"]["norm_before_residual_applied"] = (
        model.model.layers[0]._residual_norm.__name__ == "_norm_before_residual")
    rec["resolved"]["eagle31"] = pc.eagle31(model.model)
    return pc.finish(rec, model, lambda: _smoke(model, V, int(dcfg.hidden_size)),
                     int(spec.draft_model_config.max_model_len))


if __name__ == "__main__":
    pc.main_guard(lambda: pc.run_jobs(sys.argv, "vllm", vllm.__version__, check_one))
