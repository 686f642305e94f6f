"""The one file writer and reader: atomic, replacing only the workbench's own unchanged
files (its mark, per format), regular files only, one-line errors."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from workbench.errors import WorkbenchError
from workbench.files import MARK_KEY, file_stem, is_ours, marked, read_file, write_file


@functools.cache
def _dot(fmt: str) -> bytes:
    """Graphviz's output, made once per format: its PDF holds a creation time to the second,
    so two runs a second apart differ."""
    return subprocess.run(
        ["dot", f"-T{fmt}"], input=b"digraph{a->b}", capture_output=True, check=True
    ).stdout


def _pdf_info_creator(data: bytes) -> str:
    """The document's Creator as a reader finds it: the last trailer's /Info object, at the
    offset its cross-reference section gives."""
    tail = data[-4096:].decode("latin-1")
    start = int(re.findall(r"startxref\s+(\d+)", tail)[-1])
    section = data[start:].decode("latin-1")
    number = int(re.search(r"/Info (\d+) 0 R", section).group(1))  # type: ignore[union-attr]
    first, count = map(int, re.search(r"xref\n(\d+) (\d+)", section).groups())  # type: ignore[union-attr]
    assert first <= number < first + count
    entry = section.split("\n")[2 + number - first]
    offset = int(entry.split()[0])
    obj = data[offset:].decode("latin-1")
    assert obj.startswith(f"{number} 0 obj")
    return re.search(r"/Creator \(([^)]*)\)", obj).group(1)  # type: ignore[union-attr]


FORMATS = ["svg", "png", "pdf", "dot", "py", "sh", "json"]


def _content(fmt: str) -> bytes:
    if fmt in ("svg", "png", "pdf"):
        return _dot(fmt)
    return {
        "dot": b"digraph {a -> b}\n",
        "py": b'"""doc"""\n\nfrom __future__ import annotations\n\nx = 1\n',
        "sh": b"#!/bin/sh\necho hi\n",
        "json": json.dumps({"schema": "sac-workbench/policy", "version": 1}, indent=2).encode(),
    }[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_rerun_replaces_its_own_output(tmp_path: Path, fmt: str) -> None:
    """Written twice without overwrite: the second run replaces the first (marked) file."""
    path = tmp_path / f"out.{fmt}"
    write_file(path, _content(fmt))
    assert is_ours(path)
    write_file(path, _content(fmt))
    assert is_ours(path) and [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("fmt", FORMATS)
def test_users_and_edited_files_are_refused(tmp_path: Path, fmt: str) -> None:
    users = tmp_path / f"mine.{fmt}"
    users.write_bytes(_content(fmt))  # the same content, but not written by the workbench
    with pytest.raises(WorkbenchError, match="not written by the workbench.*--overwrite"):
        write_file(users, _content(fmt))
    assert users.read_bytes() == _content(fmt)
    edited = tmp_path / f"edited.{fmt}"
    write_file(edited, _content(fmt))
    changed = edited.read_bytes().replace(b"a", b"c", 1)
    edited.write_bytes(changed)
    with pytest.raises(WorkbenchError, match="was changed since the workbench wrote it"):
        write_file(edited, _content(fmt))
    assert edited.read_bytes() == changed
    write_file(edited, _content(fmt), overwrite=True)
    assert is_ours(edited)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_mark_keeps_each_format_readable(tmp_path: Path, fmt: str) -> None:
    data = marked(_content(fmt), f"x.{fmt}")
    assert b"sac-workbench-mark:" in data
    if fmt == "png":
        from PIL import Image

        (tmp_path / "x.png").write_bytes(data)
        with Image.open(tmp_path / "x.png") as image:
            image.verify()  # every chunk's CRC
        with Image.open(tmp_path / "x.png") as image:
            assert "sac-workbench-mark:" in image.info["Software"]
    elif fmt == "pdf":
        assert "sac-workbench-mark:" in _pdf_info_creator(data)
        assert data.startswith(_content(fmt))  # an incremental update: the original intact
    elif fmt == "json":
        loaded = json.loads(data)
        assert list(loaded)[0] == MARK_KEY
        assert {k: v for k, v in loaded.items() if k != MARK_KEY} == json.loads(_content(fmt))
    elif fmt == "py":
        namespace: dict[str, object] = {}
        exec(compile(data, "x.py", "exec"), namespace)
        assert namespace["x"] == 1 and namespace["__doc__"] == "doc"
    elif fmt == "sh":
        assert data.startswith(b"#!/bin/sh\n# written by sac-workbench")
        assert subprocess.run(["sh", "-c", data.decode()], capture_output=True).stdout == b"hi\n"
    elif fmt == "dot":
        assert subprocess.run(["dot", "-Tsvg"], input=data, capture_output=True).returncode == 0
    else:
        from xml.etree import ElementTree

        assert ElementTree.fromstring(data).tag.endswith("svg")


def test_other_kinds_carry_their_mark_beside_them(tmp_path: Path) -> None:
    """Data with no place for a mark (an unknown suffix, binary) is written as it is, its
    mark in a sidecar file: replaced when run again, kept once edited or copied."""
    path = write_file(tmp_path / "b.bin", b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01" and is_ours(path)
    write_file(path, b"\x00\x02")
    assert path.read_bytes() == b"\x00\x02"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".b.bin.sac-workbench", "b.bin"]
    path.write_bytes(b"\x00\x03")
    with pytest.raises(WorkbenchError, match="was changed since the workbench wrote it"):
        write_file(path, b"\x00\x04")
    copy = tmp_path / "c.bin"
    copy.write_bytes(b"\x00\x02")
    (tmp_path / ".c.bin.sac-workbench").write_bytes(
        (tmp_path / ".b.bin.sac-workbench").read_bytes()
    )
    with pytest.raises(WorkbenchError, match="was changed since"):
        write_file(copy, b"\x00\x05")
    assert path.read_bytes() == b"\x00\x03" and copy.read_bytes() == b"\x00\x02"
    write_file(path, b"\x00\x02", overwrite=True)
    assert path.read_bytes() == b"\x00\x02"


def test_only_new_and_unmarked_copies(tmp_path: Path) -> None:
    """The explorer's copies aside: byte for byte, never replacing anything."""
    path = write_file(tmp_path / "p.json", "{}")
    with pytest.raises(WorkbenchError, match="exists"):
        write_file(path, "{}", only_new=True)
    copy = write_file(tmp_path / "p.json.stale", b"{not json", only_new=True, mark=False)
    assert copy.read_bytes() == b"{not json"


