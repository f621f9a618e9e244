"""`--capture vllm` / `--capture endpoint`: the training features, captured by vLLM.

vLLM's `extract_hidden_states` speculative method stores chosen layers of every prompt token
and its hidden-states connector writes them per request (`hidden_states` [T, n_ids, H],
`token_ids` [T]). eyas asks for the aux ids a < b < c and N = num_hidden_layers:

- vLLM's id k < N is the residual stream entering decoder layer k, i.e. HF `hidden_states[k]`,
  what the HF path's pre-hooks capture: stored as ``aux``;
- id N is the stream after the last layer, BEFORE the final norm. The target's own final norm
  is applied here (the model's norm module, built on the meta device, only its weight read) to
  give ``last`` (HF `hidden_states[-1]`), and the target's lm_head (only its weight read) gives
  ``target_argmax`` and the top-k teacher exactly as the HF path computes them
  (`data.capture.chunked_argmax_topk`).

So the dataset means what an HF capture means: same format, storage modes, plan and resume
(one driver for every producer: data/produce/capturers.py, data/produce/extract.py). Each sample's
token ids as the engine saw them must equal the stored ones, else the run stops naming the
sample. The engine runs either here (`--capture vllm`: a worker in the engine venv,
data/engine/runner.py) or as a server the user started (`--capture endpoint
--capture-endpoint URL`: requests with max_tokens 1; the server writes the files to a directory
this machine reads).
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from eyas.data.common.capture import (ExtractError, WeightFiles, chunked_argmax_topk,
                                      files_fingerprint, find_text_model, logit_transform)

log = logging.getLogger(__name__)
STATES_DIR = ".engine-states"       # the engine's per-request files, inside the output dir


class TargetHead:
    """The target's final norm and lm_head with their weights, the rest of it on meta."""

    def __init__(self, target_dir: Path, dtype: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        from eyas.data.common.log import quiet_libraries
        from eyas.data.common.targets import TARGET_DTYPES
        quiet_libraries()
        self.config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
        with torch.device("meta"):
            self.meta = AutoModelForCausalLM.from_config(self.config,
                                                         dtype=TARGET_DTYPES[dtype])
        text, self.layers, norm, head = find_text_model(self.meta)
        if getattr(self.config.get_text_config(), "tie_word_embeddings", False):
            head.weight = text.embed_tokens.weight   # as from_pretrained ties them on load
        self.weights = WeightFiles(target_dir)
        names = {id(m): n for n, m in self.meta.named_modules()}
        self.target_dir = target_dir
        self.norm = self._materialise(norm, names[id(norm)], {})
        # a tied head has no tensor of its own in the files: it is the embedding
        embed = {"weight": names[id(text.embed_tokens)] + ".weight"}
        self.head = self._materialise(head, names[id(head)], embed)
        self.num_layers = min(len(self.layers), getattr(
            self.config.get_text_config(), "num_hidden_layers", len(self.layers)))

    def _materialise(self, module: nn.Module, name: str, fallback: dict[str, str]) -> nn.Module:
        """A copy of the meta model's `module` holding its weights (the meta model stays as it
        is: `fingerprint` reads it)."""
        import copy
        module = copy.deepcopy(module).to_empty(device="cpu")
        state = {}
        for pname, p in module.named_parameters():
            key = f"{name}.{pname}"
            if key not in self.weights.where:
                key = fallback.get(pname, key)
            if key not in self.weights.where:
                raise ExtractError(f"{self.target_dir}: no tensor {key!r} in its safetensors "
                                   f"files (engine capture reads the final norm and lm_head)")
            state[pname] = self.weights.get(key).to(p.dtype)
        module.load_state_dict(state, strict=True)
        return module.eval().requires_grad_(False)

    def fingerprint(self) -> str | None:
        return files_fingerprint(self.meta, self.weights)


def sample_features(states: dict[str, torch.Tensor], sample: dict[str, torch.Tensor],
                    head: TargetHead, *, name: str, n_aux: int, teacher: str, topk: int,
                    row_chunk: int = 1024, vocab_chunk: int = 65536) -> dict[str, torch.Tensor]:
    """One sample's stored fields from the engine's file (`states`: hidden_states, token_ids)."""
    ids, want = states["token_ids"].long(), sample["input_ids"].long()
    if ids.shape != want.shape or not torch.equal(ids, want):
        where = ("lengths " + f"{ids.numel()} vs {want.numel()}" if ids.shape != want.shape
                 else f"first at position {int((ids != want).nonzero()[0])}")
        raise ExtractError(f"{name}: the engine's token ids differ from the stored ones "
                           f"({where}); the engine tokenised or truncated the prompt: check its "
                           f"max_model_len and that it serves the target the tokens came from")
    hs = states["hidden_states"]                                   # [T, n_ids, H]
    dtype = head.norm.weight.dtype
    last = head.norm(hs[:, n_aux].to(dtype))
    arg, tids, tvals = chunked_argmax_topk(
        last, head.head, topk=topk if teacher != "last" else 0, row_chunk=row_chunk,
        vocab_chunk=vocab_chunk, **dict(zip(("logit_scale", "softcap"),
                                            logit_transform(head.config))))
    out = {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"],
           "aux": hs[:, :n_aux].to(dtype).contiguous(), "target_argmax": arg}
    if teacher in ("last", "both"):
        out["last"] = last
    if teacher in ("topk", "both"):
        out["topk_ids"], out["topk_logits"] = tids, tvals
    return out


def take_states(path: str | Path, about: str) -> dict[str, torch.Tensor]:
    """A connector file, once its writer released the `.lock` beside it; both are deleted once
    read. A truncated or garbled file is one ExtractError line naming `about` and the file."""
    import fcntl

    from safetensors.torch import load_file
    lock = Path(f"{path}.lock")
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
    try:
        states = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExtractError(f"{about}: {path}: the engine's hidden-states file is unreadable "
                           f"({why}); capture it again (the same command resumes)") from None
    for f in (Path(path), lock):
        f.unlink(missing_ok=True)
    return states


# ---------------------------------------------------------------------------------------------
# The two sources of the states: an engine worker here, or a server


class WorkerSource:
    """`--capture vllm`: the target in a vLLM worker process (data/engine/runner.py)."""

    def __init__(self, target_dir: Path, engine_ids: list[int], storage: Path, dtype: str,
                 max_len: int, log_path: Path):
        from eyas.data.engine.runner import Engine, runtime_engine
        self.engine = Engine({"target": str(target_dir), "dtype": dtype, "max_num_seqs": 16,
                              "max_model_len": max_len,
                              "capture": {"layers": engine_ids, "storage": str(storage),
                                          "connector": "host"}},
                             log_path=log_path, engine=runtime_engine())

    def __enter__(self):
        self.engine.__enter__()
        return self

    def __exit__(self, *exc):
        self.engine.__exit__(*exc)

    def describe(self) -> dict[str, Any]:
        return {"engine": self.engine.engine, "version": self.engine.info.get("vllm"),
                "how": "in-process vllm.LLM, extract_hidden_states"}

    def capture(self, samples: list[tuple[int, list[int]]]) -> dict[int, str]:
        reply = self.engine.request({"op": "capture", "samples": samples})
        return {int(k): p for k, p in reply["files"]}


class EndpointSource:
    """`--capture endpoint`: a running `vllm serve` with extract_hidden_states and a connector."""

    def __init__(self, url: str, model: str | None, concurrency: int = 8):
        from eyas.data.produce.endpoint import EndpointClient
        self.client = EndpointClient(url, connections=concurrency, retries=2)
        self.concurrency = concurrency
        self.model = model

    def __enter__(self):
        self.model = self.model or self.client.models()[0]
        root = self.client.url.rsplit("/v1", 1)[0]
        try:
            import httpx
            self.version = httpx.get(f"{root}/version", timeout=10).json().get("version")
        except Exception:  # noqa: BLE001 - the version is informative only
            self.version = None
        return self

    def __exit__(self, *exc):
        self.client.close()

    def describe(self) -> dict[str, Any]:
        return {"engine": "vllm", "version": self.version, "endpoint": self.client.url,
                "how": "vllm serve, extract_hidden_states"}

    def _one(self, item: tuple[int, list[int]]) -> tuple[int, str]:
        key, ids = item
        ans = self.client.request("POST", "completions", f"sample {key}",
                                  {"model": self.model, "prompt": ids, "max_tokens": 1,
                                   "temperature": 0.0})
        path = (ans.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ExtractError(f"{self.client.url}: the answer for sample {key} has no "
                               f"kv_transfer_params.hidden_states_path: start the server with "
                               f"the extract_hidden_states method and a hidden-states connector "
                               f"(docs/engine.md)")
        return key, path

    def capture(self, samples: list[tuple[int, list[int]]]) -> dict[int, str]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return dict(pool.map(self._one, samples))


# ---------------------------------------------------------------------------------------------
# The run


def capture_source(source, engine_ids: list[int], n_layers: int, dtype: str) -> dict[str, Any]:
    """The manifest's `capture`: the engine, its layer ids and what each id means."""
    return {"source": "vllm", **source.describe(), "dtype": dtype, "engine_layer_ids": engine_ids,
            "meaning": {str(k): f"residual stream entering decoder layer {k} (HF "
                        f"hidden_states[{k}]), stored as aux" for k in engine_ids[:-1]}
            | {str(n_layers): "after the last decoder layer, before the final norm; eyas "
               "applies the target's final norm (HF hidden_states[-1]) for last, argmax, top-k"}}


class CaptureStopped(RuntimeError):
    """The engine or server went away mid-run; what is written stays and a rerun resumes."""

    exit_status = 3


@contextlib.contextmanager
def engine_stops(kept: Callable[[], str]):
    """An engine that died or a server that stopped answering inside the block, as one
    CaptureStopped line naming it, then `kept()`: what stays and how to resume."""
    from eyas.data.produce.endpoint import EndpointError
    from eyas.data.engine.runner import EngineError
    try:
        yield
    except (EngineError, EndpointError) as e:
        raise CaptureStopped(f"{str(e).splitlines()[0]}; {kept()}") from e
