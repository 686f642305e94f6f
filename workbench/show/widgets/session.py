"""The explorer's session state in plain Python (no Jupyter): undo/redo, the history of tried
policies, the autosave file that never loses a user's policy, and the export file.

Entry points: `Edits` (undo/redo), `History` (tried policies, re-timed per profile),
`Autosave` (`recover(graph, start)`, `save(policy)`), `default_autosave(graph)` (a file named
for the graph, `graph_key`) and `Exports` (the policy as code, saved without replacing anyone's
file), all testable without a browser.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace
from workbench.decide.decider import restrict
from workbench.decide.policy import MAX_POLICY_FILE_BYTES, Policy
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError
from workbench.files import MAX_MARKED_BYTES, file_stem, read_file, write_file
from workbench.interop.export import FORMATS, export
from workbench.show.viz import pareto_front
from workbench.units import format_bytes, format_seconds

__all__ = [
    "EXPORT_NAMES",
    "Autosave",
    "Edits",
    "Exports",
    "History",
    "Point",
    "default_autosave",
    "graph_key",
    "legacy_autosave",
    "load_source",
    "policy_label",
    "start_policy",
]


class Edits:
    """The current policy with undo and redo stacks; a new change clears redo."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._undo: list[Policy] = []
        self._redo: list[Policy] = []

    @property
    def can_undo(self) -> bool:
        return bool(self._undo)

    @property
    def can_redo(self) -> bool:
        return bool(self._redo)

    def change(self, policy: Policy) -> bool:
        """Make `policy` current (undoable); False when it equals the current one."""
        if policy == self.policy:
            return False
        self._undo.append(self.policy)
        self._redo.clear()
        self.policy = policy
        return True

    def undo(self) -> Policy:
        if not self._undo:
            raise WorkbenchError("nothing to undo")
        self._redo.append(self.policy)
        self.policy = self._undo.pop()
        return self.policy

    def redo(self) -> Policy:
        if not self._redo:
            raise WorkbenchError("nothing to redo")
        self._undo.append(self.policy)
        self.policy = self._redo.pop()
        return self.policy


def policy_label(policy: dict[str, Any]) -> str:
    """`eager + 3 edits`: the preset and how many selectors and overrides sit on it."""
    changes = len(policy["selectors"]) + len(policy["overrides"])
    return policy["preset"] + (f" + {changes} edits" if changes else "")


@dataclass
class Point:
    """One tried policy: estimated step time per device profile, or one measured time."""

    policy: dict[str, Any]
    peak_bytes: int
    seconds: dict[str, float]  # profile -> estimated step time; {device: time} when measured
    measured: bool = False
    solver: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return ("solver: " if self.solver else "") + policy_label(self.policy)


class History:
    """Every policy tried, one estimated and at most one measured point per policy.

    Estimated points keep their time on every profile, so switching the profile re-times
    them; measured points are times on a real device and form their own front.
    """

    def __init__(self) -> None:
        self.points: list[Point] = []

    def add(self, point: Point) -> None:
        """Add `point`, replacing an earlier one of the same policy and kind."""
        self.points = [
            p
            for p in self.points
            if not (p.policy == point.policy and p.measured == point.measured)
        ]
        self.points.append(point)

    def policy(self, index: int) -> Policy:
        if not 0 <= index < len(self.points):
            raise WorkbenchError(f"no history point #{index}; there are {len(self.points)}")
        return Policy.from_json(self.points[index].policy)

    def to_json(self, profile: str) -> list[dict[str, Any]]:
        """Points for the plot: `step_seconds` on `profile` for estimates (the measured time
        for measured points) and `pareto` within each kind; `peak` and `step` as text."""
        rows = []
        for index, p in enumerate(self.points):
            seconds = next(iter(p.seconds.values())) if p.measured else p.seconds[profile]
            rows.append({
                "index": index, "name": p.name, "policy": p.policy, "peak_bytes": p.peak_bytes,
                "step_seconds": seconds, "measured": p.measured,
                "peak": format_bytes(p.peak_bytes), "step": format_seconds(seconds),
                "profile": next(iter(p.seconds)) if p.measured else profile,
                **({"solver": p.solver} if p.solver else {}), **p.extra,
            })  # fmt: skip
        on_front: set[int] = set()
        for measured in (False, True):
            kind = [r for r in rows if r["measured"] == measured]
            on_front |= {r["index"] for r in pareto_front(kind)}
        return [{**r, "pareto": r["index"] in on_front} for r in rows]


def _claim(path: Path, suffix: str, data: bytes) -> Path:
    """Write `data` to the first free name among `path+suffix`, `path+suffix.2`, ... (never
    replacing a file, also when two sessions race for the same name)."""
    for n in range(1, 1000):
        candidate = path.with_name(path.name + suffix + (f".{n}" if n > 1 else ""))
        if os.path.lexists(candidate):
            continue
        try:
            return write_file(candidate, data, only_new=True, mark=False)
        except WorkbenchError:
            if not os.path.lexists(candidate):
                raise
    raise WorkbenchError(f"no free name for a copy of {str(path)!r} (tried {suffix}.2 to .999)")


