"""Step time on three streams: compute, communication and the host link.

Entry points: `collective_time(profile, kind, nbytes, group, spans_nodes)` (one collective's
seconds), `Streams(graph, index, options)` built once per estimator, then
`Streams.issue_positions(entries)` (where FSDP prefetch moves each all-gather, which moves its
output's birth in the memory walk) and `Streams.run(...) -> StreamTimes` per profile. Compute
runs its entries in order; a collective queues on the communication stream when issued, a
host copy on the host stream; a wait stalls compute only until its collective or copy ends.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar, cast

import numpy as np
import torch

from workbench.capture.graph import JointGraph
from workbench.cost.profiles import DeviceProfile
from workbench.errors import check_int, check_type
from workbench.rewrite.index import GraphIndex

T = TypeVar("T")

__all__ = [
    "RING_FACTOR",
    "OverlapOptions",
    "StreamTimes",
    "Event",
    "Streams",
    "collective_time",
    "nccl_model_applies",
    "walk_streams",
]

# Ring algorithms: bytes each rank sends, per byte of the whole buffer, in a group of W.
# Far above what a model has (a bucket per parameter of 1,024 layers; a copy per
# activation), low enough that a typo is named rather than simulated.
MAX_PREFETCH = 10_000
MAX_COPIES = 100_000

RING_FACTOR: dict[str, Callable[[int], float]] = {
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
    "broadcast": lambda w: (w - 1) / w,
    "all_reduce": lambda w: 2 * (w - 1) / w,
}
# Ring steps of a collective in a group of W (NCCL's `nsteps`, as torch's
# `torch._inductor.comm_analysis._nccl_algo_time` counts them).
RING_STEPS: dict[str, Callable[[int], int]] = {
    "all_gather": lambda w: w - 1,
    "reduce_scatter": lambda w: w - 1,
    "broadcast": lambda w: w - 1,
    "all_to_all": lambda w: 2 * (w - 1),
    "all_reduce": lambda w: 2 * (w - 1),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlapOptions:
    """How FSDP's collectives are issued (torchtitan's SimpleFSDP leaves both to the
    compiler's bucketing and reordering passes; the traced graph issues each all-gather
    just before its wait)."""

    prefetch: int = 0
    """FSDP all-gather buckets issued ahead of the one compute waits for: bucket b goes out
    when compute reaches the wait of bucket b - prefetch (0: where the graph has it). An
    early all-gather holds its output from its issue on, so prefetch raises the peak. TP's
    all-gathers read activations and stay where they are."""

    bucket_layers: bool = False
    """Send a layer's consecutive FSDP all-gathers (and reduce-scatters) as one collective:
    one latency instead of one per parameter; a reduce-scatter bucket goes out with its
    last gradient."""

    sink_waits: bool = False
    """Move each collective's wait to the first op reading its result (what the compiler's
    reordering does): a reduce-scatter then overlaps the rest of backward."""

    max_copies_in_flight: int | None = None
    """Host copies queued at most at once; issuing one more stalls compute until the oldest
    ends (None: no cap)."""

    def __post_init__(self) -> None:
        check_int("prefetch", self.prefetch, 0, MAX_PREFETCH, "buckets ahead; a layer's is one")
        for name in ("bucket_layers", "sink_waits"):
            check_type(name, getattr(self, name), bool, "True or False")
        cap = self.max_copies_in_flight
        if cap is not None:
            check_int("max_copies_in_flight", cap, 1, MAX_COPIES, "copies queued; None: no cap")


def nccl_model_applies(profile: DeviceProfile) -> bool:
    """torch's NCCL model reads the GPU it runs on (`comm_analysis.get_gpu_type`, NVLink
    detection), so it times a profile's collectives only on that profile's GPU."""
    return (
        profile.gpu_name is not None
        and torch.cuda.is_available()
        and profile.gpu_name in torch.cuda.get_device_name()
    )


def collective_time(
    profile: DeviceProfile, kind: str, nbytes: int, group: int, spans_nodes: bool
) -> float:
    """Seconds of one collective of `nbytes` (the whole buffer) in a group of `group` ranks:
    torch's NCCL model (`estimate_nccl_collective_runtime_impl`) where it applies, else the
    ring model, factor(W) x bytes / link rate, plus NCCL's Ring/Simple latency per step from
    torch's tables (`comm_analysis.baseLat`, `hwLat`) on profiles with `nccl_latency`."""
    if group <= 1 or kind not in RING_FACTOR:
        return 0.0
    from torch._inductor import comm_analysis as ca

    if nccl_model_applies(profile):
        coll = {
            "all_gather": ca.NCCL_COLL.ALL_GATHER,
            "reduce_scatter": ca.NCCL_COLL.REDUCE_SCATTER,
            "all_reduce": ca.NCCL_COLL.ALL_REDUCE,
            "all_to_all": ca.NCCL_COLL.ALL_TO_ALL,
        }.get(kind)
        if coll is not None:
            return float(ca.estimate_nccl_collective_runtime_impl(nbytes, group, coll)) / 1e3
    seconds = RING_FACTOR[kind](group) * nbytes / profile.link_rate(spans_nodes)
    if profile.nccl_latency:
        ring, simple = ca.NCCL_ALGO.RING, ca.NCCL_PROTO.SIMPLE
        hw = ca.NCCL_HW.NET if spans_nodes else ca.NCCL_HW.NVLINK
        steps = RING_STEPS[kind](group)
        seconds += (ca.baseLat[ring][simple] + steps * ca.hwLat[hw][ring][simple]) * 1e-6
    return seconds


