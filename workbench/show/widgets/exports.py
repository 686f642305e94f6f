"""The explorer's export in plain Python: the policy as code in one format, and the file it
goes to, saved without replacing a file this session did not write.

Entry points: `Exports` (`show(policy, graph)`, `set_format`, `save`) and `EXPORT_NAMES`
(each format's file name ending).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from workbench.capture.graph import JointGraph
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.files import file_stem, write_file
from workbench.interop.export import FORMATS, export
from workbench.show.widgets.autosave import read_bytes

__all__ = ["EXPORT_NAMES", "Exports"]

# File name endings of each export format: code is `.py`, torchtitan's options are command
# line flags for its run script, the policy itself is JSON.
EXPORT_NAMES = {
    "policy_fn": "_sac_policy_fn.py",
    "graph_pass": "_sac_graph_pass.py",
    "torchtitan": "_sac_torchtitan.sh",
    "json": "_sac_policy.json",
}


class Exports:
    """The policy as code in one format, and the file it goes to.

    The file is named for the model and the format (`MODEL_sac_policy_fn.py` beside the
    autosave file); a chosen name keeps its stem when the format changes. `save` replaces
    only a file this session wrote and nobody changed since.
    """

    def __init__(self, model_name: str, folder: Path, fmt: str = "policy_fn") -> None:
        self.model_name = file_stem(model_name)
        self.format = _checked_format(fmt)
        self.path = folder / (self.model_name + EXPORT_NAMES[fmt])
        self.code = ""
        self.refusal = ""  # why the format cannot say the policy ("" when it can)
        self._written: dict[Path, bytes | None] = {}
        # file -> times this session saved it, the time of the last save and of the one before
        self._saves: dict[Path, tuple[int, str, str]] = {}

    def show(self, policy: Policy, graph: JointGraph) -> None:
        """The code for `policy`; a format that cannot say it (policy_fn and offload) shows
        why instead, and `save` refuses it."""
        try:
            self.code = export(policy, self.format, graph=graph)
            self.refusal = ""
        except WorkbenchError as err:
            self.refusal = str(err)
            self.code = f"# cannot export as {self.format}: {err}\n"

    def set_format(self, fmt: str) -> None:
        """Change the format (call `show` next); the file's ending follows it."""
        _checked_format(fmt)
        old, self.format = self.format, fmt
        if self.path.name == self.model_name + EXPORT_NAMES[old]:
            self.path = self.path.with_name(self.model_name + EXPORT_NAMES[fmt])
        else:
            self.path = self.path.with_suffix(Path(EXPORT_NAMES[fmt]).suffix)

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
        if count > 1:
            line += f" (save {count} of this file: replaced the copy saved at {before})"
        return line

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the shown code to `path` (default: the current file), which becomes the
        current file. A file that changed since this session wrote it is kept."""
        if self.refusal:
            raise WorkbenchError(self.refusal)
        target = Path(path or self.path)
        if target.is_dir():
            raise WorkbenchError(f"{str(target)!r} is a folder: name a file to export to")
        ours = self._written.get(target)
        if os.path.lexists(target) and (ours is None or read_bytes(target) != ours):
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