def _relocated(path: Path) -> Path:
    """`policy.json` -> the first of `policy.2.json`, `policy.3.json`, ... that is free."""
    for n in range(2, 1000):
        candidate = path.with_name(f"{path.stem}.{n}{path.suffix}")
        if not os.path.lexists(candidate):
            return candidate
    raise WorkbenchError(f"no free autosave name next to {str(path)!r}")


class Autosave:
    """The policy file one explorer keeps up to date.

    Rules: a file this session did not write (another explorer's, or edited by hand) is
    never replaced — the session moves to a free name and says so; an unreadable file or
    one with entries that no longer apply is first copied aside under a name no other
    copy holds. `save` never raises: a failure comes back as the line to show.
    """

    def __init__(self, path: str | os.PathLike[str], legacy: Path | None = None) -> None:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"autosave must be a file path (str or os.PathLike), got {path!r}")
        self.path = Path(path)
        if os.path.lexists(self.path) and not os.path.isfile(self.path):
            raise WorkbenchError(
                f"autosave {str(self.path)!r} is not a regular file (a folder, device or pipe): "
                "name a .json file"
            )
        self.legacy = legacy  # an earlier version's file for the same model (`legacy_autosave`)
        self._last: bytes | None = None  # what this session last read or wrote there

    @classmethod
    def of(cls, graph: JointGraph, path: str | os.PathLike[str] | None) -> Autosave:
        """The autosave at `path`, or by default the graph's own file (`default_autosave`),
        which may take over an earlier version's file for the model (`legacy_autosave`)."""
        if path:
            return cls(path)
        return cls(default_autosave(graph), legacy_autosave(graph.model_name))

    def _read(self) -> bytes | None:
        if not os.path.lexists(self.path):
            return None
        return read_file(self.path, f"autosave {str(self.path)!r}", MAX_POLICY_FILE_BYTES)

    def recover(self, graph: JointGraph, start: Policy) -> tuple[Policy, str]:
        """The autosaved policy when there is one (what still applies to `graph`), else
        `start`; and the line that tells the user what happened."""
        try:
            data = self._read()
        except WorkbenchError as err:
            self.path = _relocated(self.path)
            return (
                start,
                f"{err}; it is left as it is and this explorer autosaves to {self.path.name}",
            )
        if data is None:
            return self._migrate(graph, start)
        try:
            saved = Policy.from_bytes(data, f"autosave {str(self.path)!r}")
        except WorkbenchError as err:
            kept = _claim(self.path, ".unreadable", data)
            self._last = data  # copied aside: ours to replace
            return start, f"{err}; kept it as {kept.name} and started from {start.preset!r}"
        policy, dropped = restrict(graph, saved)
        self._last = data
        if not dropped:
            return policy, f"restored the autosaved policy from {self.path.name}"
        kept = _claim(self.path, ".stale", data)
        return policy, (
            f"restored {self.path.name}; {len(dropped)} entries no longer match this graph "
            f"and were left out (the full file is kept as {kept.name}): " + " | ".join(dropped)
        )

    def _migrate(self, graph: JointGraph, start: Policy) -> tuple[Policy, str]:
        """An earlier version's autosave (`legacy`, named for the model alone): taken over
        when all of it applies to `graph`, moved to this graph's file so that no other graph
        takes it too; else left as it is, for the graph it was made for."""
        legacy = self.legacy
        if legacy is None or not legacy.is_file():  # a FIFO or device is no earlier autosave
            return start, ""
        data = _read_bytes(legacy, MAX_POLICY_FILE_BYTES + 1)
        if data is None:
            return start, ""
        older = f"{legacy.name} (autosaved by an earlier version, named for the model alone)"
        try:
            saved = Policy.from_bytes(data, f"autosave {str(legacy)!r}")
        except WorkbenchError as err:
            return start, f"{older} is left as it is: {err}"
        policy, dropped = restrict(graph, saved)
        if dropped:
            return start, (
                f"{older} is left as it is: {len(dropped)} of its entries do not match this "
                f"graph; started from {start.preset!r}, autosaving to {self.path.name}"
            )
        try:
            write_file(self.path, data, only_new=True)
        except WorkbenchError:
            return start, ""  # this graph's file appeared meanwhile: `save` moves aside
        self._last = self._read()  # as written: with the workbench's mark
        if _read_bytes(legacy) == data:
            legacy.unlink(missing_ok=True)
        return policy, f"restored {older}; it is now this graph's autosave, {self.path.name}"

    def save(self, policy: Policy) -> str:
        """Write `policy`; "" when saved where it was, else the line to show the user."""
        note = ""
        try:
            for _ in range(100):
                current = self._read()
                if current is not None and current != self._last:
                    old, self.path, self._last = self.path, _relocated(self.path), None
                    note = (
                        f"{old.name} was changed outside this explorer (another explorer or an "
                        f"editor) and is left as it is; this explorer now autosaves to "
                        f"{self.path.name}"
                    )
                    continue
                self.path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    policy.save(self.path, overwrite=current is not None)
                except WorkbenchError:
                    if current is None and os.path.lexists(self.path):
                        continue  # appeared meanwhile: someone else's, look again
                    raise
                self._last = self._read()
                return note
            raise WorkbenchError(f"{str(self.path)!r} keeps changing under this explorer")
        except (WorkbenchError, OSError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            return f"NOT autosaved to {self.path}: {reason}. Your edits live only in this explorer"


def graph_key(graph: JointGraph) -> str:
    """What names a graph's autosave: the model, its configuration (layers, sequence, batch,
    dtype, sharding, a fake graph's kernels), the trace mode, and a short hash of those, of
    the graph's inputs and of
    its size, which tells apart graphs the words do not (two user models of one name).
    Explorers on different graphs never share a file; explorers on one graph do."""
    # a real graph runs its device's own kernels, so they name nothing more (and keys written
    # before graphs recorded their kernels stay those of the same graphs)
    config = {
        k: v for k, v in graph.config.items() if not (k == "kernels" and graph.mode == "real")
    }
    words = [graph.model_name]
    for key, value in config.items():
        if key == "world_size" or isinstance(value, bool) or not isinstance(value, int | str):
            continue
        if isinstance(value, int):
            words.append(f"{key}{value}")
        else:
            words.append(value if key == "dtype" else f"{key.removesuffix('_dtype')}-{value}")
    words.append(graph.mode)
    inputs = [
        (spec.kind, spec.fqn, graph.nodes[spec.placeholder].shapes)
        for spec in graph.inputs
        if spec.placeholder in graph.nodes
    ]
    facts = [graph.model_name, graph.mode, config, inputs, len(graph.nodes)]
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join(words)).strip(".-")[:120]
    return f"{text}-{digest[:8]}"


