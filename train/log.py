"""Logging for entry points: `data.log` (one format, rank 0 only) is the one implementation."""

from eyas.data.log import RankZeroFilter, current_rank, setup_logging

__all__ = ["RankZeroFilter", "current_rank", "setup_logging"]
