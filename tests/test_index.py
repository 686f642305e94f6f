"""The index form's array walks against plain entry-by-entry walks of the same node orders:
storages and aliases, saved and returned storages, on both reference models and a per-rank
graph, for node orders of several presets."""

from __future__ import annotations

import numpy as np
import pytest

from workbench.capture.graph import JointGraph
from workbench.cost.replay import recompute_flags, replay
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.rewrite.entries import OFFLOAD_STEPS, Flat, NodeOrder
from workbench.rewrite.index import GraphIndex, graph_index

PRESETS = ["none", "default", "eager", "full"]


@pytest.fixture(scope="module")
def graphs(small_graphs_and_rank: dict[str, JointGraph]) -> dict[str, JointGraph]:
    return small_graphs_and_rank


def _orders(graph: JointGraph) -> list[NodeOrder]:
    index = graph_index(graph)
    flags = [recompute_flags(index, decide(graph, Policy(p))) for p in PRESETS]
    return [index.identity(), *(_order(replay(index, f)) for f in flags)]


def _order(flat: Flat) -> NodeOrder:
    sequence = flat.entries.tolist()
    args: dict[int, list[int]] = {e: [] for e in sequence}
    for position, x in zip(flat.reader.tolist(), flat.read.tolist(), strict=True):
        args[sequence[position]].append(x)
    return sequence, {e: tuple(xs) for e, xs in args.items()}


def _walk(index: GraphIndex, order: NodeOrder) -> tuple[list[set[int]], list[int], list[int]]:
    """Storages one entry at a time: fresh slots get the next id, aliases take their
    input's. Per position: the ids it holds; per storage: owner and bytes."""
    sequence, args = order
    storage_of: dict[tuple[int, int], int] = {}
    held: list[set[int]] = []
    owner: list[int] = []
    sizes: list[int] = []
    for e in sequence:
        here = set()
        for s, slot in enumerate(index.slots[e % index.n]):
            if isinstance(slot, tuple):
                sid = storage_of.get((args[e][slot[0]], slot[1]))
            elif slot:
                sid = len(owner)
                owner.append(e)
                sizes.append(slot)
            else:
                sid = None
            if sid is not None:
                storage_of[(e, s)] = sid
                here.add(sid)
        held.append(here)
    return held, owner, sizes


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug", "llama3-debug-fsdp2-tp2"])
def test_storages_equal_an_entry_by_entry_walk(graphs: dict[str, JointGraph], model: str) -> None:
    graph = graphs[model]
    index = graph_index(graph)
    for order in _orders(graph):
        flat = index.flat(order)
        table = index.storages(flat)
        held, owner, sizes = _walk(index, order)
        got: list[set[int]] = [set() for _ in order[0]]
        for position, sid in zip(table.holder.tolist(), table.held.tolist(), strict=True):
            got[position].add(sid)
        assert got == held
        assert table.owner.tolist() == owner
        assert table.sizes.tolist() == sizes
        assert [order[0][p] for p in table.born.tolist()] == owner


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug", "llama3-debug-fsdp2-tp2"])
def test_saved_and_returned_storages_follow_their_definition(
    graphs: dict[str, JointGraph], model: str
) -> None:
    graph = graphs[model]
    index = graph_index(graph)
    n = index.n
    for order in _orders(graph):
        sequence, args = order
        flat = index.flat(order)
        table = index.storages(flat)
        held, owner, _ = _walk(index, order)
        held_by = dict(zip(sequence, held, strict=True))
        returned = set().union(*(held_by[x] for x in args[index.output]))
        read = {
            x
            for e in sequence
            if e >= n or index.phase[e] == "backward"
            for x in args[e]
            if x < n and index.phase[x] in ("forward", "loss")
        }
        saved = {
            sid
            for x in read
            for sid in held_by[x]
            if sid not in returned
            and index.phase[owner[sid] % n] != "input"
            and owner[sid] % n not in index.gathered
        }
        assert index.read_directly(flat) == {index.names[x] for x in read}
        assert set(index.returned_mask(flat, table).nonzero()[0].tolist()) == returned
        assert set(index.saved_mask(flat, table).nonzero()[0].tolist()) == saved


