"""The one file writer: atomic, never clobbering unless asked, one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workbench.errors import WorkbenchError
from workbench.files import write_file


def test_writes_text_and_bytes(tmp_path: Path) -> None:
    assert write_file(tmp_path / "a.txt", "héllo\n").read_text(encoding="utf-8") == "héllo\n"
    assert write_file(tmp_path / "b.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin"]  # no temp files


def test_keeps_an_existing_file_unless_overwrite(tmp_path: Path) -> None:
    path = write_file(tmp_path / "p.json", "first")
    with pytest.raises(WorkbenchError, match="exists; pass overwrite=True"):
        write_file(path, "second")
    assert path.read_text() == "first"
    write_file(path, "second", overwrite=True)
    assert path.read_text() == "second"


def test_never_follows_a_dangling_symlink(tmp_path: Path) -> None:
    link = tmp_path / "link.svg"
    os.symlink(tmp_path / "elsewhere.svg", link)
    with pytest.raises(WorkbenchError, match="exists"):
        write_file(link, "x")
    assert not (tmp_path / "elsewhere.svg").exists()
    write_file(link, "x", overwrite=True)  # replaces the link itself
    assert not link.is_symlink() and link.read_text() == "x"
    assert not (tmp_path / "elsewhere.svg").exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing" / "f.py", "is missing"),
        (lambda d: d, "it is a folder"),
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
