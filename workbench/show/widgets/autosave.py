"""The explorer's autosave in plain Python: the policy file one explorer keeps up to date,
named for the graph, which never loses a user's policy nor replaces anyone else's file.

Entry points: `Autosave` (`of(graph, path)`, `recover(graph, start)`, `save(policy)`),
`default_autosave(graph)` (a file named for the graph, `graph_key`), `legacy_autosave` and
`read_bytes` (a file's bytes, or None).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from workbench.capture.graph import JointGraph
from workbench.decide.decider import restrict
from workbench.decide.policy import MAX_POLICY_FILE_BYTES, Policy
from workbench.errors import WorkbenchError
from workbench.files import MAX_MARKED_BYTES, file_stem, read_file, write_file

__all__ = ["Autosave", "default_autosave", "graph_key", "legacy_autosave", "read_bytes"]


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
        data = read_bytes(legacy, MAX_POLICY_FILE_BYTES + 1)
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
        if read_bytes(legacy) == data:
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


def read_bytes(path: Path, limit: int = -1) -> bytes | None:
    """The file's bytes (at most `limit`), or None when it cannot be read."""
    try:
        return read_file(path, repr(str(path)), MAX_MARKED_BYTES if limit < 0 else limit)
    except WorkbenchError:
        return None
