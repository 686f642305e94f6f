"""Torch's partitioners on a real joint graph: a second min-cut pass over the partitioned
forward, and the tag-driven default partition fed the first pass's saved set."""

from __future__ import annotations

import pytest

from workbench.models import load_workload
from workbench.studies.partition import (
    Partition,
    activation_bytes,
    as_joint_graph,
    compute_ops,
    partition_decisions,
    partition_model,
    partition_saving,
    repartition_forward,
    to_first_names,
)
from workbench.viz import diff


@pytest.fixture(scope="module")
def first() -> Partition:
    return partition_model(load_workload("llama3-debug", layers=1, seq=16))


def test_first_pass_saves_activations_and_recomputes_cheap_ops(first: Partition) -> None:
    assert first.saved and first.recomputed
    assert activation_bytes(first.joint, first.saved) > 0
    assert "aten.mm.default" not in {
        str(n.target) for n in first.backward.graph.nodes if n.name in first.recomputed
    }


def test_second_pass_maps_back_onto_the_first_joint_graph(first: Partition) -> None:
    second = repartition_forward(first)
    outputs = first.forward.graph.output_node().args[0]
    # the saved ones became user outputs (AOT adds the base of an output aliasing an intermediate)
    assert second.num_fwd_outputs >= len(outputs)
    saved = to_first_names(first, second, second.saved)
    assert saved
    names = {n.name for n in first.joint.graph.nodes}
    assert set(saved) <= names
    assert set(to_first_names(first, second, second.recomputed)) <= names


def test_tagging_the_saved_set_reproduces_it_once_views_are_followed(first: Partition) -> None:
    tagged = partition_saving(first, first.saved)
    joint = first.joint
    assert activation_bytes(joint, tagged.saved) == activation_bytes(joint, first.saved)
    assert set(compute_ops(joint, tagged.recomputed)) == set(compute_ops(joint, first.recomputed))
    naive = partition_saving(first, first.saved, follow_views=False)
    extra = set(compute_ops(joint, naive.recomputed)) - set(compute_ops(joint, first.recomputed))
    assert any("scaled_dot_product" in name for name in extra)  # attention runs again
    graph = as_joint_graph(first, "llama3-debug")
    before = partition_decisions(graph, first.recomputed, "min-cut")
    views = diff(graph, before, partition_decisions(graph, tagged.recomputed, "tags")).rows
    assert all(graph.nodes[r.node].is_view for r in views)  # a view is free to run again
    changed = diff(graph, before, partition_decisions(graph, naive.recomputed, "names")).rows
    assert {r.op for r in changed} >= {"aten._scaled_dot_product_flash_attention_for_cpu.default"}
