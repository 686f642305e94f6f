"""One way to write a user-visible file: atomic, never clobbering unless asked.

Entry points: `write_file(path, data, overwrite=False) -> Path`, which every writer of the
workbench (policy save, export, render, figures, autosave) goes through, and `check_writable`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from workbench.errors import WorkbenchError

__all__ = ["check_writable", "write_file"]


def write_file(path: str | os.PathLike[str], data: str | bytes, *, overwrite: bool = False) -> Path:
    """Write `data` to `path` through a temporary file in the same folder.

    Without `overwrite`, an existing file (or a dangling symbolic link) is never replaced,
    also when it appears between the check and the write: the final step is a hard link,
    which fails if the name exists. With `overwrite`, the rename replaces the file (a
    symbolic link is replaced itself, never followed). Refuses a folder, a device or pipe
    (replacing `/dev/null` would break the system), a missing folder and an unwritable one
    with a one-line error.
    """
    target = Path(path)
    check_writable(target, overwrite=overwrite)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        raise WorkbenchError(f"cannot write {str(target)!r}: {err.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)
        if overwrite:
            os.replace(tmp, target)
        else:
            _link_new(tmp, target)
    except FileExistsError:
        raise _exists(target) from None
    except OSError as err:
        raise WorkbenchError(f"cannot write {str(target)!r}: {err.strerror}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return target


def check_writable(path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Refuse what `write_file` must never create or replace; commands call it before
    their slow part, so a bad `--out` fails in a second, not after tracing."""
    target = Path(path)
    try:
        _check_target(target, overwrite)
    except OSError as err:  # a name too long, a loop of links: stat itself fails
        raise WorkbenchError(f"cannot write {str(target)!r}: {err.strerror}") from None


def _check_target(target: Path, overwrite: bool) -> None:
    if target.is_dir():
        raise WorkbenchError(f"cannot write {str(target)!r}: it is a folder; name a file")
    if os.path.lexists(target) and not (target.is_symlink() or target.is_file()):
        raise WorkbenchError(
            f"cannot write {str(target)!r}: it is a device, pipe or socket, not a file; "
            "name a regular file"
        )
    folder = target.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "is missing"
        raise WorkbenchError(f"cannot write {str(target)!r}: folder {str(folder)!r} {what}")
    if not overwrite and os.path.lexists(target):
        raise _exists(target)


def _exists(target: Path) -> WorkbenchError:
    return WorkbenchError(
        f"{str(target)!r} exists; pass overwrite=True (--overwrite on the command line) "
        "to replace it"
    )


def _link_new(tmp: str, target: Path) -> None:
    """A hard link fails if the target appeared since the check, so it never clobbers; on
    file systems without hard links, fall back to a rename after one more check."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise
    except OSError:
        if os.path.lexists(target):
            raise FileExistsError(str(target)) from None
        os.replace(tmp, target)
