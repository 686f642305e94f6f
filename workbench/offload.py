"""CPU offload of saved activations: the host-copy ops, where each copy goes, and the pass.

Entry points: `place_offloads(...)` and `interleave(...)` (the one placement rule: where the
device->host copy, the free, the reload and its wait go in a node order, for the pass, and
as `place_offloads_arrays` / `interleave_arrays` for the estimate) and `offload_pass(gm,
names, layer_of, options) -> gm`. On the CPU the host is `workbench::offload` / `reload` /
`wait_tensor` (own buffers, `host_usage()` counts them), elsewhere torch's `ao::` ops.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import torch.fx as fx

from workbench.errors import WorkbenchError
from workbench.rules import OffloadOptions, mutates, reads_until_wait, storage_keys

__all__ = [
    "NO_LAYER",
    "OFFLOAD_META",
    "REPLAYED_VIEW",
    "STEP_KINDS",
    "HostUsage",
    "OffloadPlan",
    "Offloaded",
    "Ops",
    "Place",
    "Step",
    "host_buffer_pool",
    "host_usage",
    "interleave",
    "interleave_arrays",
    "is_offload_node",
    "offload_pass",
    "ops_for",
    "place_offloads",
    "place_offloads_arrays",
]

# gm.meta key holding the `OffloadPlan` of a graph the pass rewrote; node.meta key marking a
# forward view the pass replayed on a reloaded tensor (its other meta is the original's).
OFFLOAD_META = "workbench_offload"
REPLAYED_VIEW = "workbench_offload_replayed_view"


# --- the host "device" on the CPU: its own buffers, its own ops --------------------------


@dataclass
class HostUsage:
    """Host bytes the workbench's offload ops hold while `host_usage()` is active."""

    live_bytes: int = 0
    peak_bytes: int = 0
    copies: int = 0


_USAGE: list[HostUsage] = []


@contextlib.contextmanager
def host_usage() -> Iterator[HostUsage]:
    """Count the host buffers `workbench::offload` allocates and `workbench::wait_tensor`
    frees while the block runs (the CPU stand-in for pinned host memory)."""
    usage = HostUsage()
    _USAGE.append(usage)
    try:
        yield usage
    finally:
        _USAGE.remove(usage)


# Host buffers `workbench::offload` made and no wait has freed yet: data pointer -> bytes.
_HOST_BUFFERS: dict[int, int] = {}


def _account(pointer: int, nbytes: int) -> None:
    """Record a host buffer made (nbytes > 0) or freed (nbytes < 0)."""
    if nbytes > 0:
        _HOST_BUFFERS[pointer] = nbytes
    else:
        _HOST_BUFFERS.pop(pointer, None)
    for usage in _USAGE:
        usage.live_bytes += nbytes
        usage.peak_bytes = max(usage.peak_bytes, usage.live_bytes)
        usage.copies += nbytes > 0


@torch.library.custom_op("workbench::offload", mutates_args=())
def _offload(tensor: torch.Tensor) -> torch.Tensor:
    """Copy to a fresh host buffer (its own storage); the device original is freed by the
    `wait_tensor` that takes it as `keepalive`."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    host.copy_(tensor)
    _account(host.untyped_storage().data_ptr(), host.untyped_storage().nbytes())
    return host


@_offload.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


@torch.library.custom_op("workbench::reload", mutates_args=())
def _reload(
    tensor: torch.Tensor, device: torch.device, size: list[int], stride: list[int]
) -> torch.Tensor:
    """Copy a host buffer back to `device` with the original's layout."""
    result = torch.empty_strided(size, stride, dtype=tensor.dtype, device=device)
    result.copy_(tensor)
    return result


@_reload.register_fake
def _(tensor: torch.Tensor, device: torch.device, size: list[int], stride: list[int]) -> Any:
    return torch.empty_strided(size, stride, dtype=tensor.dtype, device=device)


# `wait_tensor` returns its input (an alias, which custom_op forbids): defined by schema,
# as torch's `ao::wait_tensor`, whose arguments it takes.
_LIB = torch.library.Library("workbench", "FRAGMENT")
_LIB.define(
    "wait_tensor(Tensor(a) tensor, Tensor? keepalive=None, Tensor? last_use_of_storage=None) "
    "-> Tensor(a)"
)


