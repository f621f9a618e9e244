"""Logging, exit statuses and help for entry points: timestamped records from rank 0 (warnings from
every rank) on stderr and, once the run directory is known, in a file there.

The `eyas` command (`train/cli.py`), the training entry point (`train/main.py`) and the data
producers run as `python -m eyas.data.<module>` (e.g. extraction under `accelerate launch`)
call `setup_logging`; library code only creates module loggers. It lives in data/, the leaf
every other package may import.

Exit statuses, the same for every command: docs/exit-statuses.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3

# Records logged with `extra={PROGRESS: True}` repeat what a progress bar shows: a terminal
# drops them (the bar is there), a log file or a redirected stream keeps them.
PROGRESS = "eyas_progress"
DATEFMT = "%Y-%m-%d %H:%M:%S"


class TerminalProgressFilter(logging.Filter):
    """Drop progress records when the stream is a terminal (its progress bar shows them)."""

    def __init__(self, stream) -> None:
        super().__init__()
        self.stream = stream

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, PROGRESS, False):
            return True
        isatty = getattr(self.stream, "isatty", None)
        try:
            return not (isatty is not None and isatty())
        except ValueError:  # the stream was closed under its handler: nothing to show on
            return False


# Lines libraries print on every run that tell the user nothing (logger name, text the message
# starts with): kept in the run's log file as debug records, never shown on the console.
NOISE = (
    ("DeepSpeed", "Setting accelerator to CPU"),     # DeepSpeed's import on a machine without GPU
    ("torchao", "Failed to load "),                  # torchao's CUDA kernels on a CPU-only torch
    ("torchao", "Skipping import of cpp extensions"),
    ("torch.utils._pytree", ""),                     # torch's notices of deprecated registrations
)
# Loggers with a console handler of their own that bypasses the root's (DeepSpeed writes to
# stdout, torch's log to stderr): their records are handed to the root's handlers instead.
OWN_HANDLER_LOGGERS = ("DeepSpeed", "torch.utils._pytree")
EARLY_RECORDS = 10_000   # records kept until the run's log file is known


def is_noise(record: logging.LogRecord) -> bool:
    """Whether `record` is one of the NOISE lines."""
    return any(record.name == name and record.getMessage().startswith(text)
               for name, text in NOISE)


class NoiseAsDebugFormatter(logging.Formatter):
    """Writes the NOISE records at debug level (the file keeps them; they are not warnings)."""

    def format(self, record: logging.LogRecord) -> str:
        if is_noise(record):
            record = logging.makeLogRecord({**record.__dict__, "levelno": logging.DEBUG,
                                            "levelname": "DEBUG"})
        return super().format(record)


class ToRootFilter(logging.Filter):
    """On a logger with a handler of its own: hand every record to the root's handlers and
    none to the logger's own (the filter stays when the library configures its logger later)."""

    def filter(self, record: logging.LogRecord) -> bool:
        logging.getLogger().handle(record)
        return False


class EarlyRecords(logging.Handler):
    """Keeps the records logged before the run's log file is known (up to EARLY_RECORDS), so
    that the file starts with them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < EARLY_RECORDS:
            self.records.append(record)


def quiet_libraries() -> None:
    """Route the libraries' own log output through eyas's handlers (NOISE off the console) and
    turn off transformers' weight-loading progress bars (downloads keep theirs); transformers
    only once imported."""
    for name in OWN_HANDLER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ToRootFilter) for f in logger.filters):
            logger.addFilter(ToRootFilter())
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is None:   # not imported (it costs ~0.6 s): eyas's loaders call this again
        return               # right after they import transformers
    hf_logging.disable_default_handler()   # its records reach the root's handlers instead
    hf_logging.enable_propagation()
    if hasattr(hf_logging, "set_tqdm_hook"):
        hf_logging.set_tqdm_hook(_no_loading_bars)


def _no_loading_bars(factory, args, kwargs):
    """transformers' tqdm hook: its bars while loading weights off, every other bar kept."""
    if str(kwargs.get("desc", "")).startswith("Loading"):
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


