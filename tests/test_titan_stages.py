"""torchtitan models pipelined as graph trainer's graph_pp builds them: torchtitan's split, its
`parallelize` on each stage, graph_pp's stage step traced on the fake process group."""

from __future__ import annotations

import importlib.util
import json

import pytest

from workbench.capture.graph import JointGraph
from workbench.capture.models import load_workload
from workbench.capture.ops import layer_of
from workbench.capture.parallel import Parallel
from workbench.capture.stages import Pipeline, trace_stages
from workbench.capture.titan_rank import check_titan_pipeline
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.errors import WorkbenchError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan not installed: pip install -e '.[torchtitan]'",
)

LLAMA = "torchtitan:llama3/debugmodel"
PIPELINE = Pipeline(pp=2, schedule="Interleaved1F1B")


@pytest.fixture(scope="module")
def llama_stages() -> list[JointGraph]:
    workload = load_workload(LLAMA, seq=32, batch=4, device="meta")
    return trace_stages(workload, "fake", Parallel(fsdp=2, tp=2, pp=2), PIPELINE)


def _modules(graph: JointGraph) -> set[str]:
    return {info.module for info in graph.nodes.values() if info.module}


def test_stages_split_as_torchtitan_and_hold_their_modules(
    llama_stages: list[JointGraph],
) -> None:
    # 6 layers + embedding + output over 4 stages: torchtitan's
    # _generate_llm_fqn_per_model_part gives [emb, 0], [1, 2], [3, 4], [5, norm, lm_head]
    expected = [[0], [1, 2], [3, 4], [5]]
    for s, graph in enumerate(llama_stages):
        layers = {layer_of(m) for m in _modules(graph)} - {None}
        assert sorted(layers) == expected[s]
        assert graph.config["parallelize"] == "graph trainer"
        roots = {m.split(".")[0] for m in _modules(graph)}
        assert ("tok_embeddings" in roots) == (s == 0)
        assert ("lm_head" in roots) == (s == 3)
        assert (graph.summary()["loss_nodes"] > 0) == (s == 3)
        fqns = {spec.fqn: spec.placeholder for spec in graph.inputs}
        # after the first stage: hidden states of this rank's sequence shard, in bf16
        received = graph.nodes[fqns["inputs[0]"]]
        assert (received.dtype == "bfloat16") == (s > 0)
        if s > 0:
            assert received.shapes == ((1, 16, 256),)
        assert ("grad_output" in fqns) == (s < 3)
        assert ("target" in fqns) == (s == 3)


def test_stage_parameters_sum_to_the_unpipelined_rank(llama_stages: list[JointGraph]) -> None:
    whole = trace(load_workload(LLAMA, seq=32, device="meta"), "fake", Parallel(fsdp=2, tp=2))
    stages = sum(g.summary()["param_bytes"] for g in llama_stages)
    assert stages == whole.summary()["param_bytes"]


def test_estimate_pp_runs_on_torchtitan_stages(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", LLAMA, "--mode", "fake", "--seq", "32", "--fsdp", "2", "--tp", "2"]
    pipeline = ["--pp", "2", "--pp-schedule", "Interleaved1F1B"]
    main(["estimate", *args, *pipeline, "--policy", "titan-default", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert [s["layers"] for s in result["stages"]] == [[0], [1, 2], [3, 4], [5]]
    assert result["peak_bytes"] > 0


def test_graph_pp_refusals() -> None:
    workload = load_workload(LLAMA, seq=32, batch=4, device="meta")
    with pytest.raises(WorkbenchError, match="_validate_graph_pp_config: .*Got 1F1B"):
        trace_stages(workload, "fake", Parallel(fsdp=2, pp=2), Pipeline(pp=2))
    with pytest.raises(WorkbenchError, match="--mode fake only"):
        trace_stages(workload, "real", Parallel(fsdp=2, pp=2), PIPELINE)
    with pytest.raises(WorkbenchError, match="pipelining_fn is not graph_pipeline_llm"):
        check_titan_pipeline("torchtitan:muse_glimmer/debugmodel", "Interleaved1F1B")


def test_one_device_stages_sum_to_the_model() -> None:
    workload = load_workload(LLAMA, seq=32, batch=4, device="meta")
    graphs = trace_stages(workload, "fake", None, PIPELINE)
    whole = trace(load_workload(LLAMA, seq=32, device="meta"), "fake")
    assert sum(g.summary()["param_bytes"] for g in graphs) == whole.summary()["param_bytes"]


def test_plan_ranks_torchtitan_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", LLAMA, "--gpus", "4", "--layers", "2", "--seq", "64"]
    main([*args, "--jobs", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    pipelined = [row for row in result["configs"] if row["pp"] > 1]
    assert pipelined and {row["schedule"] for row in pipelined} <= {
        "Interleaved1F1B",
        "ZBVZeroBubble",
    }
    assert any("Got 1F1B" in row["reason"] for row in result["pruned"])


@pytest.mark.parametrize("parallel", [Parallel(fsdp=2, pp=2), Parallel(fsdp=2, tp=2, pp=2)])
def test_stages_of_many_layers_are_stamped_as_full_traces(parallel: Parallel) -> None:
    """Stages of more layers than a stamping template keeps (Llama3-8B's blocks, 18 layers
    + embedding + output over 4 stages: [emb, 0-3], [4-8], [9-13], [14-17, norm, lm_head]):
    graph_pp's stage graphs stamped from kept templates each equal their full trace, node
    for node (`assert_same_graph` checks each stamped all but three layers)."""
    from tests.test_stamp import assert_same_graph
    from workbench.capture.stages import stage_workload

    workload = load_workload("torchtitan:llama3/8B", layers=18, seq=64, batch=4, device="meta")
    layout = PIPELINE.layout(18)
    templates: dict[object, object] = {}
    for s in range(layout.n_stages):
        part = stage_workload(workload, layout, s, parallel)
        stamped = trace(part, "fake", parallel, templates=templates)
        assert_same_graph(stamped, trace(part, "fake", parallel, stamp=False))
    assert len(templates) == 3  # first, middle, last
