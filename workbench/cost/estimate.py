"""Estimates: memory timeline and peak, recompute cost, step time, and the instant what-if.

Entry points: `Estimator(graph).estimate(policy)` replays torch's remat pass on node indices
(fast enough to re-estimate after every flip) and `estimate_remat(graph, result)` reads the
graph torch's pass produced. Both feed one liveness simulation, so they give equal figures.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch.fx as fx

from workbench.capture.graph import JointGraph
from workbench.cost.profiles import DeviceProfile, get_profile
from workbench.cost.replay import offload_schedule, recompute_flags, replay
from workbench.decide.decider import Decisions, decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError, check_int
from workbench.rewrite.index import Storages, graph_index
from workbench.rewrite.remat import RECOMPUTED_SUFFIX, RematResult
from workbench.rewrite.schedule import OFFLOAD_STEPS, Flat, Schedule, offload_step

# `gathered`: parameter copies made for compute on a per-rank graph (storages of FSDP
# unshard chains: the low-precision cast and the all-gathered weight); `optimizer`: state
# held the whole step, outside the graph.
CATEGORIES: tuple[str, ...] = (
    "parameters",
    "inputs",
    "gradients",
    "activations",
    "temporaries",
    "gathered",
    "optimizer",
)
DEFAULT_PROFILES: tuple[str, ...] = ("h100", "h200", "cpu")
OptimizerName = Literal["adamw", "sgd", "none"]
# fp32 state per parameter element: AdamW's two moments, SGD's momentum buffer.
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 8, "sgd": 4, "none": 0}
# Ring algorithms: bytes each rank sends, per byte of the whole buffer, in a group of W.
RING_FACTOR: dict[str, Callable[[int], float]] = {
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
    "broadcast": lambda w: (w - 1) / w,
    "all_reduce": lambda w: 2 * (w - 1) / w,
}


def optimizer_bytes(graph: JointGraph, optimizer: str) -> int:
    """State the optimizer holds for this rank's parameter shards (fp32 per element)."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise WorkbenchError(
            f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZER_STATE_BYTES)}"
        )
    elements = 0
    for spec in graph.inputs:
        if spec.kind == "param":
            shape = graph.nodes[spec.placeholder].shapes[0]
            elements += int(np.prod(shape, dtype=np.int64)) if shape else 1
    return elements * OPTIMIZER_STATE_BYTES[optimizer]


@dataclass
class Estimate:
    """Figures for one policy. Bytes are tensor storages; times are roofline estimates.

    `timeline[c][p]` is the live bytes of category `c` while the p-th node of the
    rematerialized graph runs (`order[p]`); the peak is the largest total of a step. Device
    bytes only: the host copies of offloaded activations are in `host_timeline`.
    """

    peak_bytes: int
    peak_node: str
    peak_index: int
    peak_breakdown: dict[str, int]
    saved_activation_bytes: int
    saved_by_node: dict[str, int]
    saved_by_layer: dict[str, int]
    saved_at_peak: list[dict[str, Any]]
    recompute_flops: int
    recomputed_nodes: list[str]
    step_seconds: dict[str, float]
    recompute_seconds: dict[str, float]
    tokens: int
    order: list[str] = field(repr=False)
    timeline: dict[str, list[int]] = field(repr=False)
    # CPU offload: host bytes apart from the device's, the copies' time over the host link
    # (both directions) and the part of it compute waits for (included in step_seconds)
    host_peak_bytes: int = 0
    offloaded_bytes: int = 0
    transfer_seconds: dict[str, float] = field(default_factory=dict)
    exposed_transfer_seconds: dict[str, float] = field(default_factory=dict)
    transfers: list[dict[str, Any]] = field(default_factory=list)
    host_timeline: list[int] = field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> dict[str, float]:
        return {p: self.tokens / s for p, s in self.step_seconds.items() if s > 0}

    def totals(self) -> list[int]:
        """Live bytes of all categories at each step."""
        return [sum(step) for step in zip(*self.timeline.values(), strict=True)]

    def to_json(self, timeline: bool = False) -> dict[str, Any]:
        result: dict[str, Any] = {
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "peak_breakdown": self.peak_breakdown,
            "saved_activation_bytes": self.saved_activation_bytes,
            "saved_by_layer": self.saved_by_layer,
            "saved_at_peak": self.saved_at_peak,
            "recompute_flops": self.recompute_flops,
            "recomputed_nodes": len(self.recomputed_nodes),
            "est_step_seconds": self.step_seconds,
            "est_recompute_seconds": self.recompute_seconds,
            "est_tokens_per_second": self.tokens_per_second,
            "host_peak_bytes": self.host_peak_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "transfer_seconds": self.transfer_seconds,
            "exposed_transfer_seconds": self.exposed_transfer_seconds,
            "transfers": self.transfers,
        }
        if timeline:
            result["order"] = self.order
            result["timeline"] = self.timeline
            result["host_timeline"] = self.host_timeline
        return result