def current_rank() -> int:
    """Global rank from the launcher's environment (0 when not launched distributed)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def setup_logging(level: int = logging.INFO, rank: int | None = None,
                  file: str | Path | None = None, keep_early: bool = False) -> None:
    """Configure the root logger for an eyas entry point (idempotent: a second call replaces
    the handlers of the first). `file`: also append the records to this file (created with
    its directory on the first record). `keep_early`: keep the records until a later call
    names the file, which then starts with them (the trainer's run directory is known only
    once its accelerator is up). Libraries' noise (NOISE) goes to the file only."""
    rank = current_rank() if rank is None else rank
    root = logging.getLogger()
    early: list[logging.LogRecord] | None = [] if keep_early else None
    for h in list(root.handlers):
        if getattr(h, "_eyas", False):
            if isinstance(h, EarlyRecords):
                early = (early or []) + h.records
            root.removeHandler(h)
            h.close()
    fmt = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
    if rank:
        fmt = f"[rank {rank}] " + fmt
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    handlers[0].addFilter(TerminalProgressFilter(sys.stderr))
    handlers[0].addFilter(lambda record: not is_noise(record))
    handlers[0].setFormatter(logging.Formatter(fmt, datefmt=DATEFMT))
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(file, mode="a", encoding="utf-8", delay=True))
        handlers[1].setFormatter(NoiseAsDebugFormatter(fmt, datefmt=DATEFMT))
    elif early is not None:   # the records before the file is known: it starts with them
        handlers.append(EarlyRecords())
        handlers[1].records = early
    for handler in handlers:
        handler._eyas = True  # type: ignore[attr-defined]
        # ranks other than 0: warnings and worse only
        handler.addFilter(lambda record: rank == 0 or record.levelno >= logging.WARNING)
        root.addHandler(handler)
    if file is not None:
        for record in early or []:
            handlers[1].handle(record)
    root.setLevel(level)
    # Third-party chatter that hides eyas's own lines.
    for name in ("transformers", "accelerate", "DeepSpeed", "deepspeed", "torch.distributed",
                 "urllib3", "filelock", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    quiet_libraries()


class HelpFormatter(argparse.HelpFormatter):
    """`--help` of every eyas command: each option shows its default ("(default: X)" appended
    unless its help already names it). Flags and required options are left as written, and so
    are options whose default is None (not given): their help says in words what that means,
    e.g. "(default: the dataset manifest's target)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                       argparse._HelpAction, argparse._VersionAction))
                or (not action.option_strings and action.nargs not in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def _raised_by_eyas(e: BaseException) -> bool:
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("eyas.")


def error_exit_status(e: BaseException) -> int | None:
    """The exit status of an error the user can fix, or None for a bug (its traceback shows).

    An exception class may say its status with an `exit_status` attribute (3 for a stage that
    cannot run here); a missing, unreadable or wrong path is a usage error (2), and so is a
    ValueError or KeyError that eyas raises itself about its input (ConfigError, DatasetError,
    ExtractError, a bad preset name, ...). The same types raised inside a library are bugs."""
    status = getattr(e, "exit_status", None)      # the class's, or the error's own
    if isinstance(status, int):
        return status
    if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError,
                      PermissionError, FileExistsError)) or _no_room(e):
        return EXIT_USAGE
    if isinstance(e, (ValueError, KeyError)) and (
            type(e).__module__.startswith("eyas.") or _raised_by_eyas(e)):
        return EXIT_USAGE
    return None


def error_message(e: BaseException) -> str:
    """One line for an error (a KeyError's quotes dropped; a path error names its path)."""
    if isinstance(e, KeyError) and len(e.args) == 1:
        text = str(e.args[0])
    elif isinstance(e, OSError) and e.strerror and e.filename is not None:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e) or type(e).__name__
    if _no_room(e):   # a full disk no eyas writer named (data/common/space.py names them)
        text += "; free space on that disk, or write to another one"
    return " ".join(text.split())


def _no_room(e: BaseException) -> bool:
    from eyas.data.common.space import NO_ROOM_ERRNOS
    return isinstance(e, OSError) and e.errno in NO_ROOM_ERRNOS


def run_command(prog: str, cli_main, argv: list[str] | None) -> int:
    """`cli_main(argv)`'s exit status; an error the user can fix (`error_exit_status`) becomes
    one line `<prog>: <message>` on stderr and its status. EYAS_DEBUG=1 shows its traceback."""
    try:
        return int(cli_main(argv) or 0)
    except Exception as e:
        status = error_exit_status(e)
        if status is None or os.environ.get("EYAS_DEBUG"):
            raise
        print(f"{prog}: {error_message(e)}", file=sys.stderr)
        return status


def run_main(cli_main, prog: str | None = None) -> None:
    """`python -m eyas.<package>.<module>`: logging as the `eyas` command sets it, then
    `cli_main()`'s exit status (errors as `run_command` reports them)."""
    setup_logging()
    raise SystemExit(run_command(prog or Path(sys.argv[0]).stem, cli_main, None))
