"""Drive a vLLM engine in process. Runs INSIDE the engine venv; stdlib, torch and vllm only.

    <venv>/bin/python -I worker.py JOB.json

The host (data/engine/runner.py) starts this script, which builds one `vllm.LLM` from JOB.json
and then answers requests, one JSON object per line on stdin, with one JSON line each on the
protocol pipe (the process's original stdout; vLLM's own logging goes to stderr):

- first line out: {"ready": true, "vllm": version, "aux_layers": [...] | null, "seconds": s}
- {"op": "generate", "prompts": [[name, ids], ...], "max_tokens": N, "temperature": T,
   "seed": S} -> {"outputs": [[name, ids, finish_reason], ...], "seconds": s,
   "metrics": {counter deltas of the call, "vllm:spec_decode_*" among them}}; with
   "concurrency": C the prompts run through the engine's step API with exactly C requests in
   flight (a finished request is replaced by the next prompt before the next step, as C
   clients of a server would), min(C, prompts left) at the end
- {"op": "capture", "samples": [[key, ids], ...]} (JOB has "capture") -> {"files": [[key,
   path], ...]}: each prompt runs as a request with max_tokens=1; vLLM's `extract_hidden_states`
   method and its hidden-states connector write `path` (hidden_states [T, n_ids, H], token_ids);
   the reply is sent once every file is complete (its `.lock` released).
- any failure: {"error": "one line", "traceback": "..."}; the worker then exits.

JOB.json: {"target": dir, "dtype": "float32", "max_model_len": N, "max_num_seqs": B,
"seed": S, "kv_cache_gib": G, "speculative": {"drafter": dir, "k": K} | null,
"capture": {"layers": [ids], "storage": dir, "connector": "host" | "stock"} | null}.

Settings for speed on a CPU come from the host's environment (runner.py). Two things of vLLM
0.32 this script accounts for: a request's hidden-states file is written one engine step after
the request finished, and `LLM.generate` returns before that step, so `capture` keeps stepping
the engine until nothing is pending; and vLLM binds its torch thread to core 0, so the host
never runs two workers at once on a small machine.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _die_with_parent() -> None:
    """SIGKILL this process when the host dies (kill -9 of eyas must not leave an engine)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _protocol_pipe():
    """The original stdout as the protocol pipe; fd 1 then points at stderr for vLLM's prints."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def build_llm(job: dict):
    from vllm import LLM
    kw = dict(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=True,
              max_model_len=int(job.get("max_model_len", 2048)), seed=int(job.get("seed", 0)),
              max_num_seqs=int(job.get("max_num_seqs", 8)), disable_log_stats=False)
    spec, cap = job.get("speculative"), job.get("capture")
    if spec:
        kw["speculative_config"] = {"method": "eagle3", "model": spec["drafter"],
                                    "num_speculative_tokens": int(spec["k"])}
    if cap:
        kw["enable_prefix_caching"] = False
        kw["speculative_config"] = {
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": [int(i) for i in cap["layers"]]}}}
        stock = cap.get("connector") == "stock"
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleHiddenStatesConnector" if stock
            else "HostHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": cap["storage"]}}
        if not stock:
            kw["kv_transfer_config"]["kv_connector_module_path"] = "hs_connector"
    return LLM(**kw)


def counters(llm) -> dict:
    """Every counter and vector metric of the engine, by name (vectors as lists)."""
    out: dict = {}
    for m in llm.get_metrics():
        if hasattr(m, "values"):
            out[m.name] = [int(v) for v in m.values]
        elif type(m).__name__ == "Counter":
            out[m.name] = m.value
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for name, v in after.items():
        if isinstance(v, list):   # a vector that grew since: its new entries start at 0
            out[name] = [x - y for x, y in zip(v, (before.get(name) or []) + [0] * len(v))]
        else:
            out[name] = v - (before.get(name) or 0)
    return out


def in_flight(llm, prompts: list, params: list, concurrency: int, tag: str) -> list:
    """The outputs of every prompt, in order, decoded with `concurrency` requests in flight."""
    engine, res, ids = llm.llm_engine, [None] * len(prompts), {}
    queue, busy = list(range(len(prompts))), 0
    while queue or busy:
        while queue and busy < concurrency:
            i = queue.pop(0)
            ids[f"{tag}-{i}"] = i
            ids[engine.add_request(f"{tag}-{i}", prompts[i], params[i])] = i
            busy += 1
        for out in engine.step():
            if out.finished:
                res[ids[out.request_id]] = out
                busy -= 1
    return res


def generate(llm, req: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    names = [n for n, _ in req["prompts"]]
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for _, ids in req["prompts"]]
    params = [SamplingParams(temperature=float(req.get("temperature", 0.0)),
                             max_tokens=int(req["max_tokens"]),
                             seed=int(req.get("seed", 0)) + i) for i in range(len(prompts))]
    before = counters(llm)
    t0 = time.perf_counter()
    if req.get("concurrency"):
        res = in_flight(llm, prompts, params, int(req["concurrency"]),
                        f"c{req['concurrency']}-{time.monotonic_ns()}")
    else:
        res = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    outs = [[n, list(r.outputs[0].token_ids), r.outputs[0].finish_reason]
            for n, r in zip(names, res)]
    return {"outputs": outs, "seconds": seconds, "metrics": delta(counters(llm), before)}


def _wait_unlocked(path: str) -> None:
    with open(path + ".lock") as lf:
        fcntl.flock(lf, fcntl.LOCK_SH)   # the writer holds LOCK_EX until the file is complete


def capture(llm, req: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    keys = [k for k, _ in req["samples"]]
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for _, ids in req["samples"]]
    res = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    while scheduler.has_requests():       # the files of the last step's requests
        engine.step()
    files = []
    for key, r in zip(keys, res):
        path = (r.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"request of sample {key} came back without a hidden_states_path")
        _wait_unlocked(path)
        os.remove(path + ".lock")
        files.append([key, path])
    return {"files": files}


def main(argv: list[str]) -> int:
    _die_with_parent()
    proto = _protocol_pipe()
    sys.path.insert(0, str(HERE))   # -I drops the script's directory; vLLM imports hs_connector
    job = json.loads(Path(argv[1]).read_text())
    try:
        t0 = time.perf_counter()
        import vllm
        llm = build_llm(job)
        spec = llm.llm_engine.vllm_config.speculative_config
        aux = getattr(spec, "eagle_aux_hidden_state_layer_ids", None) if spec else None
        proto.write(json.dumps({"ready": True, "vllm": vllm.__version__,
                                "aux_layers": list(aux) if aux else None,
                                "seconds": time.perf_counter() - t0}) + "\n")
        for line in sys.stdin:
            req = json.loads(line)
            reply = generate(llm, req) if req["op"] == "generate" else capture(llm, req)
            proto.write(json.dumps(reply) + "\n")
    except Exception as e:  # noqa: BLE001 - reported to the host, which raises it
        first = f"{type(e).__name__}: {e}".splitlines()[0]
        proto.write(json.dumps({"error": first, "traceback": traceback.format_exc()}) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
