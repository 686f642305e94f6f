"""A measured memory snapshot against the estimate, op by op: each allocation of the snapshot
attributed to a node of the rematerialized graph, the measured and estimated peaks, what is
live at the measured peak by kind, and the nodes whose bytes differ most.

Entry points: `attribute(snapshot, estimator, est, gm)` (each allocation with its node, kind
and how it was found) and `compare_snapshot(...)` (a `SnapshotComparison`, whose `to_json`
the `compare-snapshot` command prints). `est` is the estimate of the graph that ran, at
torch's 512-byte rounding (`Estimator.simulate(order, CUDA_ALLOC_GRANULARITY)`); `gm` is
that graph, whose generated code the snapshot's frames point into.

An allocation is attributed by, in order: the node its frames name (`fx_node_name`, which
`_snapshot(augment_with_fx_traces=True)` and the workbench's own snapshots carry:
`node_metadata`); the line of `gm`'s generated code its frames run (`<eval_with_key>.N`:
`generated_code`); else, for one made during the trace, the next unclaimed storage of the
estimate with its rounded size in allocation order (`size_and_order`), and for one made
before the trace began (parameters, inputs, optimizer state), an unclaimed storage held from
the first step with its size (`size`). An allocation whose event says it is optimizer state
(`category`) belongs to no node.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.fx as fx

from workbench.cost.allocator import allocation_steps, round_size
from workbench.cost.estimate import Estimate, Estimator
from workbench.cost.estimated_snapshot import CATEGORY_KIND, KINDS, StorageTable, storage_table
from workbench.cost.profiles import CUDA_ALLOC_GRANULARITY
from workbench.cost.snapshot import Frame, Snapshot, generated_code_line
from workbench.errors import WorkbenchError

__all__ = [
    "METHODS",
    "Allocation",
    "SnapshotComparison",
    "attribute",
    "compare_snapshot",
    "generated_lines",
]

METHODS: tuple[str, ...] = ("node_metadata", "generated_code", "size_and_order", "size", "category")
# how far ahead in the estimate's allocation order an allocation without frames is matched
ORDER_WINDOW = 64
# allocations found by generated-code lines before their fit with the graph is judged
MISFIT_LEAST = 10
# torch's memory profiler categories (`_profile_to_snapshot` writes them) and the workbench's
_EVENT_KINDS: dict[str, str] = {
    **{kind: kind for kind in KINDS if kind != "unattributed"},
    "input": "inputs",
    "temporary": "temporaries",
    "activation": "saved activations",
    "gradient": "gradients",
    "autograd_detail": "temporaries",
    "parameter": "parameters",
    "optimizer_state": "optimizer",
}


@dataclass
class Allocation:
    """One block a snapshot shows allocated: bytes requested and as torch rounds them, the
    trace events of its allocation and free (-1: before the trace; the trace's length:
    never freed), and what it was attributed to (`entry` of the estimate's node order,
    `storage` its index in the `StorageTable`, -1 for none)."""

    addr: int
    requested: int
    frames: tuple[Frame, ...]
    category: str | None
    born: int
    freed: int
    entry: str | None = None
    method: str | None = None
    kind: str = "unattributed"
    storage: int = -1

    @property
    def rounded(self) -> int:
        return round_size(self.requested) if self.requested else 0


@dataclass
class _Series:
    """Live bytes after each event of a trace (and before the first) and their peak."""

    before: int
    after: np.ndarray

    @property
    def peak(self) -> int:
        return int(max(self.before, self.after.max(initial=self.before)))

    @property
    def peak_event(self) -> int:
        """The first event reaching the peak (-1: the state before the trace)."""
        if not len(self.after) or self.before >= self.after.max():
            return -1
        return int(np.argmax(self.after))


def generated_lines(gm: fx.GraphModule) -> dict[int, int]:
    """Line of `gm`'s generated code (`gm.code`, as frames number it) -> index of the node
    whose statement it is, from FX's own map (`_lineno_map`, which torch's
    `_augment_frames` reads too), else from the statements' assigned names."""
    lineno_map = getattr(gm, "_lineno_map", None)
    start = getattr(gm, "_prologue_start", None)
    if isinstance(lineno_map, dict) and isinstance(start, int):
        return {line + start: k for line, k in lineno_map.items() if k is not None}
    index = {node.name: k for k, node in enumerate(gm.graph.nodes)}
    found = {}
    for line, text in enumerate(gm.code.splitlines(), 1):
        name = text.strip().split(" = ", 1)[0]
        if " = " in text and name in index:
            found[line] = index[name]
    return found