def _wait_tensor(
    tensor: torch.Tensor,
    keepalive: torch.Tensor | None = None,
    last_use_of_storage: torch.Tensor | None = None,
) -> torch.Tensor:
    """The copy into `tensor` is complete (CPU copies are synchronous): free the storage of
    its source `keepalive`, the device original after an offload, the host buffer after a
    reload."""
    if keepalive is not None:
        storage = keepalive.untyped_storage()
        if storage.data_ptr() in _HOST_BUFFERS:
            _account(storage.data_ptr(), -storage.nbytes())
        if storage.nbytes() > 0:
            storage.resize_(0)
    return tensor


_LIB.impl("wait_tensor", _wait_tensor, "CompositeExplicitAutograd")


@torch.library.register_fake("workbench::wait_tensor")
def _(tensor: Any, keepalive: Any = None, last_use_of_storage: Any = None) -> Any:
    return tensor


fx.node.has_side_effect(torch.ops.workbench.wait_tensor.default)


class Ops(NamedTuple):
    """The three ops of one device kind: copy out, copy back, wait (and free the source)."""

    offload: Any
    reload: Any
    wait: Any


def ops_for(device: torch.device) -> Ops:
    """The workbench's ops on the CPU; torch's `ao` ops (streams, pinned memory) on an
    accelerator."""
    if device.type in ("cpu", "meta"):
        w = torch.ops.workbench
        return Ops(w.offload.default, w.reload.default, w.wait_tensor.default)
    importlib.import_module("torch._functorch._activation_offloading.offload_ops")  # ao::

    return Ops(torch.ops.ao.offload.default, torch.ops.ao.reload.default,
               torch.ops.ao.wait_tensor.default)  # fmt: skip


def host_buffer_pool(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Where a step runs repeatedly: on an accelerator, torch's pool of pinned host buffers
    (without it every `ao::offload` pins a fresh buffer, a few ms each, and the first steps
    would time the allocator; graph trainer keeps it open for the whole run). Nothing on
    the CPU, whose ops allocate plain buffers."""
    if device.type in ("cpu", "meta"):
        return contextlib.nullcontext()
    ao = importlib.import_module("torch._functorch._activation_offloading.offload_ops")
    return ao.pinned_memory_pool()  # type: ignore[no-any-return]


def is_offload_node(node: fx.Node) -> bool:
    """A node the offload pass inserted (copy, reload or wait, on either op set)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        (target.namespace == "workbench" and target._opname in ("offload", "reload", "wait_tensor"))
        or target.namespace == "ao"
    )


# --- placement: the one rule -----------------------------------------------------------


class Offloaded(NamedTuple):
    """One offloaded storage in a node order: where it is made, last read in forward (the
    producer itself when nothing else reads it there) and first read in backward."""

    producer: int
    last_forward_use: int
    first_backward_use: int


class Place(NamedTuple):
    """Where its four steps go: the copy right after `copy_after`, the wait that frees the
    device original right after `free_after`, the reload right before `reload_before`, the
    wait for it right before `wait_before` (its first backward reader)."""

    copy_after: int
    free_after: int
    reload_before: int
    wait_before: int


NO_LAYER = -1  # `place_offloads_arrays`' layer id of nodes outside the layers


def place_offloads(
    backward: Sequence[bool],
    layer: Sequence[int | None],
    values: Sequence[Offloaded],
    options: OffloadOptions,
) -> list[Place]:
    """Where each value's copy, free, reload and wait go in a node order (positions into
    `backward` and `layer`, one entry per node that runs; layer ids are `rules.layer_of`'s,
    never negative, None outside the layers).

    Forward is every position before the first backward one, cut into regions: maximal runs
    of one layer id (nodes outside the layers between them form their own). With
    `defer_layers` M = 0 the device original is freed right after its last forward reader;
    with M > 0 at the end of the region M regions after the producer's (never before the
    last reader, at the latest at the end of forward). Backward layers are ordered by their
    first backward node; the reload goes before the first backward node of the layer
    `prefetch_layers` N before the producer's layer in that order (the first backward node
    when there is none that early), never after the first reader, and right before it when
    N = 0 or the producer is outside the layers. Counting from the producer's layer is
    graph trainer's rule (`apply_cpu_offload_pass`), so an exported policy runs where the
    estimate puts it (`workbench.titan.offload_passes` checks)."""
    ids = np.fromiter((NO_LAYER if x is None else x for x in layer), np.int64, len(layer))
    return place_offloads_arrays(np.asarray(backward, bool), ids, values, options)


