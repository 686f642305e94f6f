"""Estimates: equal to real CPU peaks, the fast what-if equal to the full path, clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace
from workbench.cost.allocator import replay_allocator
from workbench.cost.estimate import CATEGORIES, Estimator, estimate, estimate_remat
from workbench.cost.measure import held_bytes, measure_graph
from workbench.cost.profiles import DeviceProfile
from workbench.decide.decider import decide, flip
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.rewrite.remat import copy_graph_module, remat, returning
from workbench.show.viz import overview

Fixture = tuple[Workload, JointGraph]
PRESETS = ["none", "default", "eager", "full"]
PROFILES = ("h100", "h200")  # fixed rates: no CPU measurement in these tests


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("fixture", ["llama_debug", "dsv3_debug"])
def test_estimated_peak_within_3_percent_of_measured_cpu_peak(
    fixture: str, preset: str, request: pytest.FixtureRequest
) -> None:
    _, graph = request.getfixturevalue(fixture)
    result = remat(graph, Policy(preset))
    est = estimate_remat(graph, result, Estimator(graph, PROFILES, optimizer="none"))
    measured = measure_graph(graph, result.gm, warmup=0, repeats=1)
    assert abs(measured.peak_bytes - est.peak_bytes) <= 0.03 * est.peak_bytes
    # kernels' own scratch buffers are the only thing the estimate does not see
    assert measured.peak_bytes >= est.peak_bytes


@pytest.mark.parametrize("fixture", ["llama_debug", "dsv3_debug"])
def test_whatif_equals_full_path_for_every_preset(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    _, graph = request.getfixturevalue(fixture)
    estimator = Estimator(graph, PROFILES)
    for preset in PRESETS:
        fast = estimator.estimate(Policy(preset))
        full = estimate_remat(graph, remat(graph, Policy(preset)), estimator)
        assert fast == full, preset


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug"])
def test_whatif_equals_full_path_on_random_flip_sequences(
    model: str, data: st.DataObject, small_graphs: dict[str, Fixture]
) -> None:
    _, graph = small_graphs[model]
    estimator = Estimator(graph, PROFILES)
    policy = Policy(data.draw(st.sampled_from(PRESETS), label="preset"))
    decisions = decide(graph, policy)
    for _ in range(data.draw(st.integers(1, 6), label="flips")):
        # a flip can force another node (a layer boundary): what may flip is asked anew
        flippable = sorted(n for n, d in decisions.items() if not d.forced)
        node = data.draw(st.sampled_from(flippable), label="node")
        all_layers = data.draw(st.booleans(), label="all_layers")
        policy = flip(graph, policy, node, all_layers=all_layers, decisions=decisions)
        decisions = decide(graph, policy)
        fast = estimator.estimate(decisions)
        full = estimate_remat(graph, remat(graph, decisions), estimator)
        assert fast == full, policy.to_json()


def test_categories_account_for_every_byte(llama_debug: Fixture) -> None:
    workload, graph = llama_debug
    est = estimate(graph, Policy("eager"), PROFILES)
    params = held_bytes(workload.model.parameters())
    # buffers (the RoPE table) are inputs too; ids and targets share one storage
    inputs = held_bytes([*workload.model.buffers(), *workload.inputs, workload.target])
    assert est.peak_breakdown["parameters"] == params
    assert est.peak_breakdown["inputs"] == inputs
    assert sum(est.peak_breakdown.values()) == est.peak_bytes == max(est.totals())
    assert set(est.timeline) == set(CATEGORIES)
    assert all(len(column) == len(est.order) for column in est.timeline.values())
    # at the end every gradient (same shapes as the parameters) and the loss are held
    assert est.timeline["gradients"][-1] == params + 4
    assert est.timeline["activations"][-1] == 0
    # parameters and the batch exist before the step: held in full from its first op, as
    # the optimizer state is (no ramp over the placeholders' steps)
    assert set(est.timeline["parameters"]) == {params}
    assert set(est.timeline["inputs"]) == {inputs}
    assert sum(r["bytes"] for r in est.saved_at_peak) == est.peak_breakdown["activations"]
    assert sum(est.saved_by_layer.values()) == est.saved_activation_bytes


@pytest.mark.parametrize("preset", ["default", "full"])
def test_returning_the_backward_inputs_runs_what_held_estimates(
    llama_debug: Fixture, preset: str
) -> None:
    """Code that also returns `backward_input_nodes` (what scripts/run_rank_graph.py runs on
    a GPU for `held`) keeps them to its end: estimated as plain code, its walk is the `held`
    estimate's, byte for byte; recomputed copies are not among them."""
    _, graph = llama_debug
    result = remat(graph, Policy(preset))
    held = Estimator(graph, PROFILES, backward_inputs="held")
    freed = Estimator(graph, PROFILES)
    names = held.backward_input_nodes(result.gm)
    kept = returning(result.gm, names)
    outputs = kept.graph.output_node().args[0]
    assert [n.name for n in outputs[-len(names) :]] == names  # type: ignore[index,union-attr]
    nodes = {n.name: n for n in result.gm.graph.nodes}
    assert not any(nodes[n].name.endswith("_recomputed") for n in names)
    as_run = freed.simulate(freed.order_of(kept))
    target = estimate_remat(graph, result, held)
    assert as_run.peak_bytes == target.peak_bytes > estimate_remat(graph, result, freed).peak_bytes
    at_end = [sum(t[-1] for t in e.timeline.values()) for e in (as_run, target)]
    assert at_end[0] == at_end[1]
    with pytest.raises(WorkbenchError, match="no node nope"):
        returning(result.gm, ["nope"])