class _Walk(NamedTuple):
    """One liveness walk over a schedule (`Estimator.simulate`): per step the live bytes by
    category; per storage its size, owning entry, category, birth and death steps; the host
    bytes per step and the offloaded storages' bytes by node."""

    entries: np.ndarray
    peak: int
    peak_at: int
    live: np.ndarray
    sizes: np.ndarray
    owner: np.ndarray
    category: np.ndarray
    born: np.ndarray
    freed: np.ndarray
    host_live: np.ndarray
    offloaded: dict[int, int]


class Estimator:
    """The what-if: figures for a policy without building a graph.

    `estimate(policy)` tags by the rules, replays torch's remat pass on the graph's index
    form (`workbench.cost.replay`), then walks the schedule as FX's generated code runs it.
    `index` is the graph's `GraphIndex`, read by the solver, pictures and the explorer.
    """

    def __init__(
        self,
        graph: JointGraph,
        profiles: Iterable[str | DeviceProfile] = DEFAULT_PROFILES,
        optimizer: OptimizerName = "adamw",
    ) -> None:
        self.graph = graph
        self.index = graph_index(graph)
        self.optimizer = optimizer
        self.optimizer_bytes = optimizer_bytes(graph, optimizer)
        self.profiles = [get_profile(p) for p in profiles]
        self.seconds = {p.name: self._node_seconds(p) for p in self.profiles}
        # compute-stream seconds of every schedule entry (`index.Schedule`): the offload
        # steps take none there, their copies run on the transfer stream
        self._seconds = {
            name: np.concatenate((np.tile(sec, 3), np.zeros(4 * len(sec))))
            for name, sec in self.seconds.items()
        }
        self._host_rates = {p.name: p.host_rate() for p in self.profiles}
        names = self.index.names  # of every entry: originals, copies, replays, offload steps
        entry_names = [*names, *(n + RECOMPUTED_SUFFIX for n in names)]
        entry_names += [n + "_replayed" for n in names]
        entry_names += [f"{n}_{step}" for n in names for step in OFFLOAD_STEPS]
        self._entry_names = np.array(entry_names, dtype=object)
        self._traced: dict[str, str] = {}  # entry name -> its traced node's (first wins)
        nodes = self.index.entry_node(np.arange(len(entry_names))).tolist()
        for entry, node in zip(entry_names, nodes, strict=True):
            self._traced.setdefault(entry, names[node])
        # per node: the category of a graph input's storage (-1 for other nodes); in an
        # FSDP unshard chain
        placeholders, n = self.index.placeholder_category, self.index.n
        self._input_category = np.array(
            [CATEGORIES.index(placeholders[i]) if i in placeholders else -1 for i in range(n)]
        )
        self._held_forever = np.array(sorted(placeholders), dtype=np.int64)
        self._gathered = np.zeros(n, dtype=bool)
        self._gathered[list(self.index.gathered)] = True

    def _node_seconds(self, profile: DeviceProfile) -> list[float]:
        """Roofline: max(FLOPs / matmul rate, bytes read and written / bandwidth); a
        collective takes the ring time of its buffer on its group's link (waits none), not
        overlapped with compute. Views, getitems, placeholders and the output move no data."""
        index, graph = self.index, self.graph
        links = self._collective_seconds(profile)
        seconds: list[float] = []
        for node, slots, getitem in zip(
            graph.gm.graph.nodes, index.slots, index.is_getitem, strict=True
        ):
            info = graph.nodes[node.name]
            if node.name in links:
                seconds.append(links[node.name])
                continue
            if node.op != "call_function" or info.is_view or getitem:
                seconds.append(0.0)
                continue
            written = sum(s for s in slots if isinstance(s, int))
            read = sum(graph.nodes[x.name].bytes for x in node.all_input_nodes)
            compute = info.flops / profile.matmul_rate(info.dtype) if info.flops else 0.0
            seconds.append(max(compute, (read + written) / profile.bytes_per_s))
        return seconds

    def _collective_seconds(self, profile: DeviceProfile) -> dict[str, float]:
        """Ring cost of each collective: factor(W) x buffer bytes / link rate, where W is
        its mesh dimension's size. The mesh is ("fsdp", "tp") with tp innermost: a tp group
        spans nodes when tp exceeds the ranks per node, an fsdp group when the world does."""
        graph = self.graph
        sizes = {"fsdp": int(graph.config.get("fsdp", 1)), "tp": int(graph.config.get("tp", 1))}
        spans = {
            "tp": sizes["tp"] > profile.ranks_per_node,
            "fsdp": graph.world_size > profile.ranks_per_node,
        }
        result: dict[str, float] = {}
        for c in graph.collectives():
            world = sizes.get(c.mesh_dim or "", graph.world_size)
            if c.kind == "wait" or c.kind not in RING_FACTOR or world <= 1:
                result[c.node] = 0.0
                continue
            rate = profile.link_rate(spans.get(c.mesh_dim or "", graph.world_size > 8))
            result[c.node] = RING_FACTOR[c.kind](world) * c.bytes / rate
        return result

    def backward_readers(self, name: str) -> list[str]:
        """Backward ops reading `name`'s output, directly or through views of its storage."""
        return self.index.backward_readers(name)

    def traced_node(self, name: str) -> str:
        """The traced node a node name of this estimator's figures stands for (`peak_node`,
        `order`): a recomputed copy, a replayed view or an offload step names its
        original's."""
        if name not in self._traced:
            raise WorkbenchError(
                f"{name!r} names no node of the estimates of {self.graph.model_name!r}"
            )
        return self._traced[name]

    def estimate(self, policy: Policy | Decisions, granularity: int = 1) -> Estimate:
        """The what-if: figures for `policy` as if tagged and rematerialized by torch."""
        if not isinstance(policy, Policy | dict):
            raise TypeError(
                f"Estimator.estimate: policy must be a Policy (Policy('full'), Policy.load(path)) "
                f"or decisions from decide(), got {type(policy).__name__}"
            )
        check_int("Estimator.estimate granularity", granularity, 1, 2**40, "bytes")
        if self.index.foreign_tags:
            raise WorkbenchError(
                f"the graph carries AOTAutograd tags ({', '.join(self.index.foreign_tags)}) "
                "that the what-if does not replay: run workbench.rewrite.remat.remat and "
                "estimate_remat instead"
            )
        decisions = decide(self.graph, policy) if isinstance(policy, Policy) else policy
        options = policy.offload if isinstance(policy, Policy) else OffloadOptions()
        return self.simulate(self.schedule_for(decisions, options), granularity)

    def schedule_for(self, decisions: Decisions, options: OffloadOptions | None = None) -> Flat:
        """The schedule torch's remat pass and then the offload pass (with `options`) would
        make of the graph tagged with `decisions`."""
        flat = replay(self.index, recompute_flags(self.index, decisions))
        offloaded = [name for name, tag in decisions.items() if tag.offload]
        if not offloaded:
            return flat
        return offload_schedule(self.index, flat, offloaded, options or OffloadOptions())[0]

    def schedule_of(self, gm: fx.GraphModule) -> Schedule:
        return self.index.schedule_of(gm)

    def simulate(self, schedule: Schedule | Flat, granularity: int = 1) -> Estimate:
        """Walk the graph as its generated code runs: allocate each node's fresh outputs,
        free a storage once no live value refers to it (values die after their last use,
        or right after they run when nothing uses them); graph inputs and outputs stay."""
        index = self.index
        n = index.n
        flat = index.flat(schedule)
        table = index.storages(flat)
        sizes = table.sizes if granularity == 1 else -(-table.sizes // granularity) * granularity

        # Values die after their last use, or right after they run when unused; graph
        # inputs are held by the caller and outputs are returned. A storage is freed when
        # the last value holding it dies: every value aliasing it is made from a live one,
        # so its reference count cannot reach zero earlier.
        entries = flat.entries
        steps = len(entries)
        position = np.zeros(7 * n, dtype=np.int64)
        position[entries] = np.arange(steps)
        death = position.copy()
        np.maximum.at(death, flat.read, flat.reader)
        death[self._held_forever] = steps
        death[flat.read[entries[flat.reader] == index.output]] = steps
        freed = np.zeros(len(sizes), dtype=np.int64)
        np.maximum.at(freed, table.held, death[entries[table.holder]])

        # host copies (owned by an offload's first step) count on the host, not the device
        host = (table.owner >= 3 * n) & (offload_step(n, table.owner) == 0)
        device = ~host
        category = self._categories(flat, table)
        deltas = np.zeros((len(CATEGORIES), steps + 2), dtype=np.int64)
        np.add.at(deltas, (category[device], table.born[device]), sizes[device])
        np.add.at(deltas, (category[device], freed[device] + 1), -sizes[device])
        live = np.cumsum(deltas[:, :steps], axis=1)
        live[CATEGORIES.index("optimizer")] = self.optimizer_bytes  # held the whole step
        host_deltas = np.zeros(steps + 2, dtype=np.int64)
        np.add.at(host_deltas, table.born[host], sizes[host])
        np.add.at(host_deltas, freed[host] + 1, -sizes[host])
        total = live.sum(axis=0)
        peak_p = int(np.argmax(total))
        offloaded = dict(
            zip(
                index.entry_node(table.owner[host]).tolist(),
                table.sizes[host].tolist(),
                strict=True,
            )
        )
        return self._report(
            _Walk(
                entries=entries,
                peak=int(total[peak_p]),
                peak_at=peak_p,
                live=live,
                sizes=sizes,
                owner=table.owner,
                category=category,
                born=table.born,
                freed=freed,
                host_live=np.cumsum(host_deltas[:steps]),
                offloaded=offloaded,
            )
        )

    def _categories(self, flat: Flat, table: Storages) -> np.ndarray:
        """Each storage's category: inputs by their kind, then returned values (gradients),
        gathered parameter copies, saved activations, and temporaries for the rest."""
        index = self.index
        owner = index.entry_node(table.owner)
        step = table.owner - 3 * index.n
        return np.select(
            [
                (table.owner < index.n) & (self._input_category[owner] >= 0),
                (step >= 0) & (step % 4 == 2),  # a reloaded activation
                index.returned_mask(flat, table),
                self._gathered[owner],
                index.saved_mask(flat, table),
            ],
            [
                self._input_category[owner],
                CATEGORIES.index("activations"),
                CATEGORIES.index("gradients"),
                CATEGORIES.index("gathered"),
                CATEGORIES.index("activations"),
            ],
            CATEGORIES.index("temporaries"),
        )

    def _report(self, walk: _Walk) -> Estimate:
        """The figures of one walk: peak and what it holds, saved activations, recompute
        cost, step time with exposed copies, timelines."""
        index = self.index
        n = index.n
        # kept for backward (reloads are the same activations back from the host)
        saved = np.flatnonzero(
            (walk.category == CATEGORIES.index("activations")) & (walk.owner < 3 * n)
        )
        saved_nodes, saved_sizes = (walk.owner[saved] % n).tolist(), walk.sizes[saved].tolist()
        by_layer: dict[str, int] = defaultdict(int)
        by_node: dict[str, int] = defaultdict(int)
        for i, size in zip(saved_nodes, saved_sizes, strict=True):
            layer = index.layer[i]
            by_layer["-" if layer is None else str(layer)] += size
            by_node[index.names[i]] += size
        at_peak = (walk.born[saved] <= walk.peak_at) & (walk.peak_at <= walk.freed[saved])
        rows = [
            {
                "node": index.names[i],
                "layer": index.layer[i],
                "module": index.module[i],
                "op": index.op[i],
                "bytes": size,
            }
            for i, size, here in zip(saved_nodes, saved_sizes, at_peak.tolist(), strict=True)
            if here
        ]
        rows.sort(key=lambda r: (-r["bytes"], r["node"]))
        copy_array = walk.entries[(walk.entries >= n) & (walk.entries < 2 * n)] - n
        copies = copy_array.tolist()
        names = self._entry_names
        compute = {name: float(sec[walk.entries].sum()) for name, sec in self._seconds.items()}
        exposed, transfers = self._transfers(walk.entries, walk.offloaded)
        offloaded = sum(walk.offloaded.values())
        return Estimate(
            peak_bytes=walk.peak,
            peak_node=names[walk.entries[walk.peak_at]],
            peak_index=walk.peak_at,
            peak_breakdown={c: int(walk.live[k, walk.peak_at]) for k, c in enumerate(CATEGORIES)},
            saved_activation_bytes=sum(saved_sizes),
            saved_by_node=dict(by_node),
            saved_by_layer=dict(by_layer),
            saved_at_peak=rows,
            recompute_flops=sum(index.flops[i] for i in copies),
            recomputed_nodes=names[copy_array].tolist(),
            step_seconds={name: compute[name] + exposed[name] for name in compute},
            recompute_seconds={
                name: float(sec[copy_array].sum()) for name, sec in self._seconds.items()
            },
            tokens=self.graph.tokens,
            order=names[walk.entries].tolist(),
            timeline={c: walk.live[k].tolist() for k, c in enumerate(CATEGORIES)},
            host_peak_bytes=int(walk.host_live.max(initial=0)),
            offloaded_bytes=offloaded,
            transfer_seconds={
                name: 2 * sum(walk.offloaded.values()) / rate
                for name, rate in self._host_rates.items()
            },
            exposed_transfer_seconds=exposed,
            transfers=transfers,
            host_timeline=walk.host_live.tolist(),
        )

    def _transfers(
        self, entries: np.ndarray, offloaded: dict[int, int]
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """The two-stream model of the offload steps: compute runs its entries in order on
        one stream; copies queue on one transfer stream (device->host from the `offload`
        step, host->device from the `reload` step, each starting when issued or when the
        previous copy ends, taking bytes / the profile's host link rate). The `free` step
        waits for its device->host copy, the `wait` step for its reload: compute stalls
        until the copy ends. Returns the stall total per profile (added to step time) and
        per offloaded value its bytes and the stall each of its copies caused."""
        n = self.index.n
        at = np.flatnonzero(entries >= 3 * n)
        exposed = {name: 0.0 for name in self._seconds}
        if not len(at):
            return exposed, []
        kinds = offload_step(n, entries[at]).tolist()
        nodes = self.index.entry_node(entries[at]).tolist()
        rows: dict[int, dict[str, Any]] = {}
        for i, k in zip(nodes, kinds, strict=True):
            if k == 0:
                rows[i] = {"node": self.index.names[i], "bytes": offloaded[i],
                           "d2h_exposed_seconds": {}, "h2d_exposed_seconds": {}}  # fmt: skip
        for name, seconds in self._seconds.items():
            clock = np.cumsum(seconds[entries])[at].tolist()  # compute time at each step
            rate = self._host_rates[name]
            stall, queue = 0.0, 0.0
            done: dict[tuple[int, int], float] = {}
            for now, i, k in zip(clock, nodes, kinds, strict=True):
                now += stall
                if k in (0, 2):  # a copy is issued
                    queue = max(now, queue) + offloaded[i] / rate
                    done[i, k] = queue
                    continue
                wait = max(0.0, done[i, k - 1] - now)
                stall += wait
                rows[i]["d2h_exposed_seconds" if k == 1 else "h2d_exposed_seconds"][name] = wait
            exposed[name] = stall
        return exposed, list(rows.values())


def estimate(
    graph: JointGraph,
    policy: Policy | Decisions,
    profiles: Iterable[str | DeviceProfile] = DEFAULT_PROFILES,
) -> Estimate:
    """One-off estimate; keep an `Estimator` to re-estimate many policies of one graph."""
    return Estimator(graph, profiles).estimate(policy)


def estimate_remat(
    graph: JointGraph,
    result: RematResult | fx.GraphModule,
    estimator: Estimator | None = None,
    granularity: int = 1,
) -> Estimate:
    """Figures for the graph torch's remat pass actually produced (the full path)."""
    estimator = estimator or Estimator(graph)
    gm = result.gm if isinstance(result, RematResult) else result
    return estimator.simulate(estimator.schedule_of(gm), granularity)
