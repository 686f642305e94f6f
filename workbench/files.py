"""One way to read and write a user-visible file: bounded reads of regular files only, atomic
writes that replace only what the workbench wrote itself.

Entry points: `write_file(path, data, overwrite=False) -> Path`, which every writer of the
workbench (policy save, export, render, figures, autosave) goes through; `check_writable`,
which commands call before their slow part; `read_file(path, what, limit)`, which every
reader of a user's file (policies, autosaves, the CPU profile cache) goes through; and
`is_ours(path)`. Every file written carries a mark (`marked`) holding a digest of the
file and of the path it was written to: a file with a valid mark is the workbench's own,
unchanged since and where it was written, and is replaced without asking; anything else (a
user's script or picture, a file edited since, a copy of an export kept under another name)
needs `overwrite=True` (`--overwrite`). A format with no place for a mark (Markdown, text
that is not the JSON its name says) gets the mark in a sidecar file beside it
(`.NAME.sac-workbench`), so a re-run replaces it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import tempfile
import zlib
from pathlib import Path

from workbench.errors import WorkbenchError

__all__ = [
    "MARK_KEY",
    "check_writable",
    "file_stem",
    "is_ours",
    "mark_text",
    "marked",
    "read_file",
    "write_file",
]

MARK_KEY = "written_by"  # the key a JSON file's mark sits under (readers skip it)
_TAG = "sac-workbench-mark:"
_ZERO = "0" * 16
_MARK_RE = re.compile(rb"sac-workbench-mark:([0-9a-f]{16})")
_PNG = b"\x89PNG\r\n\x1a\n"
# Text files whose comments start with `#` (exported code, torchtitan's options): a file of
# another kind is left unmarked, so it is never replaced without `overwrite`.
HASH_COMMENTS = (".py", ".sh", ".txt", ".toml", ".yaml", ".yml", ".cfg")
# Files the workbench writes are far smaller; a larger one is not checked for a mark.
MAX_MARKED_BYTES = 256 * 2**20


def write_file(
    path: str | os.PathLike[str],
    data: str | bytes,
    *,
    overwrite: bool = False,
    only_new: bool = False,
    mark: bool = True,
) -> Path:
    """Write `data`, marked (`marked`), to `path` through a temporary file in the same folder.

        An existing file the workbench wrote and nobody changed since is replaced atomically (a
        rename); anything else is never replaced without `overwrite`, also when it appears
        between the check and the write: the final step is then a hard link, which fails if the
        name exists. `only_new` never replaces anything; `mark=False` writes `data` as it is (the
    explorer's copies aside of a user's file are both: never replaced, never altered). With
        `overwrite`, a symbolic link is replaced itself, never followed. Refuses a folder, a
        device or pipe (replacing `/dev/null` would break the system), a missing or unwritable
        folder with a one-line error.
    """
    _refuse_empty(path)
    target = Path(path)
    replace = _checked(target, overwrite)
    if only_new and os.path.lexists(target):
        raise _exists(target, "")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    place = _place(target)
    raw = marked(raw, target.name, place) if mark else raw
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        raise WorkbenchError(f"cannot write {str(target)!r}: {err.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
        os.chmod(tmp, 0o644)
        if replace:
            os.replace(tmp, target)
        else:
            _link_new(tmp, target)
    except FileExistsError:
        raise _exists(target, "it appeared while writing") from None
    except OSError as err:
        raise WorkbenchError(f"cannot write {str(target)!r}: {err.strerror}") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    if mark:
        _mark_beside(target, raw, place)
    return target


def _place(target: Path) -> str:
    """The path a mark binds a file to: its folder resolved (links, `..`) and its name."""
    return os.path.join(os.path.realpath(target.parent), target.name)


def _sidecar(target: Path) -> Path:
    return target.parent / f".{target.name}.sac-workbench"


def _digest(data: bytes, place: str) -> str:
    """The mark's digits: the data (its own mark zeroed) and the path it was written to, so a
    copy under another name is the user's file, not the workbench's."""
    return hashlib.sha256(data + b"\0" + place.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _mark_beside(target: Path, raw: bytes, place: str) -> None:
    """Data that carries no mark gets one in its sidecar file; marked data needs none (an
    old sidecar goes). A sidecar that cannot be written leaves the file as a user's: kept
    unless `overwrite`, never lost."""
    sidecar = _sidecar(target)
    try:
        if _find(raw) is not None:
            if sidecar.is_file() and not sidecar.is_symlink():
                sidecar.unlink()
            return
        if os.path.lexists(sidecar) and not (sidecar.is_file() and not sidecar.is_symlink()):
            return
        tmp = sidecar.with_name(sidecar.name + ".tmp")
        tmp.write_text(f"{target.name} {_TAG}{_digest(raw, place)}\n", encoding="utf-8")
        os.replace(tmp, sidecar)
    except OSError:
        return


def check_writable(path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Refuse what `write_file` must never create or replace; commands call it before
    their slow part, so a bad `--out` fails in a second, not after tracing."""
    _refuse_empty(path)
    _checked(Path(path), overwrite)


