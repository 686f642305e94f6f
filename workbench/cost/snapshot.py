"""Memory snapshots, the format `torch.cuda.memory._snapshot()` returns and
pytorch.org/memory_viz draws: read one safely, write one that the viewer opens.

Entry points: `load_snapshot(path)` and `parse_snapshot(data)` (a `Snapshot` of typed
segments, blocks, trace events and frames; any problem is one `WorkbenchError` line, and no
object but dicts, lists, tuples, strings and numbers is ever built from the file),
`snapshot_bytes(data)` and `write_snapshot(path, data)` (pickle protocol 4, which memory_viz's
own unpickler reads, carrying the workbench's mark so that a rerun replaces it), and
`generated_code_line(frames)` (the line of FX-generated code an allocation ran).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from workbench.errors import WorkbenchError, describe
from workbench.files import MARK_KEY, mark_text, read_file, write_file

__all__ = [
    "ACTIONS",
    "MAX_SNAPSHOT_BYTES",
    "META_KEY",
    "PICKLE_PROTOCOL",
    "SNAPSHOT_FORMAT",
    "Frame",
    "Snapshot",
    "SnapshotBlock",
    "SnapshotSegment",
    "TraceEvent",
    "generated_code_line",
    "load_snapshot",
    "parse_snapshot",
    "snapshot_bytes",
    "write_snapshot",
]

# A snapshot holds several KB per recorded event (torch's `_record_memory_history` docs); the
# cap keeps a wrong file (or /dev/zero) from filling memory: record fewer entries
# (`max_entries`) for a larger run.
MAX_SNAPSHOT_BYTES = 2**30
# memory_viz's JavaScript unpickler reads protocols 2 to 4 (torch/utils/viz/MemoryViz.js)
PICKLE_PROTOCOL = 4
# the workbench's own key in a snapshot it writes: what the estimate was, and this format
META_KEY = "sac_workbench"
SNAPSHOT_FORMAT = 1
# `TraceEntry` actions of c10/cuda/CUDACachingAllocator (torch/csrc/cuda/Module.cpp's names)
ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
)
# code FX generates for a GraphModule: `<eval_with_key>.N` (with ` from FILE:LINE in NAME`
# when the graph carries co_fields), or `fx_generated_<hash>.py` under
# `torch.fx.experimental._config.enrich_profiler_metadata`
_GENERATED = re.compile(r"^<eval_with_key>\.\d+|(^|/)fx_generated_\w*\.py$")


class Frame(NamedTuple):
    """One stack frame as torch records it (innermost first in a list); `node` is the
    `fx_node_name` that `_snapshot(augment_with_fx_traces=True)`, or the workbench, adds."""

    filename: str
    line: int
    name: str
    node: str | None = None


class TraceEvent(NamedTuple):
    """One allocator action of a device's trace; `size` is the bytes requested (torch records
    `orig_size`, not the rounded block), `addr` the block's (0 for an `oom`)."""

    action: str
    addr: int
    size: int
    stream: int
    frames: tuple[Frame, ...]
    category: str | None = None
    time_us: int | None = None


class SnapshotBlock(NamedTuple):
    """A block of a segment when the snapshot was taken: `state` is `active_allocated`,
    `active_pending_free` or `inactive`."""

    address: int
    size: int
    requested_size: int
    state: str
    frames: tuple[Frame, ...]


class SnapshotSegment(NamedTuple):
    """A cudaMalloc'd segment (or an expandable segment's mapped range) and its blocks."""

    device: int
    address: int
    total_size: int
    stream: int
    segment_type: str
    blocks: tuple[SnapshotBlock, ...]


