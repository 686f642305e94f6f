"""The CPU offload pass: offloaded activations copied to the host after their producer,
freed, reloaded before backward reads them, where the placement rule says.

Entry point: `offload_pass(gm, names, layer_of, options) -> gm` (its `OffloadReport` in
`gm.meta[OFFLOAD_META]`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from workbench.capture.ops import reads_until_wait, storage_inputs, storage_keys
from workbench.decide.facts import fx_storage_view, needed_aliases
from workbench.decide.offloadable import OffloadOptions, OffloadView, examine_offload
from workbench.decide.tags import Refused
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
class OffloadReport:
    """What `offload_pass` did to a graph: the values offloaded (node names, in the order of
    `values`), where each went, the bytes, and the requests it skipped with why."""

    names: list[str]
    values: list[Offloaded]
    places: list[Place]
    bytes: dict[str, int]
    options: OffloadOptions
    skipped: dict[str, Refused] = field(default_factory=dict)

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.bytes.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "offloaded": len(self.names),
            "offloaded_bytes": self.offloaded_bytes,
            "options": self.options._asdict(),
            "skipped": {name: why.words for name, why in self.skipped.items()},
        }


class _Value(NamedTuple):
    node: fx.Node
    aliases: list[fx.Node]  # forward nodes sharing its storage, graph order
    readers: list[fx.Node]  # backward nodes reading it or an alias
    read_aliases: list[fx.Node]  # the aliases backward reads
    last_use: int  # the position where forward last reads its storage


def _examine(node: fx.Node | None, position: dict[fx.Node, int], end: int) -> Refused | _Value:
    """What the pass needs of `node` of the rematerialized graph (`examine_offload` on FX
    nodes: forward is every node before the first backward one, `end`), or why it cannot
    offload it safely."""
    view = OffloadView(
        forward_op=lambda n: n is not None and position[n] < end and n.op == "call_function",
        one_tensor=lambda n: isinstance(n.meta.get("val"), torch.Tensor),
        fresh=lambda n: not any(storage_keys(n) & storage_keys(x) for x in storage_inputs(n)),
        name=lambda n: n.name,
        storage=fx_storage_view(node, lambda n: position[n] >= end),
    )
    found = examine_offload(node, view)
    if isinstance(found, Refused):
        return found
    assert node is not None
    aliases = sorted(found.aliases, key=position.__getitem__)
    return _Value(
        node,
        aliases,
        found.readers,
        found.read_aliases,
        _last_forward_use(node, found.forward, position, end),
    )


def _last_forward_use(
    node: fx.Node, forward: list[fx.Node], position: dict[fx.Node, int], end: int
) -> int:
    """Where forward last reads the value's storage: its last forward reader (`forward`, of
    the value or an alias), or the wait of an asynchronous collective reading it
    (`capture.ops.reads_until_wait`), whichever is later."""
    last = position[node]
    for user in forward:
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
    written in place, returned, not read in backward: `examine_offload`) are skipped, with
    why (`Refused`). Writes the `OffloadReport` to `gm.meta[OFFLOAD_META]` and returns `gm`,
    rewritten in place."""
    options = options or OffloadOptions()
    nodes = list(gm.graph.nodes)
    position = {node: p for p, node in enumerate(nodes)}
    backward = [bool(n.meta.get("autograd_backward", False)) for n in nodes]
    end = next((p for p, b in enumerate(backward) if b), len(nodes))
    by_name = {n.name: n for n in nodes}
    wanted: list[_Value] = []
    skipped: dict[str, Refused] = {}
    for name in names:
        found = _examine(by_name.get(name), position, end)
        if isinstance(found, Refused):
            skipped[name] = found
        else:
            wanted.append(found)
    wanted.sort(key=lambda v: position[v.node])
    values = [
        Offloaded(position[v.node], v.last_use, min(position[r] for r in v.readers)) for v in wanted
    ]
    layers = [layer_of(n) for n in nodes]
    places = place_offloads(backward, layers, values, options)
    _insert(gm, nodes, wanted, places)
    report = OffloadReport(
        names=[v.node.name for v in wanted],
        values=values,
        places=places,
        bytes={v.node.name: int(v.node.meta["val"].untyped_storage().nbytes()) for v in wanted},
        options=options,
        skipped=skipped,
    )
    gm.graph.lint()
    gm.recompile()
    gm.meta[OFFLOAD_META] = report
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
            value = wanted[k]  # the views backward reads, replayed on the reload
            for alias in needed_aliases(value.aliases, value.read_aliases, _inputs):
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


def _inputs(node: fx.Node) -> list[fx.Node]:
    return node.all_input_nodes


def _run(target: Any, args: Any, kwargs: Any) -> Any:
    """The output value of a replayed view, from its inputs' recorded values."""
    values, kw = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    return target(*values, **kw)