def test_offload_entries_name_their_node_and_step(graphs: dict[str, JointGraph]) -> None:
    """Every offload step of every node has an entry of its own past the originals, copies
    and replayed views, and that entry gives back its node and step."""
    index = graph_index(graphs["llama3-debug"])
    n = index.n
    nodes = np.repeat(np.arange(n), len(OFFLOAD_STEPS))
    steps = np.tile(np.arange(len(OFFLOAD_STEPS)), n)
    space = index.space
    entries = space.offload(nodes, steps)
    assert entries.min() == 3 * n and len(set(entries.tolist())) == len(entries)
    assert (space.step(entries) == steps).all()
    assert (space.node(entries) == nodes).all()
    assert space.offload(5, 3) == 3 * n + 23 and space.step(3 * n + 23) == 3


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug", "llama3-debug-fsdp2-tp2"])
def test_activation_storages_are_the_traced_graphs_saved_bytes(
    graphs: dict[str, JointGraph], model: str
) -> None:
    """What a model of the pass reads per node gives back `saved_by_node` of the graph as
    traced: the storages of the forward nodes backward reads, by their owners."""
    index = graph_index(graphs[model])
    forward = [
        name
        for name, phase in zip(index.names, index.phase, strict=True)
        if phase in ("forward", "loss")
    ]
    held = {
        s
        for name in forward
        if index.read_in_backward(name)
        for s in index.activation_storages(name)
    }
    by_owner: dict[str, int] = {}
    for s in held:
        by_owner[index.storage_owner(s)] = by_owner.get(index.storage_owner(s), 0)
        by_owner[index.storage_owner(s)] += index.storage_bytes(s)
    assert by_owner == index.saved_by_node(index.identity())
    inputs = [
        name for name, phase in zip(index.names, index.phase, strict=True) if phase == "input"
    ]
    assert inputs and all(index.activation_storages(n) == () for n in inputs)


def test_live_backward_readers_leave_out_what_dead_code_elimination_drops(
    graphs: dict[str, JointGraph],
) -> None:
    """A backward node nothing reads (autograd's leftover detach on the loss-parallel graph)
    reads its input, but not as torch's remat pass leaves the graph."""
    index = graph_index(graphs["llama3-debug-fsdp2-tp2"])
    dropped = [
        n
        for n in index.names
        if index.read_in_backward(n) and not index.read_in_backward(n, live=True)
    ]
    assert dropped and all(index.op[index.index_of[n]] == "aten.detach.default" for n in dropped)
    for name in dropped:
        (reader,) = (u for u in index.users[index.index_of[name]] if index.is_bwd[u])
        assert not index.users[reader]  # read by nothing, not even the output


def test_a_wait_is_its_collectives_storage(graphs: dict[str, JointGraph]) -> None:
    """`wait_tensor` returns the very tensor its collective made (checked on the fake process
    group: its fake kernel returns a new one), so the index holds one storage for both:
    each wait's slot aliases its collective's output and never allocates."""
    import torch
    import torch.distributed as dist

    from workbench.capture.ops import WAIT
    from workbench.capture.parallel import fake_world

    with fake_world(2):
        made = torch.ops._c10d_functional.all_gather_into_tensor(
            torch.ones(4), 2, dist.group.WORLD.group_name
        )
        waited = torch.ops._c10d_functional.wait_tensor(made)
        assert waited.untyped_storage().data_ptr() == made.untyped_storage().data_ptr()

    graph = graphs["llama3-debug-fsdp2-tp2"]
    index = graph_index(graph)
    waits = [i for i, name in enumerate(index.names) if graph.nodes[name].op == WAIT]
    assert len(waits) > 10
    assert all(index.slots[i] == ((0, 0),) for i in waits)
    _, owner, _ = _walk(index, index.identity())
    assert not set(owner) & set(waits)