@dataclass
class Snapshot:
    """A snapshot's segments when taken and each device's trace (oldest event first);
    `source` names it in messages, `path` is its file (if read from one); `meta` is what the
    workbench wrote under `META_KEY` (empty for torch's own)."""

    segments: list[SnapshotSegment]
    traces: list[list[TraceEvent]]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    def devices(self) -> list[int]:
        """Devices with a segment or a trace event."""
        used = {s.device for s in self.segments}
        return sorted(used | {i for i, trace in enumerate(self.traces) if trace})

    def device(self, index: int | None = None) -> int:
        """`index` if the snapshot holds it, else the one device it holds; an error names the
        devices when it holds several or none."""
        devices = self.devices()
        if index is None and len(devices) == 1:
            return devices[0]
        if index is not None and index in devices:
            return index
        held = ", ".join(map(str, devices)) or "none"
        if index is None and devices:
            raise WorkbenchError(f"{self.source} holds devices {held}: name one (--device N)")
        raise WorkbenchError(
            f"{self.source} holds no device {'' if index is None else index} (devices: {held})"
        )

    def trace(self, device: int) -> list[TraceEvent]:
        return self.traces[device] if device < len(self.traces) else []


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers only: every class or function a
    pickle names is refused, so a file can run no code and make no object."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}, and a snapshot names none")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, and a snapshot holds none")


def load_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """The snapshot in `path`: a pickle of what `torch.cuda.memory._snapshot()` returns (also
    `_dump_snapshot`'s file, torchtitan's `rank{N}_memory_snapshot.pickle`, a snapshot
    `write_snapshot` wrote), read through a refusing unpickler, at most
    `MAX_SNAPSHOT_BYTES`."""
    where = Path(path)
    what = f"snapshot {where}"
    if not os.path.lexists(where):
        raise WorkbenchError(f"{what}: no such file")
    raw = read_file(where, what, MAX_SNAPSHOT_BYTES)
    if not raw.startswith(b"\x80"):
        raise WorkbenchError(
            f"{what} is not a pickle (a snapshot is the pickle torch.cuda.memory."
            "_dump_snapshot writes)"
        )
    try:
        data = _PlainUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as err:
        raise WorkbenchError(f"{what} is not a snapshot: {' '.join(str(err).split())}") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        reason = "it ends early" if isinstance(err, EOFError) else describe(err)
        raise WorkbenchError(f"{what} is not a readable pickle ({reason})") from None
    except (RecursionError, MemoryError, OverflowError) as err:
        raise WorkbenchError(f"{what} is too deep or too large ({type(err).__name__})") from None
    snapshot = parse_snapshot(data, what)
    snapshot.path = str(where)
    return snapshot


def parse_snapshot(data: object, what: str = "snapshot") -> Snapshot:
    """`data` (what `_snapshot()` returns, or a file's unpickled contents) checked and typed.
    A list is taken as segments alone, as torch's `_memory_viz` takes it."""
    if isinstance(data, list):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        got = type(data).__name__ if not isinstance(data, dict) else f"keys {_keys(data)}"
        raise WorkbenchError(
            f"{what} is not a memory snapshot (got {got}); a snapshot is what "
            "torch.cuda.memory._snapshot() returns: a dict with segments and device_traces"
        )
    meta = data.get(META_KEY, {})
    if not isinstance(meta, dict) or meta.get("format", SNAPSHOT_FORMAT) != SNAPSHOT_FORMAT:
        version = meta.get("format") if isinstance(meta, dict) else meta
        raise WorkbenchError(
            f"{what} has {META_KEY} format {version!r}; this workbench reads format "
            f"{SNAPSHOT_FORMAT} (write it again with this version)"
        )
    raw_segments = _list(data, "segments", what)
    segments = [_segment(s, f"{what}: segments[{i}]") for i, s in enumerate(raw_segments)]
    traces_raw = data.get("device_traces", [])
    if not isinstance(traces_raw, list):
        raise WorkbenchError(f"{what}: device_traces must be a list of per-device lists")
    traces = []
    for d, trace in enumerate(traces_raw):
        where = f"{what}: device_traces[{d}]"
        if not isinstance(trace, list):
            raise WorkbenchError(f"{where} must be a list of trace entries")
        traces.append([_event(e, f"{where}[{i}]") for i, e in enumerate(trace)])
    return Snapshot(segments, traces, what, dict(meta))


def _keys(data: dict[Any, Any]) -> str:
    shown = ", ".join(sorted(map(str, data))[:6])
    return f"{shown}{', ...' if len(data) > 6 else ''}" if data else "none"


def _list(data: dict[str, Any], key: str, where: str) -> list[Any]:
    value = data.get(key)
    if not isinstance(value, list):
        raise WorkbenchError(f"{where}: {key} must be a list, got {type(value).__name__}")
    return value


