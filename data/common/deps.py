"""Optional parts of the stack (deepspeed, wandb): imported only on the paths that use them, so
a broken or absent one costs only those paths; there it is one line with the fix
(`MissingDependency`, exit status 2), whatever the import raised."""

from __future__ import annotations

from eyas.data.common.log import EXIT_USAGE


class MissingDependency(ValueError):
    """An optional package that the chosen path needs but that cannot be imported."""

    exit_status = EXIT_USAGE


def missing(module: str, used_by: str, fix: str, e: Exception,
            error: type[MissingDependency] = MissingDependency) -> MissingDependency:
    """The one-line error: what needs `module`, why it cannot be imported, and both fixes."""
    first = " ".join(str(e).split())[:160]
    return error(f"{used_by} needs {module}, which cannot be imported ({type(e).__name__}: "
                 f"{first}). Fix: pip install {module} (part of eyas's default install), or "
                 f"{fix}")


def require_deepspeed(used_by: str, fix: str,
                      error: type[MissingDependency] = MissingDependency) -> None:
    """Import deepspeed (ImportError, or whatever a broken install raises: `missing`)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:
        raise missing("deepspeed", used_by, fix, e, error) from None


def require_wandb(used_by: str, fix: str,
                  error: type[MissingDependency] = MissingDependency) -> None:
    """Import wandb (as `require_deepspeed`)."""
    try:
        import wandb  # noqa: F401
    except Exception as e:
        raise missing("wandb", used_by, fix, e, error) from None
