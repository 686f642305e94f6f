"""The one exception users see: a clear, one-line message naming what to do instead.

Entry points: `WorkbenchError` (the CLI prints it and exits 2) and `describe(err)` (a foreign
error in one line, to quote inside one).
"""

__all__ = ["WorkbenchError", "describe"]


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