@pytest.mark.parametrize("preset", PRESETS)
def test_a_backward_holding_its_inputs_frees_them_when_it_returns(
    llama_debug: Fixture, preset: str
) -> None:
    """`backward_inputs="held"` (an FX GraphModule backward called as f(*args)): what forward
    saved and the logits' gradient stay to the step's end; nothing else moves."""
    workload, graph = llama_debug
    freed = Estimator(graph, PROFILES).estimate(Policy(preset))
    estimator = Estimator(graph, PROFILES, backward_inputs="held")
    held = estimator.estimate(Policy(preset))
    assert held.order == freed.order and held.saved_by_node == freed.saved_by_node
    assert freed.timeline["activations"][-1] == 0
    # at its end backward still holds every byte the model's forward saved (what the loss
    # saved for its own backward, which runs first, is the loss's)
    model_saved = sum(b for n, b in held.saved_by_node.items() if graph.nodes[n].phase == "forward")
    assert held.timeline["activations"][-1] == model_saved > 0
    assert held.peak_bytes >= freed.peak_bytes
    # the one input from the loss: the gradient of the logits, the model's output
    index = estimator.index
    flat = estimator.order_for(decide(graph, Policy(preset)))
    from_loss = {
        index.names[e] for e in index.backward_inputs(flat).tolist() if index.phase[e] != "forward"
    }
    (tangent,) = from_loss
    logits = workload.model(*workload.inputs)
    assert graph.nodes[tangent].shapes[0] == tuple(logits.shape)
    # ... held to the end among the temporaries, beside the gradients
    last = held.timeline["temporaries"][-1] - freed.timeline["temporaries"][-1]
    assert last == graph.nodes[tangent].bytes


def test_backward_inputs_are_freed_or_held(llama_debug: Fixture) -> None:
    with pytest.raises(WorkbenchError, match=r"backward_inputs 'kept': one of freed, held"):
        Estimator(llama_debug[1], PROFILES, backward_inputs="kept")  # type: ignore[arg-type]