def _allocations(snapshot: Snapshot, device: int) -> tuple[list[Allocation], list[Any]]:
    """Every block the trace allocates or frees, and those the segments hold at the end
    that the trace never allocated (made before it began)."""
    events = snapshot.trace(device)
    end = len(events)
    live: dict[int, Allocation] = {}
    found: list[Allocation] = []
    for i, e in enumerate(events):
        if e.action == "alloc":
            live[e.addr] = Allocation(e.addr, e.size, e.frames, e.category, i, end)
            found.append(live[e.addr])
        elif e.action == "free_completed":
            allocation = live.pop(e.addr, None)
            if allocation is None:  # allocated before the trace began
                found.append(Allocation(e.addr, e.size, e.frames, e.category, -1, i))
            else:
                allocation.freed = i
    for segment in snapshot.segments:
        if segment.device != device:
            continue
        for block in segment.blocks:
            if block.state != "inactive" and block.address not in live:
                held = Allocation(block.address, block.requested_size, block.frames, None, -1, end)
                found.append(held)
    return found, events


def _allocated(allocations: list[Allocation], events: int) -> _Series:
    deltas = np.zeros(events + 1, dtype=np.int64)
    before = 0
    for a in allocations:
        if a.born < 0:
            before += a.rounded
        else:
            deltas[a.born] += a.rounded
        deltas[a.freed] -= a.rounded
    return _Series(before, before + np.cumsum(deltas[:events]))


def _reserved(snapshot: Snapshot, device: int) -> _Series:
    events = snapshot.trace(device)
    grow = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    deltas = np.array([grow.get(e.action, 0) * e.size for e in events], dtype=np.int64)
    final = sum(s.total_size for s in snapshot.segments if s.device == device)
    return _Series(final - int(deltas.sum()), final - int(deltas.sum()) + np.cumsum(deltas))


