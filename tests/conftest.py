"""Test-wide settings. The environment must be set before torch/triton/transformers import."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # no hub: a lookup would spend ~50 s failing
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread: on a 2-core machine a second OpenMP thread spin-waits whenever any other
# process or thread is busy, which makes small CPU ops 20x slower (measured).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run on CPU tensors only through the interpreter; it must be on before
# triton is imported. GPU runs (CUDA present) compile the kernels instead.
try:
    import torch  # noqa: E402
    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    """Outside the engine suites (`-m engines`, `-m engine_run`) no engine venv exists: the main
    job's engine checks then skip, whatever this machine has built, so the suite runs the same
    everywhere."""
    expr = config.getoption("markexpr") or ""
    if not any(w in expr.replace("not engine", "") for w in ("engines", "engine_run")):
        import tempfile
        os.environ["EYAS_ENGINES_ROOT"] = tempfile.mkdtemp(prefix="eyas-no-engines-")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not _cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (restored after): batch-1 decoding and tiny forwards
    gain nothing from more, and on a shared 2-core machine a second spinning OpenMP thread
    makes small ops 10-70x slower. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face hub cache built on disk, with HF_HUB_CACHE pointing at it and the hub
    offline. `hub_cache(repo_id, files, revision="main")` lays a repository out as
    huggingface_hub does (blobs/, snapshots/<commit>/ links to them, refs/<revision>) and
    returns the snapshot directory; `files` maps names to bytes or to files to copy."""
    import hashlib

    root = tmp_path / "hf-hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def add(repo_id: str, files: dict, revision: str = "main"):
        from pathlib import Path
        repo = root / f"models--{repo_id.replace('/', '--')}"
        data = {k: (v if isinstance(v, bytes) else Path(v).read_bytes()) for k, v in files.items()}
        commit = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest())
                                          for k, v in data.items())).encode()).hexdigest()
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (repo / "blobs").mkdir(exist_ok=True)
        for name, blob_bytes in data.items():
            blob = repo / "blobs" / hashlib.sha256(blob_bytes).hexdigest()
            blob.write_bytes(blob_bytes)
            link = snap / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path("../" * (len(Path(name).parts) + 1)) / "blobs" / blob.name)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
        return snap

    add.root = root
    return add


def _tiny_llama_drafter(cfg_dict, vocab=4096, seed=0):
    """A seeded drafter for the tiny-llama target with its real embedding and head rows, its
    values rounded to bf16 as an export stores them (so a directory round trip is exact)."""
    import torch

    from eyas.data.common.targets import load_embedding_and_head
    from eyas.models.config import Eagle3Config
    from eyas.models.drafter import Eagle3Drafter
    cfg = Eagle3Config.from_target(cfg_dict, draft_vocab_size=vocab, aux_layer_ids=[2, 4, 5])
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg, attention="lse-eager")
    d.reset_parameters(std=0.05)
    embed, head = load_embedding_and_head("tiny-llama")
    d.load_target_embedding(embed.float())
    d2t = torch.sort(torch.randperm(cfg.vocab_size)[:vocab]).values - torch.arange(vocab)
    d.init_lm_head_from_target(head.float(), d2t)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p.bfloat16().float())
    return d.eval()


@pytest.fixture
def tiny_drafter():
    """`tiny_drafter(target_config_dict, vocab=4096, seed=0)`: see `_tiny_llama_drafter`."""
    return _tiny_llama_drafter


def _full_vocab_export(model, out):
    """A seeded random drafter over the whole vocabulary of tiny-llama `model` (d2t all zero),
    exported to `out` (layout A); returns the export directory."""
    import torch

    from eyas.data.common.targets import default_aux_layer_ids
    from eyas.models.config import Eagle3Config
    from eyas.models.drafter import Eagle3Drafter
    from eyas.models.serving.export import export_drafter
    V = model.config.vocab_size
    cfg = Eagle3Config.from_target(model.config.to_dict(), draft_vocab_size=V,
                                   aux_layer_ids=default_aux_layer_ids(8))
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, attention="eager")
    return export_drafter(d.state_dict(), cfg, torch.zeros(V, dtype=torch.long), None, out,
                          target_config=model.config.to_dict())


@pytest.fixture(scope="session")
def full_vocab_export():
    """`full_vocab_export(model, out_dir)`: see `_full_vocab_export`."""
    return _full_vocab_export


_HOLD = """
import sys
from eyas.data.common.lock import DirLock
lock = DirLock(sys.argv[1], what="test holder", path=sys.argv[2] or None).acquire()
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def lock_holder():
    """`lock_holder(directory, path=None)`: a real process that holds the directory's lock
    (data/common/lock.py) until it is killed or its stdin closes; returns its Popen once it holds it.
    Every holder still running at the end of the test is killed."""
    import subprocess
    import sys
    procs = []

    def start(directory, path=None):
        p = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory), str(path or "")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "held"
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def small_fs(tmp_path):
    """`small_fs(kib)`: a directory on a fresh tmpfs of that many KiB (skips the test where
    mounting is not allowed); every one is unmounted afterwards."""
    import subprocess
    mounted = []

    def mount(kib: int):
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(d)],
                           capture_output=True, text=True, check=False)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", str(d)], check=True)
