"""Python started at the checkout root: the top-level `kernels/` folder shadows nothing.

The checkout's folders install as `eyas.*` (pyproject.toml). Python run from the checkout root
(`python -m ...`, a notebook, vLLM's model-inspection subprocess) also sees them under their bare
names, and Hugging Face's `kernels` package, which transformers imports when it loads a model,
has the same name as eyas's `kernels/`. That folder has no `__init__.py`: a folder without one is
only a namespace portion, and Python's import system takes a regular package found anywhere on
sys.path over it, so the installed `kernels` wins whatever is imported first and whatever the
order of sys.path.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_transformers_loads_a_model_from_the_checkout_root_before_eyas_is_imported():
    out = _run("import sys, json, torch\n"
               "from transformers import AutoModelForCausalLM, LlamaConfig\n"
               "import kernels\n"
               "m = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, "
               "intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, "
               "vocab_size=64))\n"
               "print(json.dumps({'first': sys.path[0], 'kernels': kernels.__file__, "
               "'params': sum(p.numel() for p in m.parameters())}))")
    assert out["first"] == ""                       # the checkout root is first on sys.path
    assert out["kernels"] and "site-packages" in out["kernels"]
    assert out["params"] > 0


def test_eyas_kernels_still_imports_and_the_path_is_left_alone():
    out = _run("import sys, json; before = list(sys.path)\n"
               "import eyas.train.cli, eyas.models.drafter\n"
               "from eyas.kernels.loss import eagle3_loss, triton_available\n"
               "import kernels\n"
               "print(json.dumps({'same': sys.path == before, 'kernels': kernels.__file__}))")
    assert out["same"] and "site-packages" in out["kernels"]