class _Attributor:
    """Matches allocations to the estimate's storages (`StorageTable`)."""

    def __init__(self, table: StorageTable, est: Estimate, gm: fx.GraphModule | None) -> None:
        self.table = table
        self.claimed = [False] * len(table.entries)
        self.of_entry = table.by_entry()
        self.order = est.order
        self.gm_names: dict[str, str] = {}
        self.lines: dict[int, int] = {}
        self.filename: str | None = None
        if gm is not None:
            nodes = list(gm.graph.nodes)
            if len(nodes) != len(est.order):
                raise WorkbenchError(
                    f"the graph module has {len(nodes)} nodes and the estimate's node order "
                    f"{len(est.order)}: give the estimate of the graph that ran "
                    "(estimate_remat(graph, gm, ...))"
                )
            self.gm_names = {node.name: est.order[k] for k, node in enumerate(nodes)}
            self.lines = generated_lines(gm)
            self.filename = getattr(getattr(gm.forward, "__code__", None), "co_filename", None)

    def by_frames(self, a: Allocation, filename: str | None) -> None:
        named = next((f.node for f in a.frames if f.node), None)
        if named is not None and named not in self.of_entry:
            named = self.gm_names.get(named)  # a name of the graph module that ran
        if named is not None:
            self._claim(a, named, "node_metadata")
            return
        frame = generated_code_line(a.frames, filename) if self.lines else None
        if frame is not None and frame.line in self.lines:
            self._claim(a, self.order[self.lines[frame.line]], "generated_code")

    def _claim(self, a: Allocation, entry: str, method: str) -> None:
        a.entry, a.method = entry, method
        for s in self.of_entry.get(entry, []):
            if not self.claimed[s] and self.table.rounded[s] == a.rounded:
                self.claimed[s], a.storage = True, s
                return

    def drop_misfit_lines(self, allocations: list[Allocation]) -> int:
        """When most allocations found by a generated-code line match no output of that
        line's node, the lines are those of another graph (model, shape, policy, kernels):
        forget them, for size and order to match instead. How many were forgotten."""
        by_line = [a for a in allocations if a.method == "generated_code"]
        off = sum(1 for a in by_line if a.storage < 0)
        if len(by_line) < MISFIT_LEAST or off <= len(by_line) / 2:
            return 0
        for a in by_line:
            if a.storage >= 0:
                self.claimed[a.storage] = False
            a.entry, a.method, a.storage = None, None, -1
        return len(by_line)

    def _take(self, a: Allocation, s: int, method: str) -> None:
        self.claimed[s], a.storage, a.entry, a.method = True, s, self.table.entries[s], method

    def by_order(self, made: list[Allocation]) -> None:
        """Allocations of the trace without a node, in trace order: the first unclaimed
        storage of their rounded size in the estimate's malloc order, from `ORDER_WINDOW`
        before the last one matched (by any method; ops may allocate their outputs in
        another order) to as far after it, never before the first unclaimed one."""
        t = self.table
        sizes, born, freed = (np.array(v, dtype=np.int64) for v in (t.requested, t.born, t.freed))
        steps = allocation_steps(sizes, born, freed, t.steps)
        sequence = [i for _, allocated, _ in steps for i in allocated]
        place = {s: k for k, s in enumerate(sequence)}
        first = last = 0  # the first unclaimed place; the last place matched
        for a in made:
            while first < len(sequence) and self.claimed[sequence[first]]:
                first += 1
            if a.storage >= 0:
                last = place.get(a.storage, last)
            if a.entry is not None or a.method is not None:
                continue
            start = max(first, last - ORDER_WINDOW)
            for k in range(start, min(last + ORDER_WINDOW, len(sequence))):
                s = sequence[k]
                if not self.claimed[s] and t.rounded[s] == a.rounded:
                    self._take(a, s, "size_and_order")
                    last = k
                    break

    def by_size(self, before: list[Allocation]) -> None:
        """Blocks made before the trace: storages held from the first step (graph inputs),
        the optimizer's state and cuBLAS's workspaces, matched by rounded size."""
        t = self.table
        free: dict[int, list[int]] = defaultdict(list)
        for s in range(len(t.entries)):
            if t.born[s] == 0 and t.kinds[s] in ("parameters", "inputs") and not self.claimed[s]:
                free[t.rounded[s]].append(s)
        state = Counter(round_size(b) for b in t.optimizer)
        workspaces = Counter(round_size(b) for b in t.workspaces)
        for a in before:
            if a.entry is not None or a.method is not None:
                continue
            if free[a.rounded]:
                self._take(a, free[a.rounded].pop(0), "size")
            elif state[a.rounded] > 0:
                state[a.rounded] -= 1
                a.kind, a.method = "optimizer", "size"
            elif workspaces[a.rounded] > 0:
                workspaces[a.rounded] -= 1
                a.kind, a.method = "workspaces", "size"


def attribute(
    snapshot: Snapshot,
    estimator: Estimator,
    est: Estimate,
    gm: fx.GraphModule | None = None,
    device: int | None = None,
) -> list[Allocation]:
    """Every allocation of `snapshot` on `device`, attributed (see the module's docstring)
    and given a kind: the one its event's `category` names, else that of the estimate's
    storage it stands for, `temporaries` for one a node made beyond the estimate's storages
    (a workspace), `unattributed` for the rest."""
    device = snapshot.device(device)
    return _attribute(snapshot, device, storage_table(estimator, est), est, gm)[0]


def _attribute(
    snapshot: Snapshot, device: int, table: StorageTable, est: Estimate, gm: fx.GraphModule | None
) -> tuple[list[Allocation], int]:
    """The allocations, attributed, and how many generated-code lines were forgotten for
    not fitting the graph."""
    allocations, _ = _allocations(snapshot, device)
    attributor = _Attributor(table, est, gm)
    files = Counter(f.filename for a in allocations if (f := generated_code_line(a.frames)))
    filename = attributor.filename if attributor.filename in files else None
    if filename is None and files:
        filename = files.most_common(1)[0][0]
    for a in allocations:
        if _EVENT_KINDS.get(a.category or "") in ("optimizer", "workspaces"):
            a.kind, a.method = _EVENT_KINDS[a.category or ""], "category"
        else:
            attributor.by_frames(a, filename)
    misfit = attributor.drop_misfit_lines(allocations)
    attributor.by_size([a for a in allocations if a.born < 0])  # before: only inputs and state
    attributor.by_order([a for a in allocations if a.born >= 0])
    for a in allocations:
        named = _EVENT_KINDS.get(a.category or "")
        if named is not None:
            a.kind = named
        elif a.storage >= 0:
            a.kind = table.kinds[a.storage]
        elif a.entry is not None:
            a.kind = "temporaries"
    return allocations, misfit


