"""The explorer's export panel: the current policy as code in the chosen format, shown after
every change (`core.ExplorerCore._refresh`) and saved on request.

Entry point: `Exporting` (`set_export_format`, `save_export`, and `export_format`,
`export_code`, `export_path` for the front end), one of the concerns `ExplorerModel` combines.
"""

from __future__ import annotations

from pathlib import Path

from workbench.show.widgets.core import ExplorerCore

__all__ = ["Exporting"]


class Exporting(ExplorerCore):
    """The export file (`exports.Exports`): a format, the code, the file it goes to."""

    @property
    def export_format(self) -> str:
        return self.exports.format

    @property
    def export_code(self) -> str:
        return self.exports.code

    @property
    def export_path(self) -> str:
        return str(self.exports.path)

    def set_export_format(self, fmt: str) -> None:
        """Show the policy in another export format; the export file's ending follows."""
        self.exports.set_format(fmt)
        self.exports.show(self.policy, self.graph)
        self.message = self.exports.format_words()

    def set_export_path(self, path: str) -> None:
        """The file Save writes next (its name as the front end's path box has it)."""
        self.exports.choose(path)

    def save_export(self, path: str | None = None) -> Path:
        """Write the shown code. A file that changed since this explorer wrote it is kept."""
        target = self.exports.save(path)
        self.message = self.exports.saved_words(target)
        return target
