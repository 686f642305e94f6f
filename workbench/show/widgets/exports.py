"""The explorer's export in plain Python: the policy as code in one format, and the file it
goes to, saved without replacing a file this session did not write.

Entry points: `Exports` (`show(policy, graph)`, `set_format`, `choose`, `save`),
`EXPORT_NAMES` (each format's file name ending) and `export_stem` (a default name's stem).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from workbench.capture.graph import JointGraph
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.files import write_file
from workbench.interop.export import FORMATS, export
from workbench.show.widgets.autosave import read_bytes

__all__ = ["EXPORT_NAMES", "Exports", "export_stem"]

# File name endings of each export format: code is `.py`, torchtitan's options are command
# line flags for its run script, the policy itself is JSON.
EXPORT_NAMES = {
    "policy_fn": "_sac_policy_fn.py",
    "graph_pass": "_sac_graph_pass.py",
    "torchtitan": "_sac_torchtitan.sh",
    "json": "_sac_policy.json",
}
MAX_STEM = 120  # characters of a default name's stem (the graph key's words are capped alike)
MAX_COPIES = 999  # numbered default names tried when the first ones hold others' files


def export_stem(name: str) -> str:
    """`name` (a graph's key, `autosave.graph_key`) as the stem of a file name that every OS
    accepts and that Python imports by module name: letters, digits and `_` only, never a
    digit first (`STEM_sac_policy_fn.py` is then a valid module name).

    >>> export_stem("torchtitan:llama3/8B-seq128-fake-1a2b3c4d")
    'torchtitan_llama3_8B_seq128_fake_1a2b3c4d'
    >>> export_stem("3b model"), export_stem("..")
    ('m_3b_model', 'm')
    """
    stem = re.sub(r"\W+", "_", name, flags=re.ASCII).strip("_")[-MAX_STEM:].lstrip("_")
    if not stem:
        return "m"
    return f"m_{stem}" if stem[0].isdigit() else stem


class Exports:
    """The policy as code in one format, and the file it goes to.

    By default the file is named for the graph and the format (`STEM_sac_policy_fn.py`,
    `export_stem` of the graph's key, beside the autosave file), so explorers on different
    graphs never propose the same file; a chosen name keeps its stem when the format changes.
    `save` replaces only a file this session wrote and nobody changed since: a default name
    that holds another file moves on to the next free one (`STEM_2_...`), a chosen one is
    refused.
    """

    def __init__(self, name: str, folder: Path, fmt: str = "policy_fn") -> None:
        self.stem = export_stem(name)
        self.folder = folder
        self.format = _checked_format(fmt)
        self.copy: int | None = 1  # the default name's number (None: a name chosen)
        self.path = self._default(1)
        self.code = ""
        self.refusal = ""  # why the format cannot say the policy ("" when it can)
        self._written: dict[Path, bytes | None] = {}
        # file -> times this session saved it, the time of the last save and of the one before
        self._saves: dict[Path, tuple[int, str, str]] = {}
        self._passed: Path | None = None  # a default name the last save passed over

    def show(self, policy: Policy, graph: JointGraph) -> None:
        """The code for `policy`; a format that cannot say it (policy_fn and offload) shows
        why instead, and `save` refuses it."""
        try:
            self.code = export(policy, self.format, graph=graph)
            self.refusal = ""
        except WorkbenchError as err:
            self.refusal = str(err)
            self.code = f"# cannot export as {self.format}: {err}\n"

    def _default(self, copy: int) -> Path:
        """The default file of the current format: `STEM_sac_...`, or `STEM_N_sac_...`."""
        stem = self.stem if copy == 1 else f"{self.stem}_{copy}"
        return self.folder / (stem + EXPORT_NAMES[self.format])

    def set_format(self, fmt: str) -> None:
        """Change the format (call `show` next); the file's ending follows it."""
        self.format = _checked_format(fmt)
        if self.copy is not None:
            self.path = self._default(self.copy)
        else:
            self.path = self.path.with_suffix(Path(EXPORT_NAMES[fmt]).suffix)

    def choose(self, path: str | os.PathLike[str]) -> None:
        """The file Save writes next: a name the user chose (the default one stays default)."""
        target = Path(path)
        if target != self.path:
            self.path, self.copy = target, None

    def format_words(self) -> str:
        """The message line after a change of format: why it cannot say the policy, or that
        nothing is saved yet and where Save will write."""
        if self.refusal:
            return f"export format {self.format}: {self.refusal}"
        return f"export format {self.format}: not saved yet; Save writes {self.path}"

    def saved_words(self, target: Path) -> str:
        """What the last `save` to `target` did, for the message line: the format, and when
        it replaces this session's earlier copy, which save it is and the earlier one's time.
        """
        count, now, before = self._saves[target]
        line = f"saved the {self.format} export to {target} at {now}"
        if self._passed is not None:
            line += (
                f" ({self._passed.name} holds a file this explorer did not write, or one "
                "edited since: it is left as it is)"
            )
        if count > 1:
            line += f" (save {count} of this file: replaced the copy saved at {before})"
        return line

    def _taken(self, target: Path) -> bool:
        """Whether `target` holds a file this session did not write, or that changed since."""
        ours = self._written.get(target)
        return os.path.lexists(target) and (ours is None or read_bytes(target) != ours)

    def _free_default(self) -> Path:
        """The current default name, or the first numbered one after it that is free."""
        assert self.copy is not None
        for copy in range(self.copy, MAX_COPIES + 1):
            if not self._taken(self._default(copy)):
                self.copy = copy
                return self._default(copy)
        raise WorkbenchError(
            f"no free export name for {self.stem} in {str(self.folder)!r} (tried "
            f"_2 to _{MAX_COPIES}): choose an export path"
        )

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the shown code to `path` (default: the current file), which becomes the
        current file. A file that changed since this session wrote it is kept: the default
        name moves on to a free one, a chosen name is refused."""
        if self.refusal:
            raise WorkbenchError(self.refusal)
        if path is not None and str(path):
            self.choose(path)
        wanted = self.path
        target = self._free_default() if self.copy is not None else wanted
        self._passed = wanted if target != wanted else None
        if target.is_dir():
            raise WorkbenchError(f"{str(target)!r} is a folder: name a file to export to")
        if self._taken(target):
            raise WorkbenchError(
                f"{str(target)!r} exists and was not written by this explorer (or was edited "
                "since): choose another export path"
            )
        write_file(target, self.code, overwrite=os.path.lexists(target))
        self._written[target] = read_bytes(target)  # as written: with the workbench's mark
        count, before, _ = self._saves.get(target, (0, "", ""))
        self._saves[target] = (count + 1, time.strftime("%H:%M:%S"), before)
        self.path = target
        return target


def _checked_format(fmt: str) -> str:
    if fmt not in EXPORT_NAMES:
        raise WorkbenchError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt
