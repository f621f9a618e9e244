"""Run a vLLM engine from eyas: a worker process in the engine's own venv, spoken to by pipe.

    with Engine({"target": DIR, "speculative": {"drafter": EXPORT, "k": 3}}, log=PATH) as e:
        reply = e.request({"op": "generate", "prompts": [["p0", ids]], "max_tokens": 64})

vLLM never runs inside eyas's interpreter (its torch and transformers pins differ): the worker
(worker.py) runs under `<venv>/bin/python -I` from a scratch working directory (a checkout root
on sys.path would shadow packages vLLM imports), with the settings that make an engine start in
seconds on a CPU (in-process engine core, eager mode, Intel OpenMP preloaded, a throwaway
vLLM cache). The worker dies with this process (PR_SET_PDEATHSIG); when the worker dies first,
`request` raises `EngineDied` naming the exit status and the engine log.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from eyas.data.engine.venvs import DEFAULT_VERSIONS, ready_info, runtime_engine, venv_dir

log = logging.getLogger(__name__)
WORKER = Path(__file__).resolve().parent / "worker.py"


class EngineError(RuntimeError):
    """The engine could not start or answer; the message names the cause and the log."""

    exit_status = 3


class EngineDied(EngineError):
    """The engine process exited while a request was pending."""


def engine_venv(engine: str | None = None, root: str | Path | None = None) -> tuple[str, Path]:
    """(engine name, its ready venv) of the engine that runs here; EngineError when not built."""
    engine = engine or runtime_engine()
    path = venv_dir(engine, DEFAULT_VERSIONS[engine], root)
    if ready_info(path) is None:
        raise EngineError(f"no {engine} {DEFAULT_VERSIONS[engine]} venv in {path}. Fix: "
                          f"`eyas engines setup --runtime` (builds it once, ~3.5 GB)")
    return engine, path


def engine_env(venv: Path, scratch: Path, kv_cache_gib: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(scratch / "vllm-cache"),
               VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"))
    omp = venv / "lib" / "libiomp5.so"
    if omp.is_file():   # vLLM's CPU speculative decoding is ~15x slower without it
        env["LD_PRELOAD"] = ":".join(filter(None, [str(omp), env.get("LD_PRELOAD")]))
    return env


class Engine:
    """One engine worker process for the life of a `with` block (see the module docstring)."""

    def __init__(self, job: dict[str, Any], *, log_path: str | Path, engine: str | None = None,
                 venv_root: str | Path | None = None):
        self.engine, self.venv = engine_venv(engine, venv_root)
        self.job = {"kv_cache_gib": 1, **job}
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.info: dict[str, Any] = {}

    def __enter__(self) -> "Engine":
        self.scratch = Path(tempfile.mkdtemp(prefix="eyas-engine-"))
        (self.scratch / "job.json").write_text(json.dumps(self.job))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        cmd = [str(self.venv / "bin" / "python"), "-I", str(WORKER), str(self.scratch / "job.json")]
        log.info("starting %s (log: %s)", self.engine, self.log_path)
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            cwd=self.scratch, env=engine_env(self.venv, self.scratch, self.job["kv_cache_gib"]))
        try:
            self.info = self._read("start")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        log.info("%s %s ready in %.0f s", self.engine, self.info.get("vllm"),
                 self.info.get("seconds", 0))
        return self

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass   # the read below reports the death
        return self._read(req.get("op", "request"))

    def _read(self, what: str) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            status = self.proc.wait()
            raise EngineDied(f"the {self.engine} engine (pid {self.proc.pid}) exited with status "
                             f"{status} during {what}; its log: {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            log.debug("engine traceback:\n%s", reply.get("traceback"))
            raise EngineError(f"the {self.engine} engine failed during {what}: {reply['error']} "
                              f"(log: {self.log_path})")
        return reply

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