@dataclass
class SnapshotComparison:
    """Measured (the snapshot) beside estimated, in bytes as torch's allocator rounds them;
    `measured_timeline` is the measured live bytes per step of the estimate's node order (each
    event placed at the step of the storage it stands for)."""

    source: str
    device: int
    measured: dict[str, Any]
    estimated: dict[str, Any]
    attribution: dict[str, Any]
    node_differences: list[dict[str, Any]]
    nodes_differing: int
    measured_timeline: list[int] = field(repr=False)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "snapshot": self.source,
            "device": self.device,
            "measured": self.measured,
            "estimated": self.estimated,
            "difference": {
                key: self.measured[key] - self.estimated[key]
                for key in ("allocated_peak_bytes", "reserved_peak_bytes")
            },
            "attribution": self.attribution,
            "nodes_differing": self.nodes_differing,
            "node_differences": self.node_differences,
            "counts": "bytes requested, rounded to 512 as torch's caching allocator rounds them",
            **({"notes": self.notes} if self.notes else {}),
        }


def compare_snapshot(
    snapshot: Snapshot,
    estimator: Estimator,
    est: Estimate,
    gm: fx.GraphModule | None = None,
    device: int | None = None,
    top: int = 20,
) -> SnapshotComparison:
    """`snapshot` (of a run of `gm`, the graph `est` estimates) against `est`: measured and
    estimated allocated and reserved peaks and the op at each, the live set at each peak by
    kind (`KINDS`), how each allocation was attributed and the share of the measured peak's
    bytes attributed to nodes, and the `top` nodes whose bytes differ most."""
    storages = est.device_storages
    if storages is None or any(int(s) % CUDA_ALLOC_GRANULARITY for s in storages.sizes.tolist()):
        raise WorkbenchError(
            "compare a snapshot with an estimate at torch's 512-byte rounding: "
            "Estimator.simulate(order, CUDA_ALLOC_GRANULARITY) or estimate_remat(..., 512)"
        )
    device = snapshot.device(device)
    table = storage_table(estimator, est)
    allocations, misfit = _attribute(snapshot, device, table, est, gm)
    events = snapshot.trace(device)
    allocated, reserved = _allocated(allocations, len(events)), _reserved(snapshot, device)
    at_alloc = {a.born: a for a in allocations if a.born >= 0}
    peak_event = allocated.peak_event
    live_at_peak = [a for a in allocations if a.born <= peak_event < a.freed]
    measured = {
        "allocated_peak_bytes": allocated.peak,
        "reserved_peak_bytes": reserved.peak,
        "allocated_peak_node": _node_at(at_alloc, peak_event, events),
        "reserved_peak_node": _node_at(at_alloc, reserved.peak_event, events),
        "at_peak_bytes": _by_kind((a.kind, a.rounded) for a in live_at_peak),
    }
    replay = est.allocator()
    reserved_at = int(np.argmax(replay.reserved_timeline)) if replay.reserved_timeline else 0
    # torch rounds each optimizer state tensor as it rounds the step's
    rounding = sum(round_size(b) - b for b in table.optimizer)
    estimated = {
        "allocated_peak_bytes": est.peak_bytes + rounding,
        "reserved_peak_bytes": replay.reserved_peak_bytes,
        "allocated_peak_node": est.peak_node,
        "reserved_peak_node": est.order[reserved_at] if est.order else None,
        "at_peak_bytes": _by_kind(
            (CATEGORY_KIND[c], b + (rounding if c == "optimizer" else 0))
            for c, b in est.peak_breakdown.items()
        ),
    }
    to_nodes = sum(a.rounded for a in live_at_peak if a.entry is not None)
    methods = {m: {"allocations": 0, "bytes": 0} for m in (*METHODS, "unattributed")}
    for a in allocations:
        row = methods[a.method or "unattributed"]
        row["allocations"] += 1
        row["bytes"] += a.rounded
    differences = _node_differences(allocations, table)
    return SnapshotComparison(
        source=snapshot.path or snapshot.source,
        device=device,
        measured=measured,
        estimated=estimated,
        attribution={
            "allocations": len(allocations),
            "methods": methods,
            "peak_bytes_attributed_to_nodes": to_nodes,
            "peak_fraction_attributed_to_nodes": to_nodes / max(allocated.peak, 1),
        },
        node_differences=differences[:top],
        nodes_differing=len(differences),
        measured_timeline=_timeline(allocations, events, table, allocated.before),
        notes=_notes(allocations, gm, events, misfit),
    )


