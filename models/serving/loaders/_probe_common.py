"""Helpers shared by the engine probes. Runs INSIDE an engine venv: stdlib + torch only.

Neither engine reports what it did not load (models/serving/CONTRACT.md §3): vLLM's and
SGLang's EAGLE-3 `load_weights` silently skip names they cannot place and never check for
parameters left unwritten (those keep `torch.empty` garbage). A probe therefore
  1. fills every parameter with a sentinel value before loading (`Sentinels`),
  2. records every checkpoint tensor the loader reads and wraps every parameter's
     `weight_loader` to note which checkpoint tensor reached which parameter (`LoadRecorder`),
  3. compares after loading: parameters still holding the sentinel were never written;
     checkpoint tensors that reached no parameter were dropped.

Protocol with the host (models/serving/loaders/check.py): `probe_<engine>.py JOBS.json OUT.jsonl`.
JOBS.json = {"jobs": [{"id", "draft", "target", "num_speculative_tokens"}, ...]}; the probe
appends one JSON object per job to OUT.jsonl (flushed), so a hard crash loses only the current
job. The host interprets the raw facts; the probe does not judge.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

FLOAT_SENTINEL = -1234.5      # stored as the nearest value of the parameter's dtype
INT_SENTINEL = -987_654_321


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sentinel_for(p: torch.Tensor) -> float | int | None:
    if p.is_meta or p.numel() == 0 or p.dtype == torch.bool:
        return None
    if p.dtype.is_floating_point:
        return FLOAT_SENTINEL
    if p.dtype == torch.uint8:
        return 173
    if p.dtype in (torch.int8,):
        return -101
    return INT_SENTINEL


class Sentinels:
    """Fill every parameter with a sentinel; later report the fraction of each still holding it."""

    def __init__(self, model: torch.nn.Module):
        self.value: dict[str, Any] = {}
        with torch.no_grad():
            for name, p in model.named_parameters():
                s = _sentinel_for(p)
                if s is None:
                    continue
                p.data.fill_(s)
                self.value[name] = p.data.reshape(-1)[0].item()  # as the dtype stores it

    def unwritten(self, model: torch.nn.Module) -> dict[str, float]:
        """param name -> fraction of elements still equal to the sentinel (only those > 0)."""
        out: dict[str, float] = {}
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, s in self.value.items():
                p = params.get(name)
                if p is None or p.is_meta:
                    continue
                flat = p.data.reshape(-1)
                hits = 0
                for a in range(0, flat.numel(), 1 << 24):  # chunked: embeddings are large
                    hits += int((flat[a:a + (1 << 24)] == s).sum())
                if hits:
                    out[name] = hits / flat.numel()
        return out


def nonfinite(model: torch.nn.Module) -> list[str]:
    bad = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype.is_floating_point and not p.is_meta:
                flat = p.data.reshape(-1)
                for a in range(0, flat.numel(), 1 << 24):
                    if not bool(torch.isfinite(flat[a:a + (1 << 24)]).all()):
                        bad.append(name)
                        break
    return bad


class LoadRecorder:
    """Which checkpoint tensors the engine read, and which parameter each one reached.

    Checkpoint tensors are kept alive until `report()` so that their memory is never reused and
    a tensor handed to a weight loader (or a view of it) is identified by address."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.meta: dict[str, dict[str, Any]] = {}
        self._keep: dict[str, torch.Tensor] = {}
        self._by_id: dict[int, str] = {}
        self._ranges: list[tuple[int, int, str]] = []
        self.reached: dict[str, set[str]] = {}
        # loads of tensors not traced to a checkpoint name
        self.unmatched: list[dict[str, Any]] = []

    def wrap_iterator(self, it: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in it:
            self.record(name, t)
            yield name, t

    def record(self, name: str, t: torch.Tensor) -> None:
        if name not in self.meta:
            self.order.append(name)
        self.meta[name] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        self._keep[name] = t
        self._by_id[id(t)] = name
        if t.numel() and t.device.type == "cpu":
            start = t.data_ptr()
            self._ranges.append((start, start + t.numel() * t.element_size(), name))

    def match(self, t: Any) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        name = self._by_id.get(id(t))
        if name is not None:
            return name
        if t.numel() and t.device.type == "cpu":
            ptr = t.data_ptr()
            for start, end, n in self._ranges:
                if start <= ptr < end:
                    return n
        return None

    def wrap_loaders(self, model: torch.nn.Module, default_loader: Callable) -> None:
        """Wrap each parameter's weight_loader (or the engine's default one) to record its input."""
        for pname, p in model.named_parameters():
            orig = getattr(p, "weight_loader", None) or default_loader

            def loader(param, loaded_weight, *args, _orig=orig, _pname=pname, **kwargs):
                src = self.match(loaded_weight)
                if src is None:
                    self.unmatched.append({"param": _pname,
                                           "shape": list(getattr(loaded_weight, "shape", []))})
                else:
                    self.reached.setdefault(src, set()).add(_pname)
                return _orig(param, loaded_weight, *args, **kwargs)

            try:
                p.weight_loader = loader
            except AttributeError:
                p._weight_loader = loader

    def report(self) -> dict[str, Any]:
        out = {"checkpoint": {n: self.meta[n] for n in self.order},
               "reached": {n: sorted(self.reached.get(n, ())) for n in self.order},
               "unmatched_loads": self.unmatched}
        self._keep.clear()
        self._ranges.clear()
        self._by_id.clear()
        return out


def loaded_record(rec: dict[str, Any], job: dict[str, Any], model: torch.nn.Module) -> None:
    """Into `rec`: what the loader read and where it went, the model's parameters, and the
    sentinel read-back taken right after loading (`job`, filled by the probe's load wrapper)."""
    rec.update(job["recorder"].report())
    rec["params"] = {n: {"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
                     for n, p in model.named_parameters()}
    rec["unwritten"] = job.get("unwritten", {})
    rec["nonfinite"] = job.get("nonfinite", [])


def eagle31(inner: Any) -> dict[str, bool]:
    """Which EAGLE-3.1 norms the loaded model (its inner `model`) applies, by its attributes."""
    return {"norm_before_fc": bool(getattr(inner, "norm_before_fc", False)),
            "fc_norm": getattr(inner, "fc_norm", None) is not None,
            "norm_output": bool(getattr(inner, "norm_output", False))}


def mapping_record(ids: torch.Tensor | None, V: int) -> dict[str, Any]:
    """The engine's draft -> target id mapping ids [Vd]: whether it has one, its range, whether
    every id lies in [0, V) and whether they increase."""
    if ids is None:
        return {"has_mapping": False}
    return {"has_mapping": True, "mapped_min": int(ids.min()), "mapped_max": int(ids.max()),
            "mapped_in_range": bool((ids >= 0).all() and (ids < V).all()),
            "mapped_increasing": bool((ids[1:] > ids[:-1]).all())}


def finish(rec: dict[str, Any], model: torch.nn.Module, smoke: Callable[[], dict[str, Any]],
           max_len: int) -> dict[str, Any]:
    """`rec` completed with the smoke check (an error of stage "smoke" when it raises) and the
    rotary tables (an error there is reported, never fatal: the load itself succeeded)."""
    try:
        rec["smoke"] = smoke()
    except Exception as e:
        rec["error"] = error_record("smoke", e)
        return rec
    try:
        rec["rope"] = rope_tables(model, max_len)
    except Exception as e:
        rec["rope"] = {"error": f"{type(e).__name__}: {e}"}
    rec["ok"] = True
    return rec


def error_record(stage: str, e: BaseException) -> dict[str, Any]:
    """The engine's own message, its exception type and the innermost frames (where it raised)."""
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in tb[-4:]]
    return {"stage": stage, "type": type(e).__name__, "message": str(e)[:2000],
            "where": frames}


def run_jobs(argv: list[str], engine: str, version: str,
             check_one: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """Main loop of a probe: one JSON line per job, flushed as soon as the job ends."""
    jobs = json.loads(Path(argv[1]).read_text())["jobs"]
    print("eyas-probe: engine imported", engine, version, flush=True)  # check.READY_LINE
    with open(argv[2], "a") as out:
        for job in jobs:
            t0 = time.time()
            try:
                rec = check_one(job)
            except BaseException as e:  # a probe bug, not an engine verdict: still reported
                rec = {"probe_error": error_record("probe", e)}
            rec.update(id=job["id"], engine=engine, version=version,
                       seconds=round(time.time() - t0, 2))
            out.write(json.dumps(rec) + "\n")
            out.flush()
    return 0


def main_guard(fn: Callable[[], int]) -> None:
    try:
        code = fn()
    except BaseException:
        traceback.print_exc()
        code = 2
    sys.stdout.flush()
    sys.exit(code)


#: positions at which the probes read the engine's rotary tables (filtered to the served length)
ROPE_POSITIONS = (0, 1, 2, 100, 1000, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192, 16385,
                  32768, 131071, 262143)


def rope_tables(model, max_len: int) -> dict[str, Any]:
    """cos/sin [n, d/2] of the drafter's rotary module at ROPE_POSITIONS < max_len.

    Rotates a query whose first half is 1 and second half 0 with the module's own forward: the
    output halves are then cos and sin (NeoX layout), whatever tables the class builds."""
    rotary = next((m for n, m in model.named_modules() if n.endswith("rotary_emb")), None)
    if rotary is None:
        return {"error": "no rotary_emb module"}
    d = int(rotary.head_size)
    pos = torch.tensor([p for p in ROPE_POSITIONS if p < max_len], dtype=torch.long)
    q = torch.cat([torch.ones(len(pos), d // 2), torch.zeros(len(pos), d // 2)], -1)
    fwd = getattr(rotary, "forward_native", rotary.forward)
    with torch.no_grad():
        out, _ = fwd(pos, q.clone(), q.clone())
    out = out.float().view(len(pos), d)
    return {"class": type(rotary).__name__, "positions": pos.tolist(),
            "cos": out[:, :d // 2].tolist(), "sin": out[:, d // 2:].tolist()}
