"""Pipeline stages: torchtitan's split, stage graphs that compose to the whole step."""

from __future__ import annotations

import pytest
import torch

from workbench.capture.models import load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.stages import Pipeline, split_layers, stage_workload, trace_stages
from workbench.capture.trace import trace
from workbench.capture.workload import Workload
from workbench.errors import WorkbenchError


@pytest.mark.parametrize(
    ("layers", "stages"), [(4, 2), (6, 4), (32, 4), (80, 16), (126, 16), (126, 32), (3, 5)]
)
def test_split_is_torchtitans(layers: int, stages: int) -> None:
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    theirs = _generate_llm_fqn_per_model_part(stages, layers)
    ours = split_layers(layers, stages)
    assert [[f"layers.{i}" for i in part] for part in ours] == [
        [m for m in part if m.startswith("layers.")] for part in theirs
    ]


def test_layout_ranks_follow_the_schedule() -> None:
    assert Pipeline(pp=2).layout(6).ranks == (0, 1)
    assert Pipeline(pp=2, schedule="Interleaved1F1B").layout(6).ranks == (0, 1, 0, 1)
    assert Pipeline(pp=2, schedule="ZBVZeroBubble").layout(6).ranks == (0, 1, 1, 0)
    layout = Pipeline(pp=2, schedule="interleaved1f1b", microbatches=4).layout(6)
    assert layout.pipeline.schedule == "Interleaved1F1B" and layout.microbatches == 4
    assert layout.stages_of(1) == [1, 3]
    assert Pipeline(pp=2).layout(6).microbatches == 2  # one per stage by default


def test_stage_graphs_compose_to_the_whole_step() -> None:
    """Stage 0 forward, stage 1's loss and backward, stage 0 backward with the gradient it
    receives: the loss and every gradient equal the whole model's step bit for bit."""
    workload = load_workload("llama3-debug", layers=4, batch=2, seq=32)
    first, last = trace_stages(workload, "real", None, Pipeline(pp=2, microbatches=2))
    assert (first.config["stage"]["layers"], last.config["stage"]["layers"]) == ([0, 1], [2, 3])
    assert [s.fqn for s in first.inputs if s.kind != "param"][-2:] == ["inputs[0]", "grad_output"]
    assert [s.fqn for s in last.inputs if s.kind != "param"][-2:] == ["inputs[0]", "target"]
    assert first.tokens == last.tokens == 32  # one microbatch

    micro = Workload(workload.model, (workload.inputs[0][:1],), workload.target[:1], name="m")
    whole = trace(micro, "real")
    expected = whole.gm(*whole.example_inputs)
    args0, args1 = list(first.example_inputs or []), list(last.example_inputs or [])
    args1[-2] = first.gm(*args0)[0].detach().requires_grad_()
    out1 = last.gm(*args1)
    args0[-1] = out1[-1]  # the gradient stage 1 sends back
    out0 = first.gm(*args0)
    grads = [*out0[1 : 1 + len(first.param_names)], *out1[1:-1]]
    assert first.param_names + last.param_names == whole.param_names
    assert torch.equal(out1[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(grads, expected[1:], strict=True))


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_per_rank_stages_trace(schedule: str) -> None:
    workload = load_workload("llama3-debug", layers=6, batch=4, seq=64, device="meta")
    pipeline = Pipeline(pp=2, schedule=schedule, microbatches=4)
    graphs = trace_stages(workload, "fake", Parallel(fsdp=2, tp=2), pipeline, stages=[0, 1])
    for stage, graph in enumerate(graphs):
        assert graph.config["stage"]["stage"] == stage and graph.config["tp"] == 2
        received = [s for s in graph.inputs if s.fqn == "inputs[0]"][0]
        shape = graph.nodes[received.placeholder].shapes[0]
        # stage 0 gets one microbatch of token ids; stage 1 this rank's sequence shard
        assert shape == ((1, 64) if stage == 0 else (1, 32, 256))


def test_bad_pipelines() -> None:
    with pytest.raises(WorkbenchError, match="unknown pipeline schedule 'Zigzag'.*1F1B"):
        Pipeline(pp=2, schedule="Zigzag")
    with pytest.raises(WorkbenchError, match="cannot split 4 layers"):
        Pipeline(pp=8).layout(4)
    with pytest.raises(WorkbenchError, match="--pp 3 does\\s+not divide"):
        Pipeline(pp=3, schedule="Interleaved1F1B", layers_per_stage=2).layout(6)
    with pytest.raises(WorkbenchError, match="gives 4 stages per rank.*runs 2"):
        Pipeline(pp=2, schedule="Interleaved1F1B", layers_per_stage=1).layout(6)
    with pytest.raises(WorkbenchError, match="microbatches"):
        Pipeline(pp=4, microbatches=2).layout(8)
    layout = Pipeline(pp=2, microbatches=3).layout(4)
    workload = load_workload("llama3-debug", layers=4, batch=2, seq=32)
    with pytest.raises(WorkbenchError, match="--microbatches 3 does not divide the batch of 2"):
        stage_workload(workload, layout, 0)
    with pytest.raises(WorkbenchError, match="--stage must be"):
        stage_workload(workload, layout, 2)
    with pytest.raises(WorkbenchError, match="torchtitan's"):
        linear = Workload(torch.nn.Linear(4, 4), torch.randn(2, 4), torch.randn(2, 4))
        trace_stages(linear, "real", None, Pipeline(pp=2))
