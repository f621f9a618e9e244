"""Fixtures of the serving tests."""

from pathlib import Path

import pytest
import torch

from eyas.data.common.targets import load_target_config
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.serving.export import export_drafter


@pytest.fixture(scope="module")
def small_export(tmp_path_factory) -> Path:
    """A small exported drafter of the tiny-llama target (256-token draft vocabulary)."""
    tcfg = load_target_config("tiny-llama")
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=256, ttt_steps=2)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, attention="eager")
    drafter.set_vocab_map(torch.randperm(cfg.vocab_size)[:256].sort().values - torch.arange(256))
    return export_drafter(drafter.state_dict(), cfg, None, None,
                          tmp_path_factory.mktemp("x") / "src", target_config=tcfg)