def place_offloads_arrays(
    backward: np.ndarray, layer: np.ndarray, values: Sequence[Offloaded], options: OffloadOptions
) -> list[Place]:
    """`place_offloads` on arrays (the estimate's form): `layer` holds `NO_LAYER` where the
    list form holds None."""
    end = int(np.argmax(backward)) if backward.any() else len(backward)
    producer, last_use, q = np.array(values, np.int64).reshape(len(values), 3).T
    wrong = np.flatnonzero((producer >= end) | (q < end))
    if len(wrong):
        k = wrong[0]
        raise WorkbenchError(
            f"offloaded value at {producer[k]} must be made in forward (before {end}) and "
            f"read in backward, not first at {q[k]}"
        )
    free = np.maximum(producer, last_use)
    if options.defer_layers:
        # forward regions start where the layer id changes; each ends before the next
        starts = np.flatnonzero(np.diff(layer[:end])) + 1
        region_end = np.append(starts - 1, end - 1)
        region = np.searchsorted(starts, producer, side="right")
        target = np.minimum(region + options.defer_layers, len(region_end) - 1)
        free = np.maximum(free, region_end[target])
    reload = q
    ids, first, rank = _backward_layers(backward, layer, end)
    if options.prefetch_layers and len(ids):
        lid = layer[producer]
        k = np.minimum(np.searchsorted(ids, lid), len(ids) - 1)
        earlier = rank[k] - options.prefetch_layers
        start = np.where(earlier >= 0, first[np.maximum(earlier, 0)], end)
        reload = np.where(ids[k] == lid, np.minimum(q, start), q)
    rows = zip(producer.tolist(), free.tolist(), reload.tolist(), q.tolist(), strict=True)
    return [Place(*row) for row in rows]


def _backward_layers(
    backward: np.ndarray, layer: np.ndarray, end: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layers backward runs (ids sorted), their first backward nodes in the order
    backward reaches them, and each id's rank in that order."""
    ran = np.flatnonzero(backward[end:] & (layer[end:] != NO_LAYER)) + end
    ids, first = np.unique(layer[ran], return_index=True)
    by_first = np.argsort(first)
    rank = np.empty(len(ids), np.int64)
    rank[by_first] = np.arange(len(ids))
    return ids, ran[first][by_first], rank


StepKind = Literal["node", "offload", "free", "reload", "wait"]
STEP_KINDS: tuple[StepKind, ...] = ("node", "offload", "free", "reload", "wait")


class Step(NamedTuple):
    """One step of the offloaded order: `("node", position)` runs the node at that position
    of the input order; the others run that step of value `k` (index into `values`)."""

    kind: StepKind
    at: int


def interleave(length: int, places: Sequence[Place]) -> list[Step]:
    """The node order with the offload steps in it, as the pass builds the graph: after a
    node, the copies of values it produced, then the frees placed after it; before a node,
    the reloads placed before it, in the order backward first reads them (the transfer
    stream runs them in that order; graph trainer queues them so too), then the waits;
    otherwise in value order."""
    kinds, at = interleave_arrays(length, places)
    return [Step(STEP_KINDS[k], a) for k, a in zip(kinds.tolist(), at.tolist(), strict=True)]


def interleave_arrays(length: int, places: Sequence[Place]) -> tuple[np.ndarray, np.ndarray]:
    """`interleave` as two arrays (the estimate's form): each step's kind, an index into
    `STEP_KINDS`, and its position or value index. Sorted by (node position, group, first
    backward reader for reloads, value), the groups being reloads, waits, the node, copies,
    frees."""
    values = len(places)
    table = np.array(places, np.int64).reshape(values, 4)
    k = np.arange(values)
    span = length + 1  # room for the first-reader position of reloads

    def key(position: Any, group: int, reader: Any = 0, value: Any = 0) -> Any:
        return ((position * 5 + group) * span + reader) * (values + 1) + value

    keys = [key(np.arange(length), 2)]
    # offload, free, reload and wait, each after or before its anchor column
    keys += [key(table[:, 0], 3, 0, k), key(table[:, 1], 4, 0, k)]
    keys += [key(table[:, 2], 0, table[:, 3], k), key(table[:, 3], 1, 0, k)]
    kinds = np.repeat(np.arange(5), [length] + [values] * 4)
    at = np.concatenate((np.arange(length), np.tile(k, 4)))
    order = np.argsort(np.concatenate(keys), kind="stable")
    return kinds[order], at[order]


# --- the pass ---------------------------------------------------------------------------


@dataclass
class OffloadPlan:
    """What `offload_pass` did to a graph: the values offloaded (node names, in the order of
    `values`), where each went, the bytes, and the requests it skipped with the reason."""

    names: list[str]
    values: list[Offloaded]
    places: list[Place]
    bytes: dict[str, int]
    options: OffloadOptions
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.bytes.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "offloaded": len(self.names),
            "offloaded_bytes": self.offloaded_bytes,
            "options": self.options._asdict(),
            "skipped": self.skipped,
        }


