"""The README is a guide and docs/ the reference: the README stays short, every relative link
in them points to a file (and heading) that exists, and every `python -m workbench` example
is a command the CLI parses, with docs/cli.md showing each command at least once.

The tables of differences from graph trainer in docs/torchtitan.md are checked in
test_explain.py, the `solve --budget-frac` example's feasibility in test_cli.py.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from workbench.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_WORDS = 1500
MAX_SCREENSHOT_BYTES = 400_000

FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
EXAMPLE = re.compile(r"(?:^|\s)\S*python3?\s+-m\s+workbench\s+(.*)$")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code: where links are links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (`## The pass` -> `the-pass`)."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", FENCE.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _links() -> list[tuple[Path, str]]:
    return [
        (page, target)
        for page in PAGES
        for target in LINK.findall(_prose(page.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: ...
    ]


def _examples() -> list[tuple[str, list[str]]]:
    """(`FILE:LINE`, argv) for every `python -m workbench ...` line in a code block, with
    backslash continuations joined and `# comments` dropped."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.finditer(text):
            first = text.count("\n", 0, block.start()) + 1
            lines = block.group().splitlines()
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i]
                i += 1
                match = EXAMPLE.search(line)
                if match:
                    argv = shlex.split(match.group(1), comments=True)
                    found.append((f"{_name(page)}:{first + start}", argv))
    return found


def _command_paths(parser: argparse.ArgumentParser) -> set[tuple[str, ...]]:
    """Every runnable command of the parser: `("trace",)`, `("policy", "explain")`, ..."""
    paths: set[tuple[str, ...]] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = _command_paths(sub)
                paths |= {(name, *rest) for rest in inner} if inner else {(name,)}
    return paths


def _command_of(argv: list[str], known: set[tuple[str, ...]]) -> tuple[str, ...]:
    """The command an example runs: `("trace",)`, `("bench", "whatif")`, ..."""
    return tuple(argv[:2]) if tuple(argv[:2]) in known else tuple(argv[:1])


def test_readme_is_a_guide_of_at_most_1500_words() -> None:
    words = len(README.read_text().split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words; move reference to docs/"


def test_readme_shows_the_explorer_from_docs() -> None:
    shots = [t for p, t in _links() if p == README and t.endswith(".png")]
    assert shots == ["docs/explorer.png"]
    assert (ROOT / shots[0]).stat().st_size < MAX_SCREENSHOT_BYTES


def test_readme_links_every_docs_page() -> None:
    linked = {(README.parent / t.split("#")[0]).resolve() for p, t in _links() if p == README}
    assert [_name(d) for d in DOCS if d.resolve() not in linked] == []


@pytest.mark.parametrize(
    ("page", "target"), _links(), ids=[f"{_name(p)}->{t}" for p, t in _links()]
)
def test_relative_links_point_to_existing_files(page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    assert file.exists(), f"{_name(page)} links to {target}, which does not exist"
    if anchor:
        assert file.suffix == ".md" and anchor in _anchors(file), (
            f"{_name(page)} links to {target}: no heading with that anchor"
        )


@pytest.mark.parametrize(("where", "argv"), _examples(), ids=[w for w, _ in _examples()])
def test_cli_examples_parse(where: str, argv: list[str], capsys: pytest.CaptureFixture) -> None:
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `python -m workbench {shlex.join(argv)}`: {capsys.readouterr().err}")


def test_cli_doc_shows_every_command() -> None:
    known = _command_paths(build_parser())
    shown = {_command_of(argv, known) for where, argv in _examples() if "cli.md" in where}
    assert sorted(known - shown) == []
