"""Estimates: memory timeline and peak, recompute cost, step time, and the instant what-if.

Entry points: `Estimator(graph).estimate(policy)` replays torch's remat pass on node indices
(fast enough to re-estimate after every flip) and `estimate_remat(graph, result)` reads the
graph torch's pass produced. Both feed one liveness simulation, so they give equal figures.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (  # noqa: E501
    is_impure_node_for_dce,
)
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.errors import WorkbenchError
from workbench.graph import ORIGIN_KEY, JointGraph
from workbench.policy import Decisions, Policy, decide
from workbench.profiles import DeviceProfile, get_profile, round_up
from workbench.remat import RECOMPUTED_SUFFIX, RematResult

CATEGORIES: tuple[str, ...] = ("parameters", "inputs", "gradients", "activations", "temporaries")
DEFAULT_PROFILES: tuple[str, ...] = ("h100", "h200", "cpu")

# A node's output slots: an int is a fresh storage of that many bytes (0: no tensor), a
# pair (j, s) aliases slot s of the node's j-th input (views, getitem, in-place ops).
Slot = int | tuple[int, int]


@dataclass
class Estimate:
    """Figures for one policy. Bytes are tensor storages; times are roofline estimates.

    `timeline[c][p]` is the live bytes of category `c` while the p-th node of the
    rematerialized graph runs (`order[p]`); the peak is the largest total of a step.
    """

    peak_bytes: int
    peak_node: str
    peak_index: int
    peak_breakdown: dict[str, int]
    saved_activation_bytes: int
    saved_by_layer: dict[str, int]
    saved_at_peak: list[dict[str, Any]]
    recompute_flops: int
    recomputed_nodes: list[str]
    step_seconds: dict[str, float]
    recompute_seconds: dict[str, float]
    tokens: int
    order: list[str] = field(repr=False)
    timeline: dict[str, list[int]] = field(repr=False)

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
        }
        if timeline:
            result["order"] = self.order
            result["timeline"] = self.timeline
        return result


def _storage_keys(node: fx.Node) -> list[Any]:
    """The storage behind each output slot of `node` (None for non-tensor slots)."""
    value = node.meta.get("val")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [
        StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None for v in values
    ]


def _slots_of(node: fx.Node, keys: dict[fx.Node, list[Any]]) -> list[Slot]:
    """Fresh storage, or alias of a direct input's slot, from the fake tensors' storages."""
    value = node.meta["val"]
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    held = {
        key: (j, s)
        for j, x in reversed(list(enumerate(node.all_input_nodes)))
        for s, key in enumerate(keys[x])
        if key is not None
    }
    slots: list[Slot] = []
    for tensor, key in zip(values, keys[node], strict=True):
        if key is None:
            slots.append(0)
        elif key in held:
            slots.append(held[key])
        elif node.op == "call_function" and node.target is operator.getitem:
            slots.append((0, int(node.args[1])))  # type: ignore[arg-type]
        else:
            slots.append(int(tensor.untyped_storage().nbytes()))
    return slots


class Estimator:
    """Index form of a JointGraph: estimates a policy without building a graph.

    `estimate(policy)` replays `remat_using_tags_for_fwd_loss_bwd_graph` on indices: the
    forward region as is, each backward node preceded by the recompute-tagged forward nodes
    it needs (in forward order, each copied once), dead-code elimination, and getitems
    raised to their producers. Then the same liveness walk FX's generated code implies.
    """

    def __init__(
        self, graph: JointGraph, profiles: Iterable[str | DeviceProfile] = DEFAULT_PROFILES
    ) -> None:
        self.graph = graph
        self.profiles = [get_profile(p) for p in profiles]
        nodes = list(graph.gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        self.n = len(nodes)
        self.names = [n.name for n in nodes]
        self.index_of = {n.name: i for i, n in enumerate(nodes)}
        self.origin_of = {n.meta.get(ORIGIN_KEY): i for i, n in enumerate(nodes)}
        self.args: list[tuple[int, ...]] = [
            tuple(index[x] for x in n.all_input_nodes) for n in nodes
        ]
        self.users: list[tuple[int, ...]] = [tuple(index[u] for u in n.users) for n in nodes]
        self.is_bwd = [bool(n.meta.get("autograd_backward", False)) for n in nodes]
        self.is_getitem = [n.op == "call_function" and n.target is operator.getitem for n in nodes]
        self.impure = [
            n.op in ("placeholder", "output") or is_impure_node_for_dce(n) for n in nodes
        ]
        self.is_random = [graph.nodes[n.name].is_random for n in nodes]
        self.placeholders = [i for i, n in enumerate(nodes) if n.op == "placeholder"]
        outputs = [i for i, n in enumerate(nodes) if n.op == "output"]
        self.output = outputs[0]
        self.slots = self._all_slots(nodes)
        self.regions = self._regions()
        self.region_of = {b: r for r, (s, e) in enumerate(self.regions) for b in range(s, e)}
        infos = [graph.nodes[n.name] for n in nodes]
        self.phase = [i.phase for i in infos]
        self.layer = [i.layer for i in infos]
        self.module = [i.module for i in infos]
        self.op = [i.op for i in infos]
        self.flops = [i.flops for i in infos]
        kinds = {spec.placeholder: spec.kind for spec in graph.inputs}
        self.placeholder_category = {
            i: "parameters" if kinds.get(self.names[i]) == "param" else "inputs"
            for i in self.placeholders
        }
        self.seconds = {p.name: self._node_seconds(p, nodes, infos) for p in self.profiles}
        # torch's pass also reads these AOTAutograd tags; graphs from workbench.trace have none.
        self.foreign_tags = sorted(
            {k for n in nodes for k in ("ac_graph_id", "partitioner_tag") if k in n.meta}
        )

    # --- precomputation --------------------------------------------------------------------

    def _all_slots(self, nodes: list[fx.Node]) -> list[list[Slot]]:
        keys: dict[fx.Node, list[Any]] = {}
        placeholder_storages: set[Any] = set()
        slots: list[list[Slot]] = []
        for node in nodes:
            if node.op == "output":
                slots.append([])
                continue
            if "val" not in node.meta:
                raise WorkbenchError(
                    f"node {node.name!r} ({node.target}) has no recorded output "
                    "(meta['val']): the memory simulator cannot size it; trace the step with "
                    "workbench.trace.trace so every node carries a fake tensor"
                )
            keys[node] = _storage_keys(node)
            if node.op == "placeholder":  # inputs may share a storage (token ids and targets)
                key, value = keys[node][0], node.meta["val"]
                fresh = key is not None and key not in placeholder_storages
                placeholder_storages.add(key)
                slots.append([int(value.untyped_storage().nbytes()) if fresh else 0])
                continue
            slots.append(_slots_of(node, keys))
        return slots

    def _regions(self) -> list[tuple[int, int]]:
        """Maximal runs of autograd_backward nodes, as torch's pass finds them."""
        regions, start = [], None
        for i, bwd in enumerate(self.is_bwd):
            if bwd and start is None:
                start = i
            elif not bwd and start is not None:
                regions.append((start, i))
                start = None
        if start is not None:
            regions.append((start, self.n))
        return regions

    def _node_seconds(
        self, profile: DeviceProfile, nodes: list[fx.Node], infos: list[Any]
    ) -> list[float]:
        """Roofline: max(FLOPs / matmul rate, bytes read and written / bandwidth).

        Views, getitems, placeholders and the output move no data."""
        seconds: list[float] = []
        for node, info, slots, getitem in zip(
            nodes, infos, self.slots, self.is_getitem, strict=True
        ):
            if node.op != "call_function" or info.is_view or getitem:
                seconds.append(0.0)
                continue
            written = sum(s for s in slots if isinstance(s, int))
            read = sum(self.graph.nodes[x.name].bytes for x in node.all_input_nodes)
            compute = info.flops / profile.matmul_rate(info.dtype) if info.flops else 0.0
            seconds.append(max(compute, (read + written) / profile.bytes_per_s))
        return seconds

    def backward_readers(self, name: str) -> list[str]:
        """Backward ops that read `name`'s output, directly or through forward views of its
        storage (a matmul's output is often read by backward only via its `_unsafe_view`)."""
        readers: set[str] = set()
        todo, seen = [self.index_of[name]], set()
        while todo:
            i = todo.pop()
            for u in self.users[i]:
                if self.phase[u] == "backward":
                    readers.add(self.names[u])
                elif u not in seen and any(
                    isinstance(slot, tuple) and self.args[u][slot[0]] == i for slot in self.slots[u]
                ):
                    seen.add(u)
                    todo.append(u)
        return sorted(readers)

    # --- the remat pass on indices ---------------------------------------------------------

    def recompute_set(self, decisions: Decisions) -> list[bool]:
        recompute = [False] * self.n
        for name, decision in decisions.items():
            if decision.recompute:
                recompute[self.index_of[name]] = True
        return recompute

    def schedule(self, recompute: Sequence[bool]) -> tuple[list[int], dict[int, tuple[int, ...]]]:
        """Node order and inputs of the graph torch's remat pass would produce.

        Entries `i < n` are original nodes, `n + i` the recomputed copy of node i."""
        n, args0 = self.n, self.args
        identity = list(range(n)), dict(enumerate(args0))
        chosen = [i for i in range(n) if recompute[i]]
        if not chosen:
            return identity
        random = [self.names[i] for i in chosen if self.is_random[i]]
        if random:
            raise WorkbenchError(
                f"random ops cannot be recomputed by torch's remat pass: {', '.join(random[:3])}"
            )
        needing = {
            self.region_of[u]
            for i in chosen
            for u in self.users[i]
            if self.is_bwd[u] and u in self.region_of
        }
        if not needing:
            return identity
        if len(needing) > 1:
            raise WorkbenchError(
                f"{len(needing)} disjoint backward regions read recomputed nodes; torch's remat "
                "pass supports one: keep the recompute tags inside one backward region"
            )
        start, end = self.regions[needing.pop()]

        def mapped(xs: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(n + x if recompute[x] else x for x in xs)

        order = list(range(start))
        args = {i: args0[i] for i in range(start)}
        done = bytearray(n)
        for b in range(start, end):
            deps: list[int] = []
            stack = [x for x in args0[b] if recompute[x] and not done[x]]
            while stack:
                x = stack.pop()
                if done[x]:
                    continue
                done[x] = 1
                deps.append(x)
                stack.extend(y for y in args0[x] if recompute[y] and not done[y])
            for d in sorted(deps):
                order.append(n + d)
                args[n + d] = mapped(args0[d])
            order.append(b)
            args[b] = mapped(args0[b])
        for i in range(end, n):
            order.append(i)
            args[i] = args0[i]
        return self._raise_getitems(self._eliminate_dead_code(order, args), args), args

    def _eliminate_dead_code(self, order: list[int], args: dict[int, tuple[int, ...]]) -> list[int]:
        n, impure = self.n, self.impure
        alive = bytearray(2 * n)
        for e in reversed(order):
            if alive[e] or impure[e % n]:
                alive[e] = 1
                for x in args[e]:
                    alive[x] = 1
        return [e for e in order if alive[e]]

    def _raise_getitems(self, order: list[int], args: dict[int, tuple[int, ...]]) -> list[int]:
        """torch's `raise_getitems`: each getitem moves right after the node it unpacks
        (a getitem of a getitem, which aten graphs do not have, would stay in place)."""
        n, is_getitem = self.n, self.is_getitem
        children: dict[int, list[int]] = defaultdict(list)
        for e in order:
            if is_getitem[e % n] and not is_getitem[args[e][0] % n]:
                children[args[e][0]].append(e)
        raised: list[int] = []
        for e in order:
            if is_getitem[e % n] and not is_getitem[args[e][0] % n]:
                continue
            raised.append(e)
            raised.extend(children.get(e, ()))
        return raised

    # --- estimates ---------------------------------------------------------------------------

    def estimate(self, policy: Policy | Decisions, granularity: int = 1) -> Estimate:
        """The what-if: figures for `policy` as if tagged and rematerialized by torch."""
        if self.foreign_tags:
            raise WorkbenchError(
                f"the graph carries AOTAutograd tags ({', '.join(self.foreign_tags)}) that the "
                "what-if does not replay: run workbench.remat.remat and estimate_remat instead"
            )
        decisions = decide(self.graph, policy) if isinstance(policy, Policy) else policy
        order, args = self.schedule(self.recompute_set(decisions))
        return self.simulate(order, args, granularity)

    def schedule_of(self, gm: fx.GraphModule) -> tuple[list[int], dict[int, tuple[int, ...]]]:
        """The order and inputs of a graph produced from this one by torch's remat pass.

        Nodes map back through `meta[ORIGIN_KEY]` (the pass renames nodes); a copy of a
        forward node that runs in backward is its recomputed copy."""
        entry: dict[fx.Node, int] = {}
        order: list[int] = []
        args: dict[int, tuple[int, ...]] = {}
        for node in gm.graph.nodes:
            origin = node.meta.get(ORIGIN_KEY)
            i = self.output if node.op == "output" else self.origin_of.get(origin)
            if i is None or origin is None and node.op != "output":
                raise WorkbenchError(
                    f"node {node.name!r} does not come from the traced graph of "
                    f"{self.graph.model_name!r}: estimate graphs that torch's remat pass made "
                    "from it (workbench.remat.remat)"
                )
            if not self.is_bwd[i] and node.meta.get("autograd_backward", False):
                i += self.n
            entry[node] = i
            order.append(i)
            args[i] = tuple(entry[x] for x in node.all_input_nodes)
        return order, args

    def simulate(
        self, order: list[int], args: dict[int, tuple[int, ...]], granularity: int = 1
    ) -> Estimate:
        """Walk the graph as its generated code runs: allocate each node's fresh outputs,
        free a storage once no live value refers to it (values die after their last use,
        or right after they run when nothing uses them); graph inputs and outputs stay."""
        n, phase = self.n, self.phase

        # Storages: fresh slots get an id when their node runs; aliases resolve through the
        # node's inputs (a recomputed copy aliases its own inputs, not its original's).
        storages: dict[int, tuple[int, ...]] = {}
        slot_storage: dict[tuple[int, int], int] = {}
        sizes: list[int] = []
        owner: list[int] = []
        allocated_at: list[int] = []
        for p, e in enumerate(order):
            held = []
            for s, slot in enumerate(self.slots[e % n]):
                if isinstance(slot, int):
                    if slot == 0:
                        continue
                    sid = len(sizes)
                    sizes.append(round_up(slot, granularity))
                    owner.append(e)
                    allocated_at.append(p)
                else:
                    # No storage behind an alias of a placeholder that shares another
                    # placeholder's storage: inputs are held for the whole step anyway.
                    aliased = slot_storage.get((args[e][slot[0]], slot[1]))
                    if aliased is None:
                        continue
                    sid = aliased
                slot_storage[(e, s)] = sid
                held.append(sid)
            if held:
                storages[e] = tuple(dict.fromkeys(held))

        # Values die after their last use, or right after they run when unused; graph
        # inputs are held by the caller and outputs are returned.
        last_use: dict[int, int] = {}
        for p, e in enumerate(order):
            for x in args[e]:
                last_use[x] = p
        forever = set(args[self.output])
        forever.update(e for e in order if e < n and phase[e] == "input")
        dying: dict[int, list[int]] = defaultdict(list)
        for p, e in enumerate(order):
            if e not in forever:
                dying[last_use.get(e, p)].append(e)

        steps = len(order)
        refs = [0] * len(sizes)
        freed_at = [steps] * len(sizes)  # live through step `freed_at`, gone after it
        for p, e in enumerate(order):
            for sid in storages.get(e, ()):
                refs[sid] += 1
            for x in dying.get(p, ()):
                for sid in storages.get(x, ()):
                    refs[sid] -= 1
                    if refs[sid] == 0:
                        freed_at[sid] = p

        category = self._categories(args, storages, owner, order)
        deltas = np.zeros((len(CATEGORIES), steps + 2), dtype=np.int64)
        cats, size_array = np.asarray(category), np.asarray(sizes, dtype=np.int64)
        np.add.at(deltas, (cats, np.asarray(allocated_at)), size_array)
        np.add.at(deltas, (cats, np.asarray(freed_at) + 1), -size_array)
        live = np.cumsum(deltas[:, :steps], axis=1)
        total = live.sum(axis=0)
        peak_p = int(np.argmax(total))
        return self._report(
            order, int(total[peak_p]), peak_p, live, sizes, owner, category, allocated_at, freed_at
        )

    def _categories(
        self,
        args: dict[int, tuple[int, ...]],
        storages: dict[int, tuple[int, ...]],
        owner: list[int],
        order: list[int],
    ) -> list[int]:
        n, phase = self.n, self.phase
        outputs = {sid for x in args[self.output] for sid in storages.get(x, ())}
        saved = self._saved_storages(order, args, storages)
        result = []
        for sid, e in enumerate(owner):
            if e < n and phase[e] == "input":
                name = self.placeholder_category[e]
            elif sid in outputs:
                name = "gradients"
            elif sid in saved:
                name = "activations"
            else:
                name = "temporaries"
            result.append(CATEGORIES.index(name))
        return result

    def _saved_storages(
        self,
        order: list[int],
        args: dict[int, tuple[int, ...]],
        storages: dict[int, tuple[int, ...]],
    ) -> set[int]:
        """Storages of forward/loss nodes that a backward node (or a recomputed copy) reads."""
        n, phase = self.n, self.phase
        forward = ("forward", "loss")
        saved: set[int] = set()
        for e in order:
            if e >= n or phase[e] == "backward":
                for x in args[e]:
                    if x < n and phase[x] in forward:
                        saved.update(storages.get(x, ()))
        return saved

    def _name(self, e: int) -> str:
        return self.names[e] if e < self.n else self.names[e - self.n] + RECOMPUTED_SUFFIX

    def _report(
        self,
        order: list[int],
        peak: int,
        peak_p: int,
        live: np.ndarray,
        sizes: list[int],
        owner: list[int],
        category: list[int],
        allocated_at: list[int],
        freed_at: list[int],
    ) -> Estimate:
        n = self.n
        activations = CATEGORIES.index("activations")
        saved = [sid for sid, c in enumerate(category) if c == activations]
        by_layer: dict[str, int] = defaultdict(int)
        for sid in saved:
            layer = self.layer[owner[sid] % n]
            by_layer["-" if layer is None else str(layer)] += sizes[sid]
        rows = []
        for sid in saved:
            if allocated_at[sid] <= peak_p <= freed_at[sid]:
                i = owner[sid] % n
                rows.append(
                    {
                        "node": self.names[i],
                        "layer": self.layer[i],
                        "module": self.module[i],
                        "op": self.op[i],
                        "bytes": sizes[sid],
                    }
                )
        rows.sort(key=lambda r: (-r["bytes"], r["node"]))
        copies = [e - n for e in order if e >= n]
        return Estimate(
            peak_bytes=peak,
            peak_node=self._name(order[peak_p]),
            peak_index=peak_p,
            peak_breakdown={c: int(live[k, peak_p]) for k, c in enumerate(CATEGORIES)},
            saved_activation_bytes=sum(sizes[sid] for sid in saved),
            saved_by_layer=dict(by_layer),
            saved_at_peak=rows,
            recompute_flops=sum(self.flops[i] for i in copies),
            recomputed_nodes=[self.names[i] for i in copies],
            step_seconds={
                name: sum(sec[e % n] for e in order) for name, sec in self.seconds.items()
            },
            recompute_seconds={
                name: sum(sec[i] for i in copies) for name, sec in self.seconds.items()
            },
            tokens=self.graph.tokens,
            order=[self._name(e) for e in order],
            timeline={c: live[k].tolist() for k, c in enumerate(CATEGORIES)},
        )


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
    order, args = estimator.schedule_of(gm)
    return estimator.simulate(order, args, granularity)