def _int(data: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkbenchError(f"{where}: {key} must be an int, got {value!r}")
    return value


def _str(data: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise WorkbenchError(f"{where}: {key} must be a string, got {value!r}")
    return value


def _dict(value: object, where: str, keys: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WorkbenchError(f"{where} must be a dict with {keys}, got {type(value).__name__}")
    return value


def _frames(data: dict[str, Any], where: str) -> tuple[Frame, ...]:
    raw = data.get("frames", [])
    if not isinstance(raw, list):
        raise WorkbenchError(f"{where}: frames must be a list of {{filename, line, name}}")
    frames = []
    for i, item in enumerate(raw):
        at = f"{where}: frames[{i}]"
        f = _dict(item, at, "filename, line and name")
        node = f.get("fx_node_name")
        frames.append(
            Frame(
                _str(f, "filename", at),
                _int(f, "line", at),
                _str(f, "name", at),
                node if isinstance(node, str) else None,
            )
        )
    return tuple(frames)


def _segment(raw: object, where: str) -> SnapshotSegment:
    data = _dict(raw, where, "address, total_size and blocks")
    start = _int(data, "address", where)
    blocks = []
    at = start
    for i, b in enumerate(_list(data, "blocks", where)):
        here = f"{where}.blocks[{i}]"
        block = _dict(b, here, "size and state")
        size = _int(block, "size", here)
        state = _str(block, "state", here)
        requested = block.get("requested_size")
        if requested is None and isinstance(block.get("history"), list) and block["history"]:
            requested = block["history"][0].get("real_size")  # the format before torch 2.1
        requested = size if requested is None else requested
        frames = _frames(block, here)
        if isinstance(requested, bool) or not isinstance(requested, int):
            raise WorkbenchError(f"{here}: requested_size must be an int, got {requested!r}")
        address = _int(block, "address", here, at)
        blocks.append(SnapshotBlock(address, size, requested, state, frames))
        at += size
    return SnapshotSegment(
        _int(data, "device", where, 0),
        start,
        _int(data, "total_size", where),
        _int(data, "stream", where, 0),
        _str(data, "segment_type", where, "large"),
        tuple(blocks),
    )


def _event(raw: object, where: str) -> TraceEvent:
    data = _dict(raw, where, "action, addr and size")
    action = _str(data, "action", where)
    if action not in ACTIONS:
        known = ", ".join(ACTIONS)
        raise WorkbenchError(f"{where}: unknown action {action!r}; torch's are {known}")
    category = data.get("category")
    time_us = data.get("time_us")
    return TraceEvent(
        action,
        0 if action == "oom" else _int(data, "addr", where),
        _int(data, "size", where),
        _int(data, "stream", where, 0),
        _frames(data, where),
        category if isinstance(category, str) else None,
        time_us if isinstance(time_us, int) and not isinstance(time_us, bool) else None,
    )


def generated_code_line(frames: tuple[Frame, ...], filename: str | None = None) -> Frame | None:
    """The innermost frame running code FX generated for a GraphModule (`<eval_with_key>.N`,
    `fx_generated_*.py`), or that of `filename` alone when given: its line names the node.

    >>> outer = Frame("train.py", 3, "main")
    >>> generated_code_line((Frame("torch/_ops.py", 840, "__call__"),
    ...                      Frame("<eval_with_key>.7", 12, "forward"), outer))
    Frame(filename='<eval_with_key>.7', line=12, name='forward', node=None)
    >>> generated_code_line((outer,)) is None
    True
    """
    for frame in frames:
        if frame.filename == filename if filename else _GENERATED.search(frame.filename):
            return frame
    return None


def snapshot_bytes(data: dict[str, Any]) -> bytes:
    """`data` pickled as memory_viz reads it (`PICKLE_PROTOCOL`), with the workbench's mark as
    its first key (`files.mark_text`), which `write_file` fills in."""
    return pickle.dumps({MARK_KEY: mark_text(), **data}, protocol=PICKLE_PROTOCOL)


def write_snapshot(
    path: str | os.PathLike[str], data: dict[str, Any], *, overwrite: bool = False
) -> Path:
    """Write `data` (a snapshot dict) to `path` through `files.write_file`."""
    return write_file(path, snapshot_bytes(data), overwrite=overwrite)
