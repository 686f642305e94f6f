"""The CPU offload pass: offloaded activations copied to the host after their producer,
freed, reloaded before backward reads them, where the placement rule says.

Entry point: `offload_pass(gm, names, layer_of, options) -> gm` (its `OffloadPlan` in
`gm.meta[OFFLOAD_META]`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from workbench.capture.ops import mutates, reads_until_wait, storage_inputs, storage_keys
from workbench.decide.offloadable import OffloadOptions, Refusal
from workbench.rewrite.host_ops import ops_for
from workbench.rewrite.placement import (
    OFFLOAD_META,
    REPLAYED_VIEW,
    Offloaded,
    Place,
    interleave,
    place_offloads,
)


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
    """The storage facts the pass needs of `node`, or why it cannot be offloaded safely (a
    sentence of `Refusal`, the rules' vocabulary)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None, Refusal.NOT_ONE_TENSOR.say()
    (key,) = storage_keys(node)
    if any(key in storage_keys(x) for x in storage_inputs(node)):
        return None, Refusal.ALIAS.say()
    aliases: list[fx.Node] = []
    readers: list[fx.Node] = []
    todo, seen = [node], {node}
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                return None, Refusal.RETURNED.say()
            if position[user] >= end:
                readers.append(user)
            elif user not in seen and key in storage_keys(user):
                if mutates(user.target):
                    return None, Refusal.WRITTEN_BY.say(user.name)
                seen.add(user)
                aliases.append(user)
                todo.append(user)
    if not readers:
        return None, Refusal.NOT_READ.say()
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
    torch's `ao::*`. Requests it cannot honour safely (an alias of another node's storage,
    written in place, returned, not read in backward) are skipped, saying why in the words
    of the rules (`Refusal`). Writes the `OffloadPlan` to `gm.meta[OFFLOAD_META]` and
    returns `gm`, rewritten in place."""
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
            skipped[name] = Refusal.NOT_FORWARD.say()
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
