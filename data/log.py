"""Logging for entry points: timestamped records from rank 0 (warnings from every rank).

The `eyas` command (`train/cli.py`), the training entry point (`train/main.py`) and the data
producers run as `python -m eyas.data.<module>` (e.g. extraction under `accelerate launch`)
call `setup_logging`; library code only creates module loggers. It lives in data/, the leaf
every other package may import.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings


class RankZeroFilter(logging.Filter):
    """Drop records on ranks other than 0 unless they are warnings or worse."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def current_rank() -> int:
    """Global rank from the launcher's environment (0 when not launched distributed)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def setup_logging(level: int = logging.INFO, rank: int | None = None) -> None:
    """Configure the root logger for an eyas entry point (idempotent)."""
    rank = current_rank() if rank is None else rank
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_eyas", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._eyas = True  # type: ignore[attr-defined]
    fmt = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
    if rank:
        fmt = f"[rank {rank}] " + fmt
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    handler.addFilter(RankZeroFilter(rank))
    root.addHandler(handler)
    root.setLevel(level)
    # Third-party chatter that hides eyas's own lines.
    for name in ("transformers", "accelerate", "DeepSpeed", "deepspeed", "torch.distributed",
                 "urllib3", "filelock", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")


def run_main(cli_main) -> None:
    """`python -m eyas.<package>.<module>`: logging as the `eyas` command sets it, then
    `cli_main()`'s exit status."""
    setup_logging()
    raise SystemExit(cli_main())
