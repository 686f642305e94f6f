"""The min-cut pass stack: budgets shrink what is saved, the partitioned step is exact."""

from __future__ import annotations

import torch

from studies.mincut import min_cut_partition, read_by_backward, saved_by_op
from studies.partition import split_saved
from workbench.capture.models import load_workload
from workbench.capture.trace import trace
from workbench.capture.workload import eager_step
from workbench.decide.policy import Policy
from workbench.rewrite.remat import remat


def test_budget_trades_saved_bytes_for_recompute() -> None:
    workload = load_workload("llama3-debug", layers=2, seq=128)
    reference = eager_step(workload)
    full, tight = min_cut_partition(workload, 1.0), min_cut_partition(workload, 0.2)
    assert tight.kept.bytes < full.kept.bytes
    assert tight.recompute_flops > full.recompute_flops == 0
    for part in (full, tight):
        assert all(torch.equal(a, b) for a, b in zip(part.step(), reference, strict=True))
        assert all(i.op != "placeholder" for i in part.kept.activations)
    table = saved_by_op(full.kept.activations)
    assert sum(n for n, _ in table.values()) == len(full.kept.activations)
    assert sum(b for _, b in table.values()) >= full.kept.bytes  # views counted once there


def test_split_saved_puts_weight_transposes_with_inputs() -> None:
    graph = trace(load_workload("llama3-debug", layers=1, seq=32), mode="real")
    result = remat(graph, Policy("none"))
    read = read_by_backward(graph, result)
    saved = split_saved(result.gm, graph.nodes, read)
    assert len(saved.activations) + len(saved.aliases) == len(read)
    assert any(i.op == "aten.t.default" for i in saved.aliases)
    assert all(i.op != "aten.t.default" for i in saved.activations)
    assert 0 < saved.bytes <= sum(i.bytes for i in saved.activations)
