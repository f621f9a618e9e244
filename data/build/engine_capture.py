"""`eyas extract --engine vllm` / `--endpoint URL`: the training features, captured by vLLM.

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
(`data.extract`: one shard per plan range, written atomically; a rerun computes only missing
shards). Each sample's token ids as the engine saw them must equal the stored ones, else the
run stops naming the sample. The engine runs either here (`--engine vllm`: a worker in the
engine venv, data/engine/runner.py) or as a server the user started (`--endpoint`: requests with
max_tokens 1; the server writes the files to a directory this machine reads).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from eyas.data.common.capture import (ExtractError, WeightFiles, check_aux_layers,
                                      chunked_argmax_topk, files_fingerprint, find_text_model,
                                      logit_transform)
from eyas.data.build.extract_plan import (check_template, finalize, make_plan, pending_shards,
                                          write_plan)
from eyas.data.build.forward import default_shard_tokens
from eyas.data.common.lock import writes_directory
from eyas.data.build.outdir import check_extract_out

log = logging.getLogger(__name__)
STATES_DIR = ".engine-states"       # the engine's per-request files, inside the output dir
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TargetHead:
    """The target's final norm and lm_head with their weights, the rest of it on meta."""

    def __init__(self, target_dir: Path, dtype: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        from eyas.data.common.log import quiet_libraries
        quiet_libraries()
        self.config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
        with torch.device("meta"):
            self.meta = AutoModelForCausalLM.from_config(self.config,
                                                         dtype=TORCH_DTYPES[dtype])
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


def read_states(path: str | Path) -> dict[str, torch.Tensor]:
    """A connector file, once its writer released the `.lock` beside it."""
    import fcntl

    from safetensors.torch import load_file
    lock = Path(f"{path}.lock")
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
    return load_file(str(path))


# ---------------------------------------------------------------------------------------------
# The two sources of the states: an engine worker here, or a server


class WorkerSource:
    """`--engine vllm`: the target in a vLLM worker process (data/engine/runner.py)."""

    def __init__(self, target_dir: Path, engine_ids: list[int], storage: Path, dtype: str,
                 max_len: int, log_path: Path, connector: str = "host"):
        from eyas.data.engine.runner import Engine, runtime_engine
        self.engine = Engine({"target": str(target_dir), "dtype": dtype, "max_num_seqs": 16,
                              "max_model_len": max_len,
                              "capture": {"layers": engine_ids, "storage": str(storage),
                                          "connector": connector}},
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
    """`--endpoint URL`: a running `vllm serve` with extract_hidden_states and a connector."""

    def __init__(self, url: str, model: str | None, concurrency: int = 8):
        from eyas.data.build.endpoint import EndpointClient
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


@writes_directory("out_dir", what="hidden-state dataset")
def extract_engine(tokens_dir: str | Path, target: str | Path, out_dir: str | Path, *,
                   endpoint: str | None = None, model: str | None = None,
                   layers: list[int] | None = None, aux_format: str = "bf16",
                   teacher: str = "last", topk: int = 32, shard_tokens: int | None = None,
                   shard_bytes: int = 1 << 30, max_samples: int | None = None,
                   dtype: str = "bfloat16", batch_samples: int = 32,
                   connector: str = "host") -> dict[str, Any]:
    """Capture a hidden-state dataset through vLLM (see the module docstring); the keywords
    mean what `data.extract.extract`'s do. endpoint: a server's URL instead of a worker here
    (`model`: its served name, default the first it lists). Returns a summary dict."""
    from eyas.data.store.shards import open_dataset
    from eyas.data.common.targets import resolve_target
    if teacher not in ("last", "topk", "both"):
        raise ExtractError(f"teacher must be last, topk or both, got {teacher!r}")
    check_extract_out(out_dir, tokens_dir)
    tokens = open_dataset(tokens_dir)
    check_template(tokens_dir, target)
    n = len(tokens) if max_samples is None else min(max_samples, len(tokens))
    target_dir = resolve_target(target)
    head = TargetHead(target_dir, dtype)
    aux_ids = check_aux_layers(layers, head.num_layers)
    engine_ids = [*aux_ids, head.num_layers]
    hidden, vocab = int(head.head.weight.shape[1]), int(head.head.weight.shape[0])
    topk = topk if teacher != "last" else 0
    shard_tokens = shard_tokens or default_shard_tokens(hidden, aux_format, teacher, topk,
                                                        shard_bytes)
    lengths = [int(x) for x in tokens.sample_lengths[:n]]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    storage = out / STATES_DIR
    shutil.rmtree(storage, ignore_errors=True)      # a killed run's files: recomputed
    source = (EndpointSource(endpoint, model) if endpoint else
              WorkerSource(target_dir, engine_ids, storage, dtype, max(lengths) + 8,
                           out / "engine.log", connector))
    with source:
        plan = make_plan(tokens, tokens_dir, target, n, lengths, shard_tokens,
                         target_config=json.loads(head.config.to_json_string()),
                         fingerprint=head.fingerprint(), target_dtype=dtype,
                         capture=capture_source(source, engine_ids, head.num_layers, dtype),
                         aux_ids=aux_ids, teacher=teacher, topk=topk, aux_format=aux_format,
                         hidden=hidden, vocab=vocab, num_layers=head.num_layers)
        write_plan(out, plan)
        todo, resumed = pending_shards(out, plan["shards"], 0, 1)
        t0 = time.perf_counter()

        def features(s, name):
            return sample_features(read_states(s), tokens.sample(name), head,
                                   name=f"{tokens_dir} sample {name}", n_aux=len(aux_ids),
                                   teacher=teacher, topk=topk)
        done = _resumable(source, out, len(plan["shards"]), lambda: _capture_shards(
            source, tokens, tokens_dir, out, plan["shards"], todo, lengths, features,
            aux_format=aux_format, batch_samples=batch_samples))
    dt = time.perf_counter() - t0
    shutil.rmtree(storage, ignore_errors=True)
    finalize(out)
    return {"out_dir": str(out), "shards": len(plan["shards"]), "computed": todo,
            "resumed": resumed, "tokens": done, "seconds": round(dt, 3),
            "tokens_per_s": round(done / dt, 1) if dt > 0 and done else None,
            "aux_layer_ids": aux_ids, "engine_layer_ids": engine_ids,
            "manifest": str(out / "manifest.json")}


def _capture_shards(source, tokens, tokens_dir, out: Path, shards: list[list[int]],
                    todo: list[int], lengths: list[int], features: Callable, *,
                    aux_format: str, batch_samples: int) -> int:
    """Capture and write the planned shards `todo`; returns the tokens captured."""
    from eyas.data.store.shards import write_shard
    from eyas.data.common.utils import progress
    total = sum(sum(lengths[a:b]) for a, b in (shards[j] for j in todo))
    bar = progress(None, total=total, unit="tok", unit_scale=True, desc="extract[vllm]")
    done, t0 = 0, time.perf_counter()
    try:
        for j in todo:
            a, b = shards[j]
            samples = []
            for c in range(a, b, batch_samples):
                batch = [(i, tokens.sample(i, fields=("input_ids",))["input_ids"].tolist())
                         for i in range(c, min(b, c + batch_samples))]
                files = source.capture(batch)
                for i, _ in batch:
                    samples.append(features(files[i], i))
                    _remove(files[i])
                ntok = sum(lengths[c:min(b, c + batch_samples)])
                done += ntok
                bar.update(ntok)
            write_shard(out, j, samples, aux_format=aux_format)
            log.info("shard %d (%d samples) written; %.0f tokens/s", j, b - a,
                     done / max(time.perf_counter() - t0, 1e-9))
    finally:
        bar.close()
    return done


class CaptureStopped(RuntimeError):
    """The engine or server went away mid-run; what is written stays and a rerun resumes."""

    exit_status = 3


def _resumable(source, out: Path, n_shards: int, run: Callable[[], int]) -> int:
    """`run()`, with an engine that died or a server that stopped answering turned into one
    line naming it, what is kept and how to resume."""
    from eyas.data.build.endpoint import EndpointError
    from eyas.data.engine.runner import EngineError
    try:
        return run()
    except (EngineError, EndpointError) as e:
        from eyas.data.store.shards import shard_name
        kept = sum((out / shard_name(j)).is_file() for j in range(n_shards))
        raise CaptureStopped(f"{str(e).splitlines()[0]}; {kept} of {n_shards} shard(s) of {out} "
                             f"are complete and kept: run the same `eyas extract` command again "
                             f"to resume") from e


def _remove(path: str) -> None:
    for f in (Path(path), Path(f"{path}.lock")):
        f.unlink(missing_ok=True)
