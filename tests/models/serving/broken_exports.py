"""Exports for the engine tests: the validator's deliberately broken exports, reused as is, and
clean exports of real shapes.

The broken cases are those of tests/models/serving/test_validate.py (`CASES`: case id, config edit,
tensor edit, expected validator codes); that file is loaded by path so any case added there is
also run through the engines.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch

from eyas.models.config import Eagle3Config
from eyas.models.serving.export import export_drafter
from eyas.data.common.targets import load_target_config
from eyas.models.serving.contract import CORE_TENSORS, expected_shapes

_spec = importlib.util.spec_from_file_location(
    "_eyas_test_validate", Path(__file__).with_name("test_validate.py"))
_validate_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_validate_tests)

CASES = _validate_tests.CASES            # [(case, edit_cfg, edit_tensors, validator codes)]
BROKEN_TARGET = "tiny-llama"            # the target the broken cases are built against
make_drafter = _validate_tests.make_drafter
rewrite = _validate_tests.rewrite


def clean_tiny_export(out: Path) -> Path:
    """The validator tests' clean export (tiny-llama target), the base of every broken case."""
    tcfg = load_target_config(BROKEN_TARGET)
    cfg, sd, _ = make_drafter(tcfg)
    return export_drafter(sd, cfg, None, None, out, target_config=tcfg)


def broken_exports(clean: Path, root: Path) -> dict[str, tuple[Path, set[str]]]:
    """case id -> (its directory, the validator codes it must produce).

    Each copy keeps the clean export's eyas_export.json, as a hand-edited eyas export would:
    it records the aux layers the drafter was trained on."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for case, edit_cfg, edit_tensors, codes in CASES:
        d = rewrite(clean, root / case, edit_cfg, edit_tensors)
        shutil.copy(clean / "eyas_export.json", d / "eyas_export.json")
        out[case] = (d, set(codes))
    return out


def random_export(preset: str, out: Path, draft_vocab_size: int = 32000, seed: int = 0) -> Path:
    """A drafter for a (possibly config-only) target preset with random bf16 weights of the exact
    shapes (norms = 1), a random sorted draft vocabulary, exported by `export_drafter`."""
    tcfg = load_target_config(preset)
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=draft_vocab_size, ttt_steps=3)
    shapes = expected_shapes(cfg.to_config_dict())
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name in CORE_TENSORS:
        t = torch.empty(shapes[name], dtype=torch.bfloat16)
        sd[name] = t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0, 0.02,
                                                                               generator=g)
    vd = cfg.draft_vocab_size
    ids = torch.randperm(cfg.vocab_size, generator=g)[:vd].sort().values
    return export_drafter(sd, cfg, ids - torch.arange(vd), None, out, target_config=tcfg)