def _node_at(at_alloc: dict[int, Allocation], event: int, events: list[Any]) -> str | None:
    """The node of the allocation at `event`, or of the first one after it (a segment is
    made for the allocation that follows it); None for the state before the trace."""
    if event < 0:
        return None
    for i in range(event, len(events)):
        if i in at_alloc:
            return at_alloc[i].entry
    return None


def _by_kind(rows: Any) -> dict[str, int]:
    totals = dict.fromkeys(KINDS, 0)
    for kind, nbytes in rows:
        totals[kind] += nbytes
    return totals


def _node_differences(allocations: list[Allocation], table: StorageTable) -> list[dict[str, Any]]:
    """Per node (node-order entry) of either side: measured bytes allocated (rounded) against
    the estimate's storages, largest difference first; nodes that agree are left out."""
    measured: dict[str, int] = defaultdict(int)
    for a in allocations:
        if a.entry is not None:
            measured[a.entry] += a.rounded
    estimated: dict[str, int] = defaultdict(int)
    for entry, nbytes in zip(table.entries, table.rounded, strict=True):
        estimated[entry] += nbytes
    differing = [n for n in set(measured) | set(estimated) if measured[n] != estimated[n]]
    differing.sort(key=lambda n: (-abs(measured[n] - estimated[n]), n))
    return [
        {
            "node": n,
            "measured_bytes": measured[n],
            "estimated_bytes": estimated[n],
            "difference_bytes": measured[n] - estimated[n],
        }
        for n in differing
    ]


def _timeline(
    allocations: list[Allocation], events: list[Any], table: StorageTable, before: int
) -> list[int]:
    """Measured live bytes at each step of the node order: an allocation's event is placed at
    its storage's birth step and its free at the storage's free step; a step reads the most
    live while it is the latest placed (a step without events carries the last value)."""
    steps = table.steps
    place: dict[int, int] = {}
    for a in allocations:
        if a.storage >= 0 and a.born >= 0:
            place[a.born] = table.born[a.storage]
        if a.storage >= 0 and a.freed < len(events):
            place[a.freed] = min(table.freed[a.storage], steps - 1)
    delta: dict[int, int] = defaultdict(int)
    for a in allocations:
        if a.born >= 0:
            delta[a.born] += a.rounded
        if a.freed < len(events):
            delta[a.freed] -= a.rounded
    values = [0] * steps
    live, cur = before, 0
    if steps:
        values[0] = live
    for i in range(len(events)):
        at = place.get(i)
        if at is not None and at > cur:
            for s in range(cur + 1, at + 1):
                values[s] = live
            cur = at
        live += delta.get(i, 0)
        if steps:
            values[cur] = max(values[cur], live)
    for s in range(cur + 1, steps):
        values[s] = live
    return values


def _notes(
    allocations: list[Allocation], gm: fx.GraphModule | None, events: list[Any], misfit: int
) -> list[str]:
    notes = []
    framed = sum(1 for a in allocations if generated_code_line(a.frames) is not None)
    if framed and gm is None:
        notes.append(
            f"{framed} allocations run generated FX code, but no graph module was given to "
            "read its lines: they were matched by size and order"
        )
    if misfit:
        notes.append(
            f"the generated-code lines of {misfit} allocations mostly name nodes with no "
            "output of their size: the graph that ran differs from this one (model, shape, "
            "policy or --kernels); they were matched by size and order instead"
        )
    missed = [a for a in allocations if a.method is None]
    if missed:
        notes.append(
            f"{len(missed)} allocations ({sum(a.rounded for a in missed):,} bytes) matched no "
            "node of the estimate"
        )
    if not any(e.action.startswith("segment_") for e in events):
        notes.append("the trace made no segments: reserved bytes are its final segments'")
    return notes