class _Value(NamedTuple):
    node: fx.Node
    aliases: list[fx.Node]  # forward nodes sharing its storage, graph order
    readers: list[fx.Node]  # backward nodes reading it or an alias


def _examine(
    node: fx.Node, position: dict[fx.Node, int], end: int
) -> tuple[_Value | None, str | None]:
    """The storage facts the pass needs of `node`, or why it cannot be offloaded safely."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None, "returns no single tensor"
    (key,) = storage_keys(node)
    if any(key in storage_keys(x) for x in node.all_input_nodes):
        return None, "shares its storage with an input: freeing it would free that too"
    aliases: list[fx.Node] = []
    readers: list[fx.Node] = []
    todo, seen = [node], {node}
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                return None, "is returned by the step"
            if position[user] >= end:
                readers.append(user)
            elif user not in seen and key in storage_keys(user):
                if mutates(user.target):
                    return None, f"has its storage written in place by {user.name}"
                seen.add(user)
                aliases.append(user)
                todo.append(user)
    if not readers:
        return None, "is not read in backward after remat"
    aliases.sort(key=position.__getitem__)
    return _Value(node, aliases, readers), None


def _last_forward_use(value: _Value, position: dict[fx.Node, int], end: int) -> int:
    """Where forward last reads the value's storage: its last forward user, or the wait of
    an asynchronous collective reading it (`rules.reads_until_wait`), whichever is later."""
    last = position[value.node]
    for alias in [value.node, *value.aliases]:
        for user in alias.users:
            if position[user] < end:
                last = max(last, position[user])
                if reads_until_wait(user.target):
                    last = max([last, *(position[w] for w in user.users if position[w] < end)])
    return last


def offload_pass(
    gm: fx.GraphModule,
    names: Iterable[str],
    layer_of: Callable[[fx.Node], int | None],
    options: OffloadOptions | None = None,
) -> fx.GraphModule:
    """Offload the storages of the forward nodes `names` of a rematerialized joint graph.
    The names come from the decisions, not from `meta["recompute"]`: torch's remat pass
    rewrites the tag of every node with a recomputed user to MUST_SAVE, offload tags too.

    Reads `meta["autograd_backward"]` (forward is every node before the first backward
    one), `meta["val"]` (storages; views share their base's) and `layer_of(node)`. For
    each value it inserts, where `place_offloads`/`interleave` say: `offload(x)` after the
    producer, `wait_tensor(host, keepalive=x, last_use_of_storage=...)` (frees the device
    storage), `reload(host, device, size, stride)` and `wait_tensor(reloaded,
    keepalive=host)` before the first backward reader; backward readers then read the
    reloaded tensor, and forward views they read are replayed on it after the wait. On the
    CPU the ops are `workbench::*` (the host is a separate buffer per copy), elsewhere
    torch's `ao::*`. Requests it cannot honour safely (an alias of an input, written in
    place, returned, not read in backward) are skipped. Writes the `OffloadPlan` to
    `gm.meta[OFFLOAD_META]` and returns `gm`, rewritten in place."""
    options = options or OffloadOptions()
    nodes = list(gm.graph.nodes)
    position = {node: p for p, node in enumerate(nodes)}
    backward = [bool(n.meta.get("autograd_backward", False)) for n in nodes]
    end = next((p for p, b in enumerate(backward) if b), len(nodes))
    by_name = {n.name: n for n in nodes}
    wanted: list[_Value] = []
    skipped: dict[str, str] = {}
    for name in names:
        node = by_name.get(name)
        if node is None or position[node] >= end or node.op != "call_function":
            skipped[name] = "is not a forward node of this graph"
            continue
        found, reason = _examine(node, position, end)
        if found is None:
            skipped[name] = str(reason)
        else:
            wanted.append(found)
    wanted.sort(key=lambda v: position[v.node])
    values = [
        Offloaded(
            position[v.node],
            _last_forward_use(v, position, end),
            min(position[r] for r in v.readers),
        )
        for v in wanted
    ]
    layers = [layer_of(n) for n in nodes]
    places = place_offloads(backward, layers, values, options)
    _insert(gm, nodes, wanted, places)
    plan = OffloadPlan(
        names=[v.node.name for v in wanted],
        values=values,
        places=places,
        bytes={v.node.name: int(v.node.meta["val"].untyped_storage().nbytes()) for v in wanted},
        options=options,
        skipped=skipped,
    )
    gm.graph.lint()
    gm.recompile()
    gm.meta[OFFLOAD_META] = plan
    return gm


def _insert(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    wanted: list[_Value],
    places: list[Place],
) -> None:
    """Materialize `interleave`'s order: each new node goes right after the previous step."""
    graph = gm.graph
    copies: dict[int, fx.Node] = {}
    host: dict[int, fx.Node] = {}
    reloads: dict[int, fx.Node] = {}
    previous = nodes[0]

    def add(target: Any, args: tuple[Any, ...], k: int, val: Any, backward: bool) -> fx.Node:
        nonlocal previous
        with graph.inserting_after(previous):
            new = graph.call_function(target, args)
        source = wanted[k].node.meta
        new.meta.update({key: source[key] for key in ("custom", "seq_nr") if key in source})
        new.meta["val"] = val
        if backward:
            new.meta["autograd_backward"] = True
        previous = new
        return new

    for kind, k in interleave(len(nodes), places):
        if kind == "node":
            previous = nodes[k]
            continue
        node = wanted[k].node
        val = node.meta["val"]
        ops = ops_for(val.device)
        if kind == "offload":
            copies[k] = add(ops.offload, (node,), k, val.new_empty(val.shape, device="cpu"), False)
        elif kind == "free":
            host[k] = add(ops.wait, (copies[k], node), k, copies[k].meta["val"], False)
        elif kind == "reload":
            size, stride = list(val.shape), list(val.stride())
            fresh = val.new_empty_strided(size, stride)
            reloads[k] = add(ops.reload, (host[k], val.device, size, stride), k, fresh, True)
        else:
            waited = add(ops.wait, (reloads[k], host[k]), k, reloads[k].meta["val"], True)
            replayed = {node: waited}
            for alias in _needed_aliases(wanted[k]):  # views backward reads, on the reload
                args, kwargs = _remap(alias, replayed)
                new = add(alias.target, args, k, _run(alias.target, args, kwargs), True)
                new.kwargs = kwargs
                new.meta.update({key: v for key, v in alias.meta.items() if key not in new.meta})
                new.meta.pop("recompute", None)
                new.meta[REPLAYED_VIEW] = True
                replayed[alias] = new
            for reader in wanted[k].readers:
                for old, new in replayed.items():
                    reader.replace_input_with(old, new)


def _remap(node: fx.Node, replayed: dict[fx.Node, fx.Node]) -> Any:
    return fx.node.map_arg((node.args, node.kwargs), lambda n: replayed.get(n, n))


def _needed_aliases(value: _Value) -> list[fx.Node]:
    """The forward aliases backward reads, with the aliases they are made from, in order."""
    needed: set[fx.Node] = set()
    todo = [a for a in value.aliases if any(r in a.users for r in value.readers)]
    aliases = set(value.aliases)
    while todo:
        alias = todo.pop()
        if alias not in needed:
            needed.add(alias)
            todo.extend(x for x in alias.all_input_nodes if x in aliases)
    return [a for a in value.aliases if a in needed]


def _run(target: Any, args: Any, kwargs: Any) -> Any:
    """The output value of a replayed view, from its inputs' recorded values."""
    values, kw = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    return target(*values, **kw)