def test_never_follows_a_dangling_symlink(tmp_path: Path) -> None:
    link = tmp_path / "link.svg"
    os.symlink(tmp_path / "elsewhere.svg", link)
    with pytest.raises(WorkbenchError, match="exists and is a symbolic link"):
        write_file(link, "<svg/>")
    assert not (tmp_path / "elsewhere.svg").exists()
    write_file(link, "<svg/>", overwrite=True)  # replaces the link itself
    assert not link.is_symlink() and is_ours(link)
    assert not (tmp_path / "elsewhere.svg").exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing" / "f.py", "is missing"),
        (lambda d: d, "it is a folder"),
        (lambda d: "", "the output path is empty"),
    ],
)
def test_bad_targets_are_one_line_errors(tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(WorkbenchError, match=message) as err:
        write_file(make(tmp_path), "x")
    assert "\n" not in str(err.value)


def test_parent_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(WorkbenchError, match="is not a folder"):
        write_file(tmp_path / "f" / "g.json", "x")


def test_read_file(tmp_path: Path) -> None:
    path = tmp_path / "a"
    path.write_bytes(b"abc")
    assert read_file(path, "a", 3) == b"abc"
    with pytest.raises(WorkbenchError, match="cannot read a: No such file"):
        read_file(tmp_path / "missing", "a", 3)
    with pytest.raises(WorkbenchError, match="cannot read a: it is a folder"):
        read_file(tmp_path, "a", 3)


def test_file_stem() -> None:
    assert file_stem("torchtitan:llama3/8B") == "torchtitan:llama3_8B"
    assert file_stem("..") == "_" and "/" not in file_stem("a/../b")
