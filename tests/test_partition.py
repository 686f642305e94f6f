"""Torch's partitioners on a real joint graph: a second min-cut pass over the partitioned
forward, and the tag-driven default partition fed the first pass's saved set; on a sharded
model, what min-cut does with FSDP's gathered weights and what reshard tags change."""

from __future__ import annotations

import pytest

from studies.partition import (
    Partition,
    activation_bytes,
    as_joint_graph,
    compute_ops,
    gathered_saved,
    partition_decisions,
    partition_model,
    partition_saving,
    repartition_forward,
    to_first_names,
)
from workbench.capture.models import load_workload
from workbench.capture.ops import ALL_GATHER
from workbench.capture.parallel import Parallel, fake_process_group, shard_workload
from workbench.show.viz import diff


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


def _backward_gathers(partition: Partition) -> int:
    return sum(
        str(n.target) == ALL_GATHER and n.op == "call_function"
        for n in partition.backward.graph.nodes
    )


def test_fsdp_gathers_kept_by_min_cut_and_re_gathered_under_reshard_tags() -> None:
    workload = load_workload("llama3-debug", layers=1, seq=16)
    parallel = Parallel(fsdp=2)
    with fake_process_group(parallel) as mesh:
        sharded = partition_model(shard_workload(workload, parallel, mesh).workload)
        # min-cut keeps gathered bf16 weights (or their transposes) instead of re-gathering
        kept = gathered_saved(sharded.joint, sharded.saved)
        assert kept and _backward_gathers(sharded) == 0
        ops = {str(n.target) for n in sharded.joint.graph.nodes if n.name in kept}
        assert "aten.t.default" in ops  # the transposed weight the backward matmul reads
        # tagged reshard: nothing gathered is kept, the backward gathers again
        reshard = partition_saving(sharded, sharded.saved, fsdp_reshard=True)
        assert gathered_saved(reshard.joint, reshard.saved) == []
        assert _backward_gathers(reshard) == len(kept)
        keep = partition_saving(sharded, sharded.saved, fsdp_reshard=False)
        assert _backward_gathers(keep) == 0
        # a second min-cut pass over the resharding forward keeps the gathers again (its
        # tags are not in the retraced graph); tagging that pass re-gathers
        second = repartition_forward(reshard)
        assert gathered_saved(second.joint, second.saved) and _backward_gathers(second) == 0
        retagged = partition_saving(second, second.saved, fsdp_reshard=True)
        assert gathered_saved(retagged.joint, retagged.saved) == []
        assert _backward_gathers(retagged) > 0
