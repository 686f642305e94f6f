"""The explorer's session pieces in plain Python (no Jupyter), one module per concern, named
here under the one import place they have always had.

- `policy_state`: the current policy with undo and redo (`Edits`, `PolicyState`),
  `policy_label`, `start_policy`;
- `history`: tried policies, re-timed per profile (`History`, `Point`);
- `autosave`: the policy file that never loses a user's policy (`Autosave`, `graph_key`,
  `default_autosave`, `legacy_autosave`);
- `exports`: the policy as code, saved without replacing anyone's file (`Exports`,
  `EXPORT_NAMES`, `export_stem`);
- `sources`: what an explorer opens on (`load_source`).
"""

from __future__ import annotations

from workbench.show.widgets.autosave import (
    Autosave,
    default_autosave,
    graph_key,
    legacy_autosave,
)
from workbench.show.widgets.exports import EXPORT_NAMES, Exports, export_stem
from workbench.show.widgets.history import History, Point
from workbench.show.widgets.policy_state import Edits, PolicyState, policy_label, start_policy
from workbench.show.widgets.sources import load_source

__all__ = [
    "EXPORT_NAMES",
    "Autosave",
    "Edits",
    "Exports",
    "History",
    "Point",
    "PolicyState",
    "default_autosave",
    "export_stem",
    "graph_key",
    "legacy_autosave",
    "load_source",
    "policy_label",
    "start_policy",
]