def _autosave_folder() -> Path:
    """`$SAC_WORKBENCH_AUTOSAVE_DIR` (tests point it at a temporary folder, so a test run
    leaves nothing for the next session), else the working folder."""
    return Path(os.environ.get("SAC_WORKBENCH_AUTOSAVE_DIR") or ".")


def default_autosave(graph: JointGraph) -> Path:
    """`GRAPH_KEY.policy.json` (`graph_key`) in the autosave folder."""
    return _autosave_folder() / f"{graph_key(graph)}.policy.json"


def legacy_autosave(model_name: str) -> Path:
    """Where earlier versions autosaved every graph of a model: `MODEL.policy.json`."""
    return _autosave_folder() / f"{file_stem(model_name)}.policy.json"


# File name endings of each export format: code is `.py`, torchtitan's options are command
# line flags for its run script, the policy itself is JSON.
EXPORT_NAMES = {
    "policy_fn": "_sac_policy_fn.py",
    "graph_pass": "_sac_graph_pass.py",
    "torchtitan": "_sac_torchtitan.sh",
    "json": "_sac_policy.json",
}


def _read_bytes(path: Path, limit: int = -1) -> bytes | None:
    """The file's bytes (at most `limit`), or None when it cannot be read."""
    try:
        return read_file(path, repr(str(path)), MAX_MARKED_BYTES if limit < 0 else limit)
    except WorkbenchError:
        return None


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
        if os.path.lexists(target) and (ours is None or _read_bytes(target) != ours):
            raise WorkbenchError(
                f"{str(target)!r} exists and was not written by this explorer (or was edited "
                "since): choose another export path"
            )
        write_file(target, self.code, overwrite=os.path.lexists(target))
        self._written[target] = _read_bytes(target)  # as written: with the workbench's mark
        count, before, _ = self._saves.get(target, (0, "", ""))
        self._saves[target] = (count + 1, time.strftime("%H:%M:%S"), before)
        self.path = target
        return target


def _checked_format(fmt: str) -> str:
    if fmt not in EXPORT_NAMES:
        raise WorkbenchError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def load_source(
    source: JointGraph | Workload | str, kernels: str | None = None
) -> tuple[JointGraph, Workload | None]:
    """The graph to explore, and the workload when known (Run compares against eager). A
    workload built on the meta device is traced on fake tensors, for `kernels` (a GPU's
    name, by default an H100's: `workbench.capture.kernels`); another one for real."""
    if isinstance(source, JointGraph):
        return source, None
    if isinstance(source, str):
        source = load_workload(source)
    if isinstance(source, Workload):
        if any(p.is_meta for p in source.model.parameters()):
            return trace(source, mode="fake", kernels=kernels), source
        return trace(source, mode="real"), source
    raise WorkbenchError(
        f"PolicyExplorer takes a JointGraph, a Workload or a model name, "
        f"not {type(source).__name__}"
    )


def start_policy(policy: Policy | str) -> Policy:
    """The policy an explorer opens with, from a preset name or a Policy.

    >>> start_policy("eager").preset
    'eager'
    """
    if not isinstance(policy, Policy | str):
        raise TypeError(
            f"policy must be a preset name ({', '.join(PRESETS)}) or a Policy, got {policy!r}"
        )
    return Policy(policy) if isinstance(policy, str) else policy
