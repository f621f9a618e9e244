"""deepspeed and wandb are default dependencies (the trainer's dist=zero* and tracker=wandb paths)
imported only where used: no eyas module imports them when it is imported."""

import importlib.util
import subprocess
import sys
import textwrap

# modules that run inside an engine's own venv (vLLM, SGLang), not eyas's
ENGINE_SIDE = ("eyas.data.engine.hs_connector", "eyas.models.serving.loaders.probe_sglang",
               "eyas.models.serving.loaders.probe_vllm")


def test_no_eyas_module_imports_deepspeed_or_wandb():
    assert importlib.util.find_spec("deepspeed") and importlib.util.find_spec("wandb")
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        names = []
        for pkg in ("eyas.data", "eyas.models", "eyas.kernels", "eyas.train", "eyas.conf"):
            m = importlib.import_module(pkg)
            names += [i.name for i in pkgutil.walk_packages(m.__path__, pkg + ".")]
        for name in names:
            if name not in {ENGINE_SIDE!r}:
                importlib.import_module(name)
                hit = [m for m in ("deepspeed", "wandb") if m in sys.modules]
                assert not hit, (name, hit)
        print(len(names))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout) > 100             # every module of the four packages was imported
