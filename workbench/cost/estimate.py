"""Estimates: memory timeline and peak, recompute cost, step time, and the instant what-if.

Entry points: `Estimator(graph).estimate(policy)` replays torch's remat pass on node indices
(fast enough to re-estimate after every flip) and `estimate_remat(graph, result)` reads the
graph torch's pass produced. Both feed one liveness simulation, so they give equal figures.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch.fx as fx

from workbench.capture.graph import ORIGIN_KEY, JointGraph
from workbench.cost.allocator import AllocatorConfig, AllocatorReplay, replay_allocator
from workbench.cost.calibrate import Calibration
from workbench.cost.overlap import OverlapOptions, Streams, StreamTimes
from workbench.cost.profiles import DeviceProfile, get_profile
from workbench.cost.replay import offload_order, recompute_flags, replay
from workbench.cost.workspaces import blas_workspaces
from workbench.decide.decider import Decisions, decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError, check_int
from workbench.rewrite.entries import OFFLOAD_STEPS, Flat, NodeOrder
from workbench.rewrite.index import Storages, graph_index
from workbench.rewrite.remat import RECOMPUTED_SUFFIX, RematResult

# `gathered`: parameter copies made for compute on a per-rank graph (storages of FSDP
# unshard chains: the low-precision cast and the all-gathered weight); `optimizer`: state
# held the whole step, outside the graph; `workspaces`: cuBLAS's on a GPU, held likewise
# (`workbench.cost.workspaces`).
CATEGORIES: tuple[str, ...] = (
    "parameters",
    "inputs",
    "gradients",
    "activations",
    "temporaries",
    "gathered",
    "optimizer",
    "workspaces",
)
DEFAULT_PROFILES: tuple[str, ...] = ("h100", "h200", "cpu")
OptimizerName = Literal["adamw", "sgd", "none"]
BudgetKind = Literal["allocated", "reserved"]
BUDGET_KINDS: tuple[str, ...] = ("allocated", "reserved")
# fp32 state per parameter element: AdamW's two moments, SGD's momentum buffer.
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 8, "sgd": 4, "none": 0}
# What the model's backward does with its inputs (what forward saved, and the loss's gradient
# of the model's output): `freed` after each one's last use, as eager autograd, inductor's
# compiled code and FX's boxed codegen do; `held` until the backward returns, as an FX
# GraphModule backward does when AOTAutograd calls it with `f(*args)` (its caller's list
# keeps every argument; `make_boxed_func` is such a call too): torchtitan's compiler toolkit
# ran its backward so (`compiler` returned the GraphModule, 2025-11 to 2026-03).
BackwardInputs = Literal["freed", "held"]
BACKWARD_INPUTS: tuple[str, ...] = ("freed", "held")


def check_budget_kind(kind: object) -> BudgetKind:
    """`kind` if it names what a budget may hold (`BUDGET_KINDS`), else a WorkbenchError."""
    if kind not in BUDGET_KINDS:
        raise WorkbenchError(
            f"unknown budget kind {kind!r}; choose one of {', '.join(BUDGET_KINDS)}"
        )
    return kind  # type: ignore[return-value]


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
    # three streams (`workbench.cost.overlap`): compute alone, the communication stream's
    # busy time, and the part of it compute waits for (in step_seconds)
    compute_seconds: dict[str, float] = field(default_factory=dict)
    comm_seconds: dict[str, float] = field(default_factory=dict)
    exposed_comm_seconds: dict[str, float] = field(default_factory=dict)
    # per profile: bytes a rank holds outside the allocator (CUDA context, NCCL buffers)
    outside_allocator_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    # FLOPs backward runs again, by traced node (`GraphIndex.recompute_flops_by_node`): what
    # `recompute_flops` sums, and what pictures sum per box
    recompute_flops_by_node: dict[str, int] = field(default_factory=dict, repr=False)
    allocator_input: _AllocatorInput | None = field(default=None, repr=False, compare=False)
    device_storages: DeviceStorages | None = field(default=None, repr=False, compare=False)
    _allocator: AllocatorReplay | None = field(default=None, repr=False, compare=False)

    def allocator(self) -> AllocatorReplay:
        """The caching allocator's figures for this step (`workbench.cost.allocator`), run
        on first use: the what-if stays as fast without them."""
        if self._allocator is None:
            if self.allocator_input is None:
                raise WorkbenchError("this estimate has no allocation sequence to replay")
            self._allocator = replay_allocator(**self.allocator_input._asdict())
        return self._allocator

    @property
    def reserved_peak_bytes(self) -> int:
        """What torch's caching allocator holds at the end of the step (it only grows):
        `torch.cuda.max_memory_reserved`, apart from `outside_allocator_bytes`."""
        return self.allocator().reserved_peak_bytes

    def budget_bytes(self, kind: BudgetKind) -> int:
        """The peak a budget of `kind` is held against: allocated or reserved."""
        return self.peak_bytes if kind == "allocated" else self.reserved_peak_bytes

    @property
    def tokens_per_second(self) -> dict[str, float]:
        return {p: self.tokens / s for p, s in self.step_seconds.items() if s > 0}

    def totals(self) -> list[int]:
        """Live bytes of all categories at each step."""
        return [sum(step) for step in zip(*self.timeline.values(), strict=True)]

    def to_json(self, timeline: bool = False) -> dict[str, Any]:
        replayed = self.allocator() if self.allocator_input is not None else None
        result: dict[str, Any] = {
            "peak_bytes": self.peak_bytes,
            **({"reserved_peak_bytes": replayed.reserved_peak_bytes} if replayed else {}),
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
            "est_compute_seconds": self.compute_seconds,
            "est_comm_seconds": self.comm_seconds,
            "exposed_comm_seconds": self.exposed_comm_seconds,
            "outside_allocator_bytes": self.outside_allocator_bytes,
        }
        if replayed is not None and self.allocator_input is not None:
            result["allocator"] = {
                "allocated_peak_bytes": replayed.allocated_peak_bytes,
                "segments": replayed.segments,
                "expandable_segments": self.allocator_input.config.expandable_segments,
                "max_split_size": self.allocator_input.config.max_split_size,
            }
        if timeline:
            result["order"] = self.order
            result["timeline"] = self.timeline
            result["host_timeline"] = self.host_timeline
            if replayed is not None:
                result["reserved_timeline"] = replayed.reserved_timeline
        return result


class DeviceStorages(NamedTuple):
    """Every device storage of a walk: bytes, birth and free steps (inclusive), category
    (index into `CATEGORIES`) and the graph node owning it (an index into `GraphIndex`).
    What a caller splitting the step into phases sums (`workbench.cost.stages`)."""

    sizes: np.ndarray
    born: np.ndarray
    freed: np.ndarray
    category: np.ndarray
    node: np.ndarray


class _AllocatorInput(NamedTuple):
    """What `replay_allocator` replays: device storages' sizes, birth and free steps, the
    step count, what is allocated before the step and held (cuBLAS's workspaces, then the
    optimizer state's tensors), the allocator settings."""

    sizes: np.ndarray
    born: np.ndarray
    freed: np.ndarray
    steps: int
    before: list[int]
    config: AllocatorConfig


class _Walk(NamedTuple):
    """One liveness walk over a node order (`Estimator.simulate`): per step the live bytes by
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
    allocations: _AllocatorInput
    reads: tuple[np.ndarray, np.ndarray]
    device: DeviceStorages


class Estimator:
    """The what-if: figures for a policy without building a graph.

    `estimate(policy)` tags by the rules, replays torch's remat pass on the graph's index
    form (`workbench.cost.replay`), then walks the node order as FX's generated code runs it.
    `index` is the graph's `GraphIndex`, read by the solver, pictures and the explorer.
    """

    def __init__(
        self,
        graph: JointGraph,
        profiles: Iterable[str | DeviceProfile] = DEFAULT_PROFILES,
        optimizer: OptimizerName = "adamw",
        allocator: AllocatorConfig | None = None,
        overlap: OverlapOptions | None = None,
        calibration: Calibration | None = None,
        backward_inputs: BackwardInputs = "freed",
    ) -> None:
        if backward_inputs not in BACKWARD_INPUTS:
            raise WorkbenchError(
                f"backward_inputs {backward_inputs!r}: one of {', '.join(BACKWARD_INPUTS)}"
            )
        self.graph = graph
        self.backward_inputs = backward_inputs
        self.index = graph_index(graph)
        self.optimizer = optimizer
        self.optimizer_bytes = optimizer_bytes(graph, optimizer)
        # cuBLAS's workspaces on a GPU: allocated before the step (at the first matmul of
        # the first) and held, as the optimizer's state is
        self.workspace_tensors = blas_workspaces(graph)
        self.allocator = allocator or AllocatorConfig()
        self.overlap = overlap or OverlapOptions()
        self.streams = Streams(graph, self.index, self.overlap)
        self._moves = self.overlap.prefetch > 0 or self.overlap.bucket_layers
        # the optimizer's state tensors, one per parameter shard and moment (AdamW: 2)
        moments = OPTIMIZER_STATE_BYTES[optimizer] // 4
        self._optimizer_tensors = [
            4 * int(np.prod(graph.nodes[spec.placeholder].shapes[0] or (1,), dtype=np.int64))
            for spec in graph.inputs
            if spec.kind == "param"
            for _ in range(moments)
        ]
        self.profiles = [get_profile(p) for p in profiles]
        self.seconds = {p.name: self._node_seconds(p) for p in self.profiles}
        # measured op times replace the first profile's roofline where they match
        self.calibration: dict[str, Any] | None = None
        if calibration is not None and self.profiles:
            name = self.profiles[0].name
            roofline = dict(zip(self.index.names, self.seconds[name], strict=True))
            measured = calibration.node_seconds(graph)
            self.seconds[name] = [measured.get(n, s) if s > 0 else s for n, s in roofline.items()]
            coverage = calibration.coverage(roofline, measured)
            self.calibration = {"profile": name, "source": calibration.source, **coverage}
        # compute-stream seconds of every node-order entry (`entries.NodeOrder`): the offload
        # steps take none there, their copies run on the transfer stream
        space = self.index.space
        every = np.arange(space.size)
        own, node_of = ~space.is_step(every), space.node(every)
        self._seconds = {
            name: np.where(own, np.asarray(sec, dtype=float)[node_of], 0.0)
            for name, sec in self.seconds.items()
        }
        names = self.index.names  # of every entry: originals, copies, replays, offload steps
        entry_names = [*names, *(n + RECOMPUTED_SUFFIX for n in names)]
        entry_names += [n + "_replayed" for n in names]
        entry_names += [f"{n}_{step}" for n in names for step in OFFLOAD_STEPS]
        self._entry_names = np.array(entry_names, dtype=object)
        self._traced: dict[str, str] = {}  # entry name -> its traced node's (first wins)
        nodes = node_of.tolist()
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
        """Roofline: max(FLOPs / matmul rate, bytes read and written / bandwidth) on the
        compute stream; collectives run on the communication stream (`overlap.Streams`).
        Views, getitems, placeholders and the output move no data."""
        index, graph = self.index, self.graph
        seconds: list[float] = []
        for i, (node, slots, getitem) in enumerate(
            zip(graph.gm.graph.nodes, index.slots, index.is_getitem, strict=True)
        ):
            info = graph.nodes[node.name]
            if i in self.streams.kind or i in self.streams.waits:
                seconds.append(0.0)
                continue
            if node.op != "call_function" or info.is_view or getitem:
                seconds.append(0.0)
                continue
            written = sum(s for s in slots if isinstance(s, int))
            read = sum(graph.nodes[x.name].bytes for x in node.all_input_nodes)
            compute = info.flops / profile.matmul_rate(info.dtype) if info.flops else 0.0
            seconds.append(max(compute, (read + written) / profile.bytes_per_s))
        return seconds

    def communicators(self) -> int:
        """NCCL communicators a rank of this graph opens: the world's and one per mesh
        dimension of more than one rank (none on one device)."""
        if self.graph.world_size <= 1:
            return 0
        sizes = self.graph.degrees.mesh_sizes()  # the experts' FSDP is not counted apart
        return 1 + sum(size > 1 for dim, size in sizes.items() if dim != "efsdp")

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
        return self.simulate(self.order_for(decisions, options), granularity)

    def order_for(self, decisions: Decisions, options: OffloadOptions | None = None) -> Flat:
        """The node order torch's remat pass and then the offload pass (with `options`) would
        make of the graph tagged with `decisions`."""
        flat = replay(self.index, recompute_flags(self.index, decisions))
        offloaded = [name for name, tag in decisions.items() if tag.offload]
        if not offloaded:
            return flat
        return offload_order(self.index, flat, offloaded, options or OffloadOptions())[0]

    def order_of(self, gm: fx.GraphModule) -> NodeOrder:
        return self.index.order_of(gm)

    def backward_input_nodes(self, gm: fx.GraphModule) -> list[str]:
        """The nodes of `gm` (made from this graph by `remat`) that the model's backward
        reads from before it: what `backward_inputs="held"` keeps to the step's end."""
        index = self.index
        held = set(index.backward_inputs(index.flat(self.order_of(gm))).tolist())
        names = []
        for node in gm.graph.nodes:
            e = index.origin_of.get(node.meta.get(ORIGIN_KEY))
            # a forward node recomputed in backward is a copy there, not what forward saved
            copy = e is not None and not index.is_bwd[e] and node.meta.get("autograd_backward")
            if node.op != "output" and e in held and not copy:
                names.append(node.name)
        return names

    def simulate(self, order: NodeOrder | Flat, granularity: int = 1) -> Estimate:
        """Walk the graph as its generated code runs: allocate each node's fresh outputs,
        free a storage once no live value refers to it (values die after their last use,
        or right after they run when nothing uses them); graph inputs and outputs stay."""
        index = self.index
        flat = index.flat(order)
        table = index.storages(flat)
        sizes = table.sizes if granularity == 1 else -(-table.sizes // granularity) * granularity
        entries = flat.entries
        steps = len(entries)
        position = np.zeros(index.space.size, dtype=np.int64)
        position[entries] = np.arange(steps)
        born, freed = self._births(entries, table, position), self._deaths(flat, table, position)
        # host copies (owned by an offload's first step) count on the host, not the device
        space = index.space
        host = space.is_step(table.owner) & (space.step(table.owner) == 0)
        device = ~host
        category = self._categories(flat, table)
        live = self._live(category[device], born[device], freed[device], sizes[device], steps)
        host_deltas = np.zeros(steps + 2, dtype=np.int64)
        np.add.at(host_deltas, born[host], sizes[host])
        np.add.at(host_deltas, freed[host] + 1, -sizes[host])
        total = live.sum(axis=0)
        peak_p = int(np.argmax(total))
        offloaded = dict(
            zip(
                index.space.node(table.owner[host]).tolist(),
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
                born=born,
                freed=freed,
                host_live=np.cumsum(host_deltas[:steps]),
                offloaded=offloaded,
                reads=(flat.reader, flat.read),
                allocations=_AllocatorInput(
                    table.sizes[device],
                    born[device],
                    freed[device],
                    steps,
                    [*self.workspace_tensors, *self._optimizer_tensors],
                    self.allocator,
                ),
                device=DeviceStorages(
                    sizes[device],
                    born[device],
                    freed[device],
                    category[device],
                    index.space.node(table.owner[device]),
                ),
            )
        )

    def _deaths(self, flat: Flat, table: Storages, position: np.ndarray) -> np.ndarray:
        """The step after which each storage is freed. Values die after their last use, or
        right after they run when unused; graph inputs are held by the caller and outputs
        are returned; with `backward_inputs="held"` what the model's backward reads from
        before it lives until the step's end. A storage is freed when the last value holding
        it dies: every value aliasing it is made from a live one, so its reference count
        cannot reach zero earlier."""
        entries, steps = flat.entries, len(flat.entries)
        death = position.copy()
        np.maximum.at(death, flat.read, flat.reader)
        if self.backward_inputs == "held":
            death[self.index.backward_inputs(flat)] = steps - 1
        death[self._held_forever] = steps
        death[flat.read[entries[flat.reader] == self.index.output]] = steps
        freed = np.zeros(len(table.sizes), dtype=np.int64)
        np.maximum.at(freed, table.held, death[entries[table.holder]])
        return freed

    def _births(self, entries: np.ndarray, table: Storages, position: np.ndarray) -> np.ndarray:
        """The step each storage is allocated at: its owner's, but an all-gather issued early
        (FSDP prefetch, buckets) holds its output from its issue on, and graph inputs
        (parameters, batch) exist before the step starts: live from its first step, not from
        the placeholder step that names them."""
        born = table.born
        moved = self.streams.issue_positions(entries) if self._moves else {}
        if moved:
            owner_at = position[table.owner]
            early = np.arange(len(entries))
            early[list(moved)] = list(moved.values())
            born = np.where(np.isin(owner_at, list(moved)), early[owner_at], born)
        return np.where(np.isin(table.owner, self._held_forever), 0, born)

    def _live(
        self,
        category: np.ndarray,
        born: np.ndarray,
        freed: np.ndarray,
        sizes: np.ndarray,
        steps: int,
    ) -> np.ndarray:
        """Device bytes live at each step, per category (`CATEGORIES`), from the device
        storages' births and deaths; the optimizer state and the BLAS workspaces are held
        the whole step."""
        deltas = np.zeros((len(CATEGORIES), steps + 2), dtype=np.int64)
        np.add.at(deltas, (category, born), sizes)
        np.add.at(deltas, (category, freed + 1), -sizes)
        live = np.cumsum(deltas[:, :steps], axis=1)
        live[CATEGORIES.index("optimizer")] = self.optimizer_bytes
        live[CATEGORIES.index("workspaces")] = sum(self.workspace_tensors)
        return live

    def _categories(self, flat: Flat, table: Storages) -> np.ndarray:
        """Each storage's category: inputs by their kind, then returned values (gradients),
        gathered parameter copies, saved activations, and temporaries for the rest."""
        index = self.index
        space = index.space
        owner = space.node(table.owner)
        reload = OFFLOAD_STEPS.index("reload")
        return np.select(
            [
                (table.owner < space.copies) & (self._input_category[owner] >= 0),
                space.is_step(table.owner) & (space.step(table.owner) == reload),  # reloaded
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
        space = index.space
        # kept for backward (reloads are the same activations back from the host)
        saved = np.flatnonzero(
            (walk.category == CATEGORIES.index("activations")) & ~space.is_step(walk.owner)
        )
        saved_nodes = space.original(walk.owner[saved]).tolist()
        saved_sizes = walk.sizes[saved].tolist()
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
        copy_array = space.original(walk.entries[space.is_copy(walk.entries)])
        recomputed = index.recompute_flops_by_node(walk.entries)
        names = self._entry_names
        times = {
            p.name: self.streams.run(
                walk.entries, self._seconds[p.name], p, walk.offloaded, walk.reads
            )
            for p in self.profiles
        }
        offloaded = sum(walk.offloaded.values())
        communicators = self.communicators()
        return Estimate(
            peak_bytes=walk.peak,
            peak_node=names[walk.entries[walk.peak_at]],
            peak_index=walk.peak_at,
            peak_breakdown={c: int(walk.live[k, walk.peak_at]) for k, c in enumerate(CATEGORIES)},
            saved_activation_bytes=sum(saved_sizes),
            saved_by_node=dict(by_node),
            saved_by_layer=dict(by_layer),
            saved_at_peak=rows,
            recompute_flops=sum(recomputed.values()),
            recompute_flops_by_node=recomputed,
            recomputed_nodes=names[copy_array].tolist(),
            step_seconds={name: t.step_seconds for name, t in times.items()},
            recompute_seconds={
                name: float(sec[copy_array].sum()) for name, sec in self._seconds.items()
            },
            tokens=self.graph.tokens,
            order=names[walk.entries].tolist(),
            timeline={c: walk.live[k].tolist() for k, c in enumerate(CATEGORIES)},
            host_peak_bytes=int(walk.host_live.max(initial=0)),
            offloaded_bytes=offloaded,
            transfer_seconds={name: t.transfer_seconds for name, t in times.items()},
            exposed_transfer_seconds={
                name: t.exposed_transfer_seconds for name, t in times.items()
            },
            transfers=self._transfers(walk.entries, walk.offloaded, times) if offloaded else [],
            host_timeline=walk.host_live.tolist(),
            compute_seconds={name: t.compute_seconds for name, t in times.items()},
            comm_seconds={name: t.comm_seconds for name, t in times.items()},
            exposed_comm_seconds={name: t.exposed_comm_seconds for name, t in times.items()},
            outside_allocator_bytes={
                p.name: p.outside_allocator_bytes(communicators) for p in self.profiles
            },
            allocator_input=walk.allocations,
            device_storages=walk.device,
        )

    def _transfers(
        self, entries: np.ndarray, offloaded: dict[int, int], times: dict[str, StreamTimes]
    ) -> list[dict[str, Any]]:
        """Per offloaded value, in offload order: its bytes and the stall each of its copies
        caused compute on each profile (`overlap.Streams.run`)."""
        space = self.index.space
        at = entries[space.is_step(entries)]
        rows = []
        for i in space.node(at[space.step(at) == 0]).tolist():
            stalls = {name: t.copy_stalls.get(i, [0.0, 0.0]) for name, t in times.items()}
            rows.append(
                {
                    "node": self.index.names[i],
                    "bytes": offloaded[i],
                    "d2h_exposed_seconds": {name: s[0] for name, s in stalls.items()},
                    "h2d_exposed_seconds": {name: s[1] for name, s in stalls.items()},
                }
            )
        return rows


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
    return estimator.simulate(estimator.order_of(gm), granularity)