def test_presets_order_memory_and_recompute(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    estimator = Estimator(graph, PROFILES)
    none, default, full = (estimator.estimate(Policy(p)) for p in ("none", "default", "full"))
    assert none.saved_activation_bytes > default.saved_activation_bytes
    assert default.saved_activation_bytes > full.saved_activation_bytes
    assert none.peak_bytes > full.peak_bytes
    assert none.recompute_flops == 0 and none.recomputed_nodes == []
    assert full.recompute_flops > default.recompute_flops
    for profile in PROFILES:
        assert full.step_seconds[profile] > none.step_seconds[profile]
        assert full.recompute_seconds[profile] > 0 == none.recompute_seconds[profile]
    # same FLOPs, more bandwidth: the H200 is never slower in a roofline
    assert full.step_seconds["h200"] <= full.step_seconds["h100"]
    assert full.tokens_per_second["h100"] == pytest.approx(graph.tokens / full.step_seconds["h100"])


def test_recompute_flops_are_those_of_the_nodes_torch_recomputed(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    result = remat(graph, Policy("eager"))
    est = estimate(graph, Policy("eager"), PROFILES)
    assert sorted(est.recomputed_nodes) == sorted(result.report.recomputed_nodes)
    expected = sum(graph.nodes[n].flops for n in result.report.recomputed_nodes)
    assert est.recompute_flops == expected > 0


def test_allocation_granularity_rounds_every_storage(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    estimator = Estimator(graph, PROFILES)
    exact = estimator.estimate(Policy("default"))
    rounded = estimator.estimate(Policy("default"), granularity=512)
    assert rounded.peak_bytes % 512 == 0
    assert rounded.peak_bytes >= exact.peak_bytes


def test_views_share_storage_with_their_base() -> None:
    """x -> mm -> view -> relu: the view allocates nothing, the mm output lives while the
    view does, and a float32 (8, 8) @ (8, 8) output is 256 bytes."""
    lin = torch.nn.Linear(8, 8, bias=False)
    workload = Workload(
        lin, (torch.randn(8, 8),), torch.randn(64), lambda out, tgt: (out.view(64) - tgt).sum()
    )
    graph = trace(workload)
    est = estimate(graph, Policy("none"), PROFILES)
    views = [n for n in est.order if graph.nodes.get(n) and graph.nodes[n].is_view]
    assert views
    for name in views:
        p = est.order.index(name)
        assert est.totals()[p] <= est.totals()[p - 1]  # nothing new allocated by a view
    assert est.peak_breakdown["parameters"] == 256
    assert est.peak_breakdown["inputs"] == 256 + 256


def test_a_node_without_a_recorded_output_is_named(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    gm = copy_graph_module(graph.gm)
    broken = next(n for n in gm.graph.nodes if n.op == "call_function")
    del broken.meta["val"]
    damaged = JointGraph(gm, graph.nodes, graph.inputs, graph.model_name, graph.mode, 1)
    with pytest.raises(WorkbenchError, match=f"{broken.name}.*cannot size it"):
        Estimator(damaged, PROFILES)


def test_a_graph_from_elsewhere_is_refused(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    other = trace(load_workload("llama3-debug", layers=1, seq=8))
    with pytest.raises(WorkbenchError, match="does not come from the traced graph"):
        estimate_remat(graph, other.gm, Estimator(graph, PROFILES))


def test_unknown_profile_lists_the_choices(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    with pytest.raises(WorkbenchError, match="unknown device profile 'a100'.*h100, h200, cpu"):
        Estimator(graph, ["a100"])


def test_custom_profile(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    slow = DeviceProfile("slow", "test", {"float32": 1e9}, bytes_per_s=1e9)
    fast = DeviceProfile("fast", "test", {"float32": 1e12}, bytes_per_s=1e12)
    est = estimate(graph, Policy("default"), [slow, fast])
    assert est.step_seconds["slow"] == pytest.approx(1000 * est.step_seconds["fast"])


def test_json_is_plain(llama_debug: Fixture) -> None:
    import json

    _, graph = llama_debug
    est = estimate(graph, Policy("default"), PROFILES)
    data = json.loads(json.dumps(est.to_json(timeline=True)))
    assert data["peak_bytes"] == est.peak_bytes
    assert len(data["timeline"]["activations"]) == len(data["order"])
    assert "timeline" not in est.to_json()


def test_whatif_refuses_graphs_with_aot_autograd_tags(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    gm = copy_graph_module(graph.gm)
    next(n for n in gm.graph.nodes if n.op == "call_function").meta["ac_graph_id"] = 1
    tagged = JointGraph(gm, graph.nodes, graph.inputs, graph.model_name, graph.mode, 1)
    with pytest.raises(WorkbenchError, match="AOTAutograd tags \\(ac_graph_id\\).*estimate_remat"):
        Estimator(tagged, PROFILES).estimate(Policy("full"))


def test_backward_readers_follow_views(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    estimator = Estimator(graph, PROFILES)
    node = next(n for n in graph.gm.graph.nodes if n.name == "mm_4")  # feed_forward.w1
    direct = [u.name for u in node.users if graph.nodes[u.name].phase == "backward"]
    readers = estimator.backward_readers("mm_4")
    assert direct == [] and readers  # backward reads it only through its views
    views = [u for u in node.users if graph.nodes[u.name].phase == "forward"]
    through_views = {
        r.name for v in views for r in v.users if graph.nodes[r.name].phase == "backward"
    }
    assert through_views <= set(readers)
    assert all(graph.nodes[r].phase == "backward" for r in readers)
    assert any(r.startswith("silu_backward") for r in readers)
    assert estimator.backward_readers("mm") == []  # wq's output: backward never needs it


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("model", ["llama_debug", "dsv3_debug"])
def test_one_definition_of_saved_bytes(
    model: str, preset: str, request: pytest.FixtureRequest
) -> None:
    """The what-if, torch's remat output (verify's report) and the overview header agree."""
    _, graph = request.getfixturevalue(model)
    est = Estimator(graph).estimate(Policy(preset))
    report = remat(graph, Policy(preset)).report
    assert report.saved_bytes_after == est.saved_activation_bytes > 0
    assert report.saved_bytes_by_node_after == est.saved_by_node
    assert overview(graph, decide(graph, Policy(preset))).saved_bytes == est.saved_activation_bytes
    assert report.to_json()["saved_activation_bytes"] == est.to_json()["saved_activation_bytes"]


def test_a_gpu_step_holds_cublas_workspaces_beside_its_tensors() -> None:
    """Traced for a GPU: two 32 MiB blocks held the whole step, allocated before it (the
    allocator replays them first); none on the CPU, whose matmuls take no workspace."""
    from workbench.cost.workspaces import BLAS_WORKSPACES, blas_workspaces

    shape = {"layers": 2, "seq": 16, "batch": 1, "device": "meta"}
    gpu = trace(load_workload("llama3-debug", **shape), "fake")
    cpu = trace(load_workload("llama3-debug", **shape), "fake", kernels="cpu")
    assert blas_workspaces(gpu) == list(BLAS_WORKSPACES) and blas_workspaces(cpu) == []
    on_gpu = Estimator(gpu, (), "none").estimate(Policy("full"))
    on_cpu = Estimator(cpu, (), "none").estimate(Policy("full"))
    held = sum(BLAS_WORKSPACES)
    assert set(on_gpu.timeline["workspaces"]) == {held}
    assert set(on_cpu.timeline["workspaces"]) == {0}
    assert on_gpu.peak_breakdown["workspaces"] == held
    assert on_gpu.allocator_input is not None
    assert on_gpu.allocator_input.before[: len(BLAS_WORKSPACES)] == list(BLAS_WORKSPACES)
    # each takes a 32 MiB segment of its own: without them the allocator reserves 64 MiB less
    without = replay_allocator(
        **{**on_gpu.allocator_input._asdict(), "before": on_gpu.allocator_input.before[2:]}
    )
    assert on_gpu.reserved_peak_bytes - without.reserved_peak_bytes == held
    from workbench.show.widgets.panels import peak_counts

    assert peak_counts(on_gpu).endswith("and cuBLAS's workspaces (64.0 MiB)")
    assert "cuBLAS" not in peak_counts(on_cpu)