@dataclass
class StreamTimes:
    """One node order on one profile: compute seconds (its entries back to back), the busy
    seconds of the communication and host streams, and what compute waited for each."""

    compute_seconds: float
    comm_seconds: float
    exposed_comm_seconds: float
    transfer_seconds: float
    exposed_transfer_seconds: float
    # per offloaded node: its copies' stalls, (device->host, host->device)
    copy_stalls: dict[int, list[float]] = field(default_factory=dict)

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.exposed_comm_seconds + self.exposed_transfer_seconds


class Streams:
    """The collectives of one graph: which node each wait ends, FSDP's buckets, and the
    group each collective runs in."""

    def __init__(self, graph: JointGraph, index: GraphIndex, options: OverlapOptions) -> None:
        self.index, self.options = index, options
        position = {name: i for i, name in enumerate(index.names)}
        self.degrees = graph.degrees
        sizes = self.degrees.mesh_sizes()
        self.kind: dict[int, str] = {}  # node -> collective kind (waits excluded)
        self.nbytes: dict[int, int] = {}
        self.group: dict[int, tuple[int, str | None]] = {}
        self.waits: dict[int, int] = {}  # wait node -> the collective node it ends
        self.world = graph.world_size
        gm_nodes = {n.name: n for n in graph.gm.graph.nodes}
        for c in graph.collectives():
            i = position[c.node]
            if c.kind == "wait":
                started = next(iter(gm_nodes[c.node].all_input_nodes), None)
                if started is not None and started.name in position:
                    self.waits[i] = position[started.name]
                continue
            self.kind[i] = c.kind
            self.nbytes[i] = c.bytes
            self.group[i] = (sizes.get(c.mesh_dim or "", graph.world_size), c.mesh_dim)
        self._shape = {  # a collective node's (kind, bytes, group size, mesh dimension)
            i: (kind, self.nbytes[i], *self.group[i]) for i, kind in self.kind.items()
        }
        self.fsdp = {
            i
            for i, (_, dim) in self.group.items()
            if dim == "fsdp" and self.kind[i] in ("all_gather", "reduce_scatter")
        }
        space = index.space
        self._alias = np.array(
            [graph.nodes[name].is_view for name in index.names], dtype=bool
        ) | np.asarray(index.is_getitem, dtype=bool)
        self._readers: tuple[np.ndarray, dict[int, list[int]]] | None = None
        # what the last node order gave (its buckets, collectives, moved issues), shared by
        # the memory walk and every profile's `run`; and its stream events
        self._order: np.ndarray | None = None
        self._of_order: dict[str, Any] = {}
        self._last_events: tuple[tuple[Any, ...], _StreamEvents] | None = None
        # seconds of each collective shape on each profile (held, so its id stays its own)
        self._seconds: dict[int, tuple[DeviceProfile, dict[tuple[Any, ...], float]]] = {}
        self._issue = np.zeros(space.size, dtype=bool)  # the node or its recomputed copy
        self._wait = np.zeros(space.size, dtype=bool)
        for i in self.kind:
            self._issue[[i, space.copy(i)]] = True
        for i in self.waits:
            self._wait[[i, space.copy(i)]] = True
        self._ends = np.full(index.n, -1, np.int64)  # wait node -> the collective it ends
        self._ends[list(self.waits)] = list(self.waits.values())

    def _per_order(self, entries: np.ndarray, what: str, make: Callable[[], T]) -> T:
        """`make()`, kept until another node order is asked of: the memory walk and every
        profile's `run` ask the same of one node order."""
        if self._order is not entries:
            self._order, self._of_order = entries, {}
        if what not in self._of_order:
            self._of_order[what] = make()
        return cast(T, self._of_order[what])

    def _buckets(self, entries: np.ndarray) -> list[tuple[list[int], list[int]]]:
        """Per issued collective (or FSDP bucket): the positions of its members and of the
        waits on them, in issue order. A wait ends the latest issue of its collective
        before it (its node or the node's recomputed copy)."""
        return self._per_order(entries, "buckets", lambda: self._make_buckets(entries))

    def _make_buckets(self, entries: np.ndarray) -> list[tuple[list[int], list[int]]]:
        index, opts = self.index, self.options
        if not opts.bucket_layers:
            issues, wait_at, wait_of = self._unbucketed(entries)
            ends_at = np.cumsum(np.bincount(wait_of, minlength=len(issues))).tolist()
            at = wait_at.tolist()
            return [
                ([p], at[(ends_at[g - 1] if g else 0) : ends_at[g]])
                for g, p in enumerate(issues.tolist())
            ]
        at = np.flatnonzero(self._issue[entries] | self._wait[entries]).tolist()
        nodes = index.space.node(entries[at]).tolist()
        groups: list[tuple[list[int], list[int]]] = []
        owner: dict[int, int] = {}  # node -> its latest issued group
        last_key: tuple[Any, ...] | None = None
        last_group = -1
        copies = (entries[at] >= index.space.copies).tolist()  # recomputed copies
        for p, node, copy in zip(at, nodes, copies, strict=True):
            if node in self.waits:
                g = owner.get(self.waits[node])
                if g is not None:
                    groups[g][1].append(p)
                continue
            key = (self.kind[node], index.layer[node], copy)
            bucket = opts.bucket_layers and node in self.fsdp and index.layer[node] is not None
            if bucket and key == last_key:
                g = last_group
                groups[g][0].append(p)
            else:
                groups.append(([p], []))
                g = len(groups) - 1
            if node in self.fsdp:  # other collectives between a layer's do not end its bucket
                last_key, last_group = (key if bucket else None), g
            owner[node] = g
        return groups

    def _unbucketed(self, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Without FSDP buckets, on arrays: each issue's position, and the positions of the
        waits found on them with the issue each ends (grouped by issue, in position order)."""
        space, length = self.index.space, len(entries) + 1
        issues = np.flatnonzero(self._issue[entries])
        keys = space.node(entries[issues]) * length + issues  # by (collective, position)
        by_key = np.argsort(keys)
        waits = np.flatnonzero(self._wait[entries])
        ends = self._ends[space.node(entries[waits])]
        k = np.searchsorted(keys[by_key], ends * length + waits) - 1
        found = k >= 0
        found[found] = keys[by_key[k[found]]] // length == ends[found]
        group = by_key[k[found]]
        order = np.argsort(group, kind="stable")  # waits come in position order
        return issues, waits[found][order], group[order]

    def _collectives(self, entries: np.ndarray) -> _Collectives:
        """The issued collectives (or FSDP buckets) of a node order, in issue order: issue
        positions, shapes (kind, bytes, group size, mesh dimension) and waits; kept for the
        last node order, which every profile times."""
        return self._per_order(entries, "collectives", lambda: self._make_collectives(entries))

    def _make_collectives(self, entries: np.ndarray) -> _Collectives:
        space = self.index.space
        if not self.options.bucket_layers:
            issues, wait_at, wait_of = self._unbucketed(entries)
            nodes = space.node(entries[issues]).tolist()
            return _Collectives(issues, [self._shape[n] for n in nodes], wait_at, wait_of)
        at = np.flatnonzero(self._issue[entries])
        node_at = dict(zip(at.tolist(), space.node(entries[at]).tolist(), strict=True))
        issue: list[int] = []
        shapes: list[tuple[str, int, int, str | None]] = []
        waited: list[int] = []
        ends: list[int] = []  # the bucket each wait ends
        for b, (members, waits) in enumerate(self._buckets(entries)):
            nodes = [node_at[p] for p in members]
            kind, _, world, dim = self._shape[nodes[0]]
            shapes.append((kind, sum(self.nbytes[i] for i in nodes), world, dim))
            issue.append(members[-1] if kind == "reduce_scatter" else members[0])
            waited += waits
            ends += [b] * len(waits)
        return _Collectives(
            np.array(issue, np.int64), shapes, np.array(waited, np.int64), np.array(ends, np.int64)
        )

    def _stream_events(
        self,
        entries: np.ndarray,
        offloaded: dict[int, int],
        reads: tuple[np.ndarray, np.ndarray] | None,
    ) -> _StreamEvents:
        """A node order's stream events in `walk_streams`' order, and what each costs: the
        collectives' shapes, then the host copies' bytes. Keys: collective b is b, the j-th
        host copy is len(shapes) + j (`copy_keys` says which node and direction). The same
        on every profile: kept for the last node order."""
        key = (entries, offloaded, reads)
        if self._last_events is not None and all(
            a is b for a, b in zip(self._last_events[0], key, strict=True)
        ):
            return self._last_events[1]
        space, opts = self.index.space, self.options
        c = self._collectives(entries)
        n = len(c.shapes)
        issue_at = c.issue
        moved = self.issue_positions(entries) if opts.prefetch else {}
        if moved:
            issue_at = np.array([moved.get(p, p) for p in c.issue.tolist()], np.int64)
        wait_at = c.wait_at
        if opts.sink_waits and reads is not None:
            sunk = [self._first_use(w, entries, reads) for w in wait_at.tolist()]
            wait_at = np.array(sunk, np.int64)
        wait_at = np.maximum(wait_at, c.issue[c.wait_of])
        # host copies issue on an offload's steps 0 and 2; steps 1 and 3 wait on them
        host_at = np.flatnonzero(space.is_step(entries))
        steps = space.step(entries[host_at]).tolist()
        nodes = space.node(entries[host_at]).tolist()
        copies: list[int] = []
        copy_keys: list[tuple[int, int]] = []
        host_key, copy_of = [], {}
        for k, node in zip(steps, nodes, strict=True):
            if k in (0, 2):
                copy_of[(node, k)] = n + len(copies)
                copies.append(offloaded[node])
                copy_keys.append((node, k // 2))
            host_key.append(copy_of[(node, k if k in (0, 2) else k - 1)])
        host_wait = np.array([k % 2 == 1 for k in steps], bool)
        # `walk_streams`' order: by position, issues before waits, then as listed (each
        # collective then its waits, then the host steps)
        counts = np.bincount(c.wait_of, minlength=n)
        listed = np.concatenate(
            (
                np.arange(n) + np.cumsum(counts) - counts,
                c.wait_of + 1 + np.arange(len(c.wait_of)),
                n + len(c.wait_of) + np.arange(len(host_at)),
            )
        )
        position = np.concatenate((issue_at, wait_at, host_at))
        waiting = np.concatenate((np.zeros(n, bool), np.ones(len(wait_at), bool), host_wait))
        what = np.concatenate(
            (np.zeros(n, np.int64), np.ones(len(wait_at), np.int64), np.where(host_wait, 1, 2))
        )
        host_keys = np.array(host_key, np.int64)  # a copy's key is its cost's index too
        keys = np.concatenate((np.arange(n), c.wait_of, host_keys))
        costs = np.concatenate(
            (np.arange(n), np.full(len(wait_at), -1), np.where(host_wait, -1, host_keys))
        )
        order = np.lexsort((listed, waiting, position))
        events = list(
            zip(
                position[order].tolist(),
                _WHAT[what[order]].tolist(),
                keys[order].tolist(),
                costs[order].tolist(),
                strict=True,
            )
        )
        result = _StreamEvents(c.shapes, copies, events, copy_keys)
        self._last_events = (key, result)
        return result

    def issue_positions(self, entries: np.ndarray) -> dict[int, int]:
        """Position each all-gather member is issued at, where prefetch or bucketing moves it
        earlier than its own (the memory walk counts its output from there)."""
        return self._per_order(entries, "moved", lambda: self._make_issue_positions(entries))

    def _make_issue_positions(self, entries: np.ndarray) -> dict[int, int]:
        moved: dict[int, int] = {}
        gathers = [  # FSDP's: a parameter's all-gather waits on no activation
            g
            for g in self._buckets(entries)
            if self._node_at(entries, g) in self.fsdp
            and self.kind[self._node_at(entries, g)] == "all_gather"
        ]
        for b, (members, _) in enumerate(gathers):
            issue = members[0]
            ahead = b - self.options.prefetch
            if self.options.prefetch and ahead >= 0 and gathers[ahead][1]:
                issue = min(issue, gathers[ahead][1][0])
            for p in members:
                if issue < p:
                    moved[p] = issue
        return moved

    def _first_use(self, at: int, entries: np.ndarray, reads: tuple[np.ndarray, np.ndarray]) -> int:
        """Position of the first op that computes with the value at `at`, through views."""
        reader, read = reads
        if self._readers is None or self._readers[0] is not reader:
            table: dict[int, list[int]] = {}
            for r, e in zip(reader.tolist(), read.tolist(), strict=True):
                table.setdefault(e, []).append(r)
            self._readers = (reader, table)
        table = self._readers[1]
        first, todo = len(entries), [at]
        while todo:
            p = todo.pop()
            for r in table.get(int(entries[p]), []):
                if r >= first:
                    continue
                if self._alias[int(self.index.space.node(entries[r]))]:
                    todo.append(r)
                else:
                    first = r
        return first if first < len(entries) else at

    def _node_at(self, entries: np.ndarray, group: tuple[list[int], list[int]]) -> int:
        return int(self.index.space.node(entries[group[0][0]]))

    def run(
        self,
        entries: np.ndarray,
        seconds: np.ndarray,
        profile: DeviceProfile,
        offloaded: dict[int, int],
        reads: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> StreamTimes:
        """Time the node order: `seconds` is the compute seconds of every entry; collectives
        and host copies take their streams' time (`walk_streams`). `reads`: the node order's
        (reader position, entry read) pairs, for `sink_waits`."""
        opts = self.options
        clock = np.concatenate(([0.0], np.cumsum(seconds[entries])))  # compute before p
        streams = self._stream_events(entries, offloaded, reads)
        held, timed = self._seconds.setdefault(id(profile), (profile, {}))
        durations: list[float] = []
        comm = 0.0
        for shape in streams.shapes:
            duration = timed.get(shape)
            if duration is None:
                kind, nbytes, world, dim = shape
                spans = held.spans_nodes(dim, self.degrees)
                duration = timed[shape] = collective_time(held, kind, nbytes, world, spans)
            comm += duration
            durations.append(duration)
        rate = profile.host_rate()
        durations += [nbytes / rate for nbytes in streams.copies]
        copied = sum(streams.copies)
        stalls = _walk(clock, streams.events, durations, opts.max_copies_in_flight)
        compute = float(clock[-1])
        if profile.host_hbm_contention:  # each copied byte is read or written in HBM once
            compute += copied / profile.bytes_per_s
        copy_stalls: dict[int, list[float]] = {}
        exposed = {"comm": 0.0, "copy": 0.0}
        n = len(streams.shapes)
        for key, wait in stalls.items():
            k = cast(int, key)
            if k < n:
                exposed["comm"] += wait
                continue
            exposed["copy"] += wait
            node, which = streams.copy_keys[k - n]
            copy_stalls.setdefault(node, [0.0, 0.0])[which] = wait
        return StreamTimes(
            compute_seconds=compute,
            comm_seconds=comm,
            exposed_comm_seconds=exposed["comm"],
            transfer_seconds=copied / rate if copied else 0.0,
            exposed_transfer_seconds=exposed["copy"],
            copy_stalls=copy_stalls,
        )


class _Collectives(NamedTuple):
    """A node order's issued collectives (or FSDP buckets), in issue order: each one's issue
    position and shape (kind, bytes, group size, mesh dimension); the positions of the waits
    on them and the collective each ends, grouped by collective in position order
    (`Streams._collectives`)."""

    issue: np.ndarray
    shapes: list[tuple[str, int, int, str | None]]
    wait_at: np.ndarray
    wait_of: np.ndarray


class _StreamEvents(NamedTuple):
    """A node order's stream events, sorted as `walk_streams` runs them, each (position, what,
    key, cost): the index of its seconds among the collectives' (`shapes`), then the host
    copies' (`copies`, bytes), -1 for a wait (`Streams._stream_events`); per host copy its
    node and direction (0: to the host, 1: back), for the keys from len(shapes) on."""

    shapes: list[tuple[str, int, int, str | None]]
    copies: list[int]
    events: list[tuple[int, str, Hashable, int]]
    copy_keys: list[tuple[int, int]]


_WHAT = np.array(["comm", "wait", "copy"], dtype=object)  # `_StreamEvents`' event kinds


class Event(NamedTuple):
    """One event of `walk_streams`: at node-order position `at`, `comm` or `copy` issues `key`
    on its stream for `seconds`; `wait` stalls compute until `key` has ended."""

    at: int
    what: Literal["comm", "copy", "wait"]
    key: Hashable
    seconds: float = 0.0


def walk_streams(
    clock: np.ndarray, events: list[Event], max_copies_in_flight: int | None = None
) -> dict[Hashable, float]:
    """Compute runs back to back (`clock[p]`: its seconds before position p); each stream
    runs its work in issue order, starting when issued or when its previous work ends; a
    wait stalls compute until its work ends; with a cap, issuing a copy while that many are
    queued stalls compute until the oldest ends (counted against the copy's key). Events at
    one position: issues before waits. Returns each waited or capped key's stall.

    >>> events = [Event(0, "comm", "a", 3.0), Event(2, "wait", "a")]
    >>> walk_streams(np.array([0.0, 1.0, 2.0]), events)
    {'a': 1.0}
    """
    order = sorted(range(len(events)), key=lambda i: (events[i].at, events[i].what == "wait", i))
    ordered = [(events[i].at, events[i].what, events[i].key, i) for i in order]
    return _walk(clock, ordered, [event.seconds for event in events], max_copies_in_flight)


def _walk(
    clock: np.ndarray,
    events: Sequence[tuple[int, str, Hashable, int]],
    seconds: list[float],
    max_copies_in_flight: int | None,
) -> dict[Hashable, float]:
    """`walk_streams` on events already in its order, each (position, what, key, index of
    its seconds in `seconds`)."""
    free = {"comm": 0.0, "copy": 0.0}
    done: dict[Hashable, float] = {}
    stalls: dict[Hashable, float] = {}
    stalled, queued = 0.0, list[float]()
    before = clock.tolist()
    for at, what, key, cost in events:
        now = before[at] + stalled
        if what == "wait":
            wait = max(0.0, done[key] - now)
            stalls[key] = stalls.get(key, 0.0) + wait
            stalled += wait
            continue
        if what == "copy" and max_copies_in_flight is not None:
            queued = sorted(t for t in queued if t > now)
            if len(queued) >= max_copies_in_flight:
                wait = queued[len(queued) - max_copies_in_flight] - now
                stalls[key] = stalls.get(key, 0.0) + wait
                stalled, now = stalled + wait, now + wait
        free[what] = max(now, free[what]) + seconds[cost]
        done[key] = free[what]
        if what == "copy":
            queued.append(free[what])
    return stalls