def _refuse_empty(path: str | os.PathLike[str]) -> None:
    """An empty path, or one ending in a separator (a folder's, which `Path` would quietly
    turn into a file's name), names no file."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path must be a str or os.PathLike, got {path!r}")
    text = os.fspath(path)
    if text == "":
        raise WorkbenchError("the output path is empty: name a file to write")
    if isinstance(text, str) and text.endswith(("/", os.sep)):
        raise WorkbenchError(
            f"cannot write {text!r}: it ends in {text[-1]!r}, a folder's name; name a file in it"
        )


def _checked(target: Path, overwrite: bool) -> bool:
    """Whether an existing `target` may be replaced; raises for what may not be written."""
    try:
        return _check_target(target, overwrite)
    except OSError as err:  # a name too long, a loop of links: stat itself fails
        raise WorkbenchError(f"cannot write {str(target)!r}: {err.strerror}") from None


def is_ours(path: str | os.PathLike[str]) -> bool:
    """True for a regular file (not a link) that carries a valid workbench mark: written by
    the workbench and not changed since."""
    return _ownership(Path(path)) == ""


def read_file(path: str | os.PathLike[str], what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. A pipe, a device (`/dev/zero`,
    `/dev/stdin`), a socket or a folder is refused before it is read, so a read never
    blocks and never runs without end; `what` names the file in the errors."""
    try:
        _refuse_special(os.stat(path), what)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise WorkbenchError(f"cannot read {what}: {err.strerror}") from None
    try:
        _refuse_special(os.fstat(fd), what)  # it may have changed since the stat
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(2**20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise WorkbenchError(f"cannot read {what}: {err.strerror}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise WorkbenchError(f"{what} is larger than {_size(limit)}: it cannot be what is meant")
    return b"".join(chunks)


def file_stem(name: str) -> str:
    """`name` (a model's, e.g. `torchtitan:llama3/8B`) as one file name: characters that
    separate folders or end strings become `_`, so a name never points elsewhere.

    >>> file_stem("torchtitan:llama3/8B"), file_stem("../x")
    ('torchtitan:llama3_8B', '.._x')
    """
    stem = re.sub(r"[/\\\0]", "_", name)
    return "_" if stem in ("", ".", "..") else stem


def marked(data: bytes, name: str = "", place: str = "") -> bytes:
    """`data` with the workbench's mark in the place its format keeps comments or metadata:
    an XML comment (SVG), `//` (DOT), `#` (`HASH_COMMENTS`), a `written_by` key (JSON),
    a tEXt chunk (PNG), the document's Creator (PDF). The mark holds the first 16 hex
    digits of the SHA-256 of the marked file with those digits zeroed and of `place`, the
    path it is written to (`_digest`), so any later edit, or a copy elsewhere, shows. Data
    of another kind comes back unmarked.

    >>> marked(b"x = 1\\n", "a.py").decode().splitlines()[1]
    'x = 1'
    """
    carrier = _carrier(data, name.lower())
    if carrier is None:
        return data
    return _fill(carrier, _digest(_zeroed(carrier), place))


def mark_text() -> str:
    """The mark with its digits zeroed, for a format that carries it inside its own data (a
    memory snapshot's pickle holds it as a string): `marked` then fills in the digits, which
    keep the string's length.

    >>> mark_text().endswith("sac-workbench-mark:0000000000000000")
    True
    """
    return f"sac-workbench (replaced when run again); {_TAG}{_ZERO}"


# --- the mark in each format -----------------------------------------------------------------


def _note(comment: str) -> str:
    return f"{comment} written by sac-workbench, replaced when run again; {_TAG}{_ZERO}"


def _carrier(data: bytes, name: str) -> bytes | None:
    """`data` with a mark of zeroed digits, or None when its format has no place for one."""
    if data.startswith(_PNG):
        return _png_with_text(data, f"written by sac-workbench; {_TAG}{_ZERO}".encode())
    if data.startswith(b"%PDF-"):
        return _pdf_with_creator(data, f"written by sac-workbench; {_TAG}{_ZERO}")
    if data.startswith(b"\x80"):  # a pickle (protocol 2 or later): its writer put in a mark
        return data if _find(data) is not None else None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    as_json = _json_with_key(text) if text.lstrip().startswith("{") else None
    if as_json is not None or name.endswith(".json"):
        return as_json
    if name.endswith(".svg") or text.lstrip().startswith(("<?xml", "<svg")):
        return _after_declaration(text, f"<!--{_note('')} -->\n")
    if name.endswith((".dot", ".gv")):
        return (_note("//") + "\n" + text).encode()
    if not name.endswith(HASH_COMMENTS):
        return None
    if text.startswith("#!"):  # keep the interpreter line first
        first, _, rest = text.partition("\n")
        return (first + "\n" + _note("#") + "\n" + rest).encode()
    return (_note("#") + "\n" + text).encode()


def _after_declaration(text: str, comment: str) -> bytes:
    if text.startswith("<?xml"):
        end = text.index("?>") + 2
        return (text[:end] + "\n" + comment + text[end:].lstrip("\n")).encode()
    return (comment + text).encode()


def _json_with_key(text: str) -> bytes | None:
    """The mark as the object's first key, inserted into the text: the rest stays as it was."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if MARK_KEY in data:  # a copy of a marked file: its old mark goes
        data.pop(MARK_KEY)
        text = json.dumps(data, indent=2) + "\n"
    start = text.index("{") + 1
    gap = text[start : len(text) - len(text[start:].lstrip())]
    entry = json.dumps({MARK_KEY: f"sac-workbench (replaced when run again); {_TAG}{_ZERO}"})
    entry = entry[1:-1] + ("," + (gap or " ") if data else "")
    return (text[:start] + gap + entry + text[start + len(gap) :]).encode()


def _png_with_text(data: bytes, text: bytes) -> bytes:
    """A tEXt chunk `Software` right after IHDR (the first chunk, 8 + 25 bytes in)."""
    body = b"tEXt" + b"Software\0" + text
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    return data[:33] + chunk + data[33:]


def _pdf_with_creator(data: bytes, text: str) -> bytes:
    """An incremental update appending a document information dictionary: the original
    bytes stay as they are, readers take the newest trailer."""
    tail = data[-4096:].decode("latin-1")
    size = re.findall(r"/Size\s+(\d+)", tail)
    root = re.findall(r"/Root\s+(\d+\s+\d+\s+R)", tail)
    start = re.findall(r"startxref\s+(\d+)", tail)
    if not (size and root and start):  # a cross-reference stream: a comment carries it
        return data.rstrip(b"\n") + f"\n%{text}\n".encode()
    number = int(size[-1])
    body = data if data.endswith(b"\n") else data + b"\n"
    offset = len(body)
    update = f"{number} 0 obj\n<< /Creator ({text}) >>\nendobj\n"
    xref = offset + len(update)
    update += (
        f"xref\n{number} 1\n{offset:010d} 00000 n \ntrailer\n<< /Size {number + 1} "
        f"/Root {root[-1]} /Info {number} 0 R /Prev {start[-1]} >>\nstartxref\n{xref}\n%%EOF\n"
    )
    return body + update.encode("latin-1")


def _find(data: bytes) -> re.Match[bytes] | None:
    """The mark: the last one in a PDF (appended), else the first (written before any of
    the content, which might quote a mark)."""
    if data.startswith(b"%PDF-"):
        base = max(0, len(data) - 8192)
        matches = list(_MARK_RE.finditer(data, base))
        return matches[-1] if matches else None
    return _MARK_RE.search(data)


def _zeroed(data: bytes) -> bytes:
    """`data` with the mark's digits zeroed (and in a PNG the chunk's CRC, which covers them)."""
    found = _find(data)
    assert found is not None
    end = found.end()
    crc = 4 if data.startswith(_PNG) else 0
    return data[: found.start(1)] + _ZERO.encode() + b"\0" * crc + data[end + crc :]


def _fill(data: bytes, digest: str) -> bytes:
    found = _find(data)
    assert found is not None
    filled = data[: found.start(1)] + digest.encode() + data[found.end() :]
    if data.startswith(_PNG):  # the tEXt chunk's CRC over its type and data
        length = struct.unpack(">I", filled[33:37])[0]
        filled = filled[: 41 + length] + struct.pack(">I", zlib.crc32(filled[37 : 41 + length]))
        filled += data[45 + length :]
    return filled


def _ownership(target: Path) -> str:
    """ "" when `target` is the workbench's own unchanged file, else why it is not."""
    try:
        info = os.lstat(target)
    except OSError as err:
        return f"cannot be checked ({err.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if info.st_size > MAX_MARKED_BYTES:
        return "is larger than the workbench writes"
    try:
        data = read_file(target, repr(str(target)), MAX_MARKED_BYTES)
    except WorkbenchError:
        return "cannot be read"
    found = _find(data)
    place = _place(target)
    if found is None:
        return _ownership_beside(target, data, place)
    if _digest(_zeroed(data), place) != found.group(1).decode():
        return "was changed since the workbench wrote it, or is a copy of a file it wrote elsewhere"
    return ""


def _ownership_beside(target: Path, data: bytes, place: str) -> str:
    """`_ownership` of a file with no mark of its own: its sidecar's mark, if any."""
    sidecar = _sidecar(target)
    try:
        found = _MARK_RE.search(read_file(sidecar, repr(str(sidecar)), 4096))
    except WorkbenchError:
        found = None
    if found is None or sidecar.is_symlink():
        return "was not written by the workbench (it has no sac-workbench mark)"
    if _digest(data, place) != found.group(1).decode():
        return (
            "was changed since the workbench wrote it (its mark is in " + repr(sidecar.name) + ")"
        )
    return ""


# --- checks ----------------------------------------------------------------------------------


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def _refuse_special(info: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = _kind(info.st_mode)
        raise WorkbenchError(f"cannot read {what}: it is {kind}, not a regular file")


def _size(limit: int) -> str:
    return f"{limit / 2**20:g} MiB" if limit >= 2**20 else f"{limit} bytes"


def _check_target(target: Path, overwrite: bool) -> bool:
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
    if not os.path.lexists(target):
        return False
    reason = "" if overwrite else _ownership(target)
    if reason:
        raise _exists(target, reason)
    return True


def _exists(target: Path, reason: str) -> WorkbenchError:
    why = f" and {reason}" if reason else ""
    return WorkbenchError(
        f"{str(target)!r} exists{why}: pass overwrite=True (--overwrite on the command line) "
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
