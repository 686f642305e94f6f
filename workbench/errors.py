"""The one exception users see: a clear, one-line message naming what to do instead.

Entry points: `WorkbenchError` (the CLI prints it and exits 2), `describe(err)` (a foreign
error in one line, to quote inside one), `check_int` (every integer a user gives, flag,
policy field or argument, checked against both ends of its range in one place),
`check_type` (an argument of a public entry point of the wrong type, named there) and
`torch_logs_held()` (torch's own log lines held back while the workbench works: shown if
it succeeds, dropped when its one-line error says what went wrong).
"""

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = [
    "INT64_MAX",
    "WorkbenchError",
    "check_int",
    "check_type",
    "describe",
    "torch_logs_held",
]

INT64_MAX = 2**63 - 1  # byte counts: what torch and numpy hold in one integer


def check_int(name: str, value: Any, low: int, high: int, why: str = "") -> int:
    """`value` when it is a whole number (not a bool) from `low` to `high`, else a one-line
    error naming `name`, the range, the value and its type; `why` says where `high` comes
    from.

    >>> check_int("--repeat", 3, 1, 1000)
    3
    >>> check_int("--repeat", 2**64, 1, 1000, "each run is timed")
    Traceback (most recent call last):
    ...
    workbench.errors.WorkbenchError: --repeat must be a whole number from 1 to 1,000 (...
    """
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        reason = f" ({why})" if why else ""
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise WorkbenchError(
            f"{name} must be a whole number from {low:,} to {high:,}{reason}, got {shown} "
            f"({type(value).__name__})"
        )
    return value


def check_type(name: str, value: Any, kinds: type | tuple[type, ...], expected: str) -> Any:
    """`value` when it is one of `kinds` (a bool is no int), else a TypeError naming the
    argument `name`, what it `expected` and what it got: said at a public entry point rather
    than as an AttributeError or KeyError deep inside.

    >>> check_type("pipeline", 2, str, "a Pipeline")
    Traceback (most recent call last):
    ...
    TypeError: pipeline must be a Pipeline, got 2 (int)
    """
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise TypeError(f"{name} must be {expected}, got {shown} ({type(value).__name__})")
    return value


class WorkbenchError(Exception):
    """Bad input or an unsupported model, explained in words rather than a torch traceback."""


def describe(err: BaseException) -> str:
    """A foreign exception in one line, to quote inside a WorkbenchError.

    >>> describe(RuntimeError("mat1 and mat2 must have the same dtype\\n(more)"))
    'RuntimeError: mat1 and mat2 must have the same dtype'
    >>> describe(SystemExit(3)), describe(ValueError())
    ('it called sys.exit(3)', 'ValueError: (no message)')
    """
    if isinstance(err, SystemExit):
        return f"it called sys.exit({err.code!r})"
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else '(no message)'}"


class _Held(logging.Handler):
    """Keeps records with the handlers they were meant for."""

    def __init__(self, targets: list[logging.Handler]) -> None:
        super().__init__()
        self.targets = targets
        self.records: list[tuple[logging.LogRecord, list[logging.Handler]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record, self.targets))


@contextlib.contextmanager
def torch_logs_held() -> Iterator[None]:
    """Hold back what torch's loggers (which write to stderr themselves, not through the
    root logger) print while the block runs: replayed when it ends normally, dropped when
    it raises, so a failing command shows its one `error:` line and not torch's traceback
    of the same failure (fake tensors log a 19-line one before raising)."""
    loggers = [
        logger
        for name, logger in logging.root.manager.loggerDict.items()
        if (name == "torch" or name.startswith("torch."))
        and isinstance(logger, logging.Logger)
        and logger.handlers
    ]
    saved = {logger: logger.handlers for logger in loggers}
    held = {logger: _Held(logger.handlers) for logger in loggers}
    for logger in loggers:
        logger.handlers = [held[logger]]
    try:
        yield
    finally:
        for logger, handlers in saved.items():
            logger.handlers = handlers
    for handler in held.values():  # only reached when the block did not raise
        for record, targets in handler.records:
            for target in targets:
                if record.levelno >= target.level:
                    target.handle(record)


@contextlib.contextmanager
def logger_level(name: str, level: int = logging.ERROR) -> Iterator[None]:
    """Logger `name` at `level` while the block runs (torch's chatter on a path whose
    result already says what matters), its own level restored after."""
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
