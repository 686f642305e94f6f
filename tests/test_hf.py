"""A user's own model (issue 37): Hugging Face transformers models as users write them,
through trace, estimate (against the measured CPU peak), verify (bitwise, with the checks
before any policy), render, export and the exported `policy_fn` in eager
`torch.utils.checkpoint`; plus what the issue found broken on users' models."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

from workbench.capture.models import load_workload
from workbench.capture.trace import trace
from workbench.capture.workload import Workload, eager_step
from workbench.cli import main
from workbench.cost.estimate import Estimator
from workbench.cost.reference import policy_mismatches, reference_run
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.interop.baselines import measure_policy
from workbench.interop.export import export
from workbench.rewrite.remat import remat
from workbench.search.solve import SolveOptions, Solver
from workbench.show.viz import render_view

pytest.importorskip("transformers")

MODELS = ["llama", "qwen2", "qwen2-moe", "mixtral", "gpt2", "bert", "vit"]
# Kernel scratch no graph node shows: the CPU's convolution backward allocates buffers of
# its own (ViT's patch embedding), so the measured peak is above the estimate there.
CONV_SCRATCH_MODELS = {"vit"}


def _seeded_step(workload: Workload) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return eager_step(workload)


@pytest.mark.parametrize("name", MODELS)
def test_hf_model_end_to_end(name: str, tmp_path: Any) -> None:
    """trace → estimate = measured → verify (traced = eager, eager reproducible, the policy
    graph against graph) → render → export → apply_ac with the export's default blocks."""
    workload = load_workload(f"hf:{name}")
    graph = trace(workload, "real")
    assert graph.summary()["backward_nodes"] > 0

    # estimate = measured (graph tensors; the CPU's conv backward adds scratch of its own)
    measured = measure_policy(workload, Policy("default"), graph=graph, warmup=0, repeats=1)
    data = measured.to_json()
    assert data["bitwise_equal"]
    if name in CONV_SCRATCH_MODELS:
        assert 0 < data["peak_bytes"] - data["estimated_peak_bytes"] <= 0.03 * data["peak_bytes"]
    else:
        assert data["peak_bytes"] == data["estimated_peak_bytes"]

    # verify: nothing differs before the policy, and the policy changes no bit
    reference = reference_run(graph, workload)
    assert reference.verdict() is None, reference.verdict()
    assert reference.to_json()["traced_equals_eager"] and reference.reproducible
    for preset in ("full", "eager"):
        assert policy_mismatches(graph, remat(graph, Policy(preset)).gm, reference) == []

    # render
    view = render_view(graph, None, "overview")
    assert view.nodes > 0

    # export, then the exported policy_fn in eager torch.utils.checkpoint, blocks by default
    namespace: dict[str, Any] = {"__name__": f"hf_{name}_policy"}
    exec(compile(export(Policy("eager"), "policy_fn", graph), "<export>", "exec"), namespace)
    assert namespace["LAYERS_ATTR"] != "layers"  # the model's own container
    model = namespace["apply_ac"](copy.deepcopy(workload.model))
    sac = Workload(model, workload.inputs, workload.target, workload.loss_fn, workload.name)
    plain, checkpointed = _seeded_step(workload), _seeded_step(sac)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))


def test_hf_moe_traces_its_grouped_mm_in_float32_and_bfloat16() -> None:
    """transformers' default experts kernel, `_grouped_mm`, in the dtypes its CPU kernel runs
    (torch's meta function accepts bfloat16 only)."""
    for dtype in ("float32", "bfloat16"):
        graph = trace(load_workload("hf:mixtral", dtype=dtype), "real")
        ops = {info.op for info in graph.nodes.values()}
        assert "aten._grouped_mm.default" in ops
        params = [info for info in graph.nodes.values() if info.op == "aten._grouped_mm.default"]
        assert {info.dtype for info in params} == {dtype}


def test_hf_workarounds_are_no_longer_needed() -> None:
    """Issue 37 items 1 and 3: a causal LM called without an attention mask traces (the
    packed-sequence check reads the position ids the model built), its HF loss through
    `labels=` with a target of None estimates, and the value reads leave no node."""
    workload = load_workload("user_models:hf_llama_own_loss")
    assert workload.target is None
    graph = trace(workload, "real")
    ops = {info.op for info in graph.nodes.values()}
    assert "aten._local_scalar_dense.default" not in ops
    assert Estimator(graph, ()).estimate(Policy("default")).peak_bytes > 0


def test_verify_says_whose_fault_a_mismatch_is(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 37 item 2: a mask passed under tracing makes transformers build a dense mask and
    call SDPA with it (eager: is_causal): the traced program differs before any policy,
    and verify says so apart from the policy's verdict (graph against graph)."""
    import json

    assert main(["verify", "--model", "user_models:hf_llama_masked", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    before = result["before_policy"]
    assert result["bitwise_equal"] and result["mismatched"] == []
    assert not before["traced_equals_eager"] and before["eager_reproducible"]
    assert before["verdict"].startswith("the traced program differs from the eager program")
    assert 0 < before["largest_difference"] < 1e-6
    assert "aten.where.self" in before["ops_only_traced"]


def test_data_dependent_failure_names_the_users_frame() -> None:
    with pytest.raises(WorkbenchError) as info:
        trace(load_workload("user_models:data_dependent"), "real")
    message = str(info.value)
    assert re.search(r"user_models\.py:\d+ in forward: if x\.sum\(\) > 0", message), message
    assert "torch.where" in message and "make_fx" not in message


def test_solve_takes_every_budget_a_policy_reaches() -> None:
    """Issue 37 item 5: the floor is the lowest preset peak (full recompute's is not the
    minimum), and a budget a pareto point reached is solved, not refused."""
    graph = trace(load_workload("llama3-debug", layers=2, seq=64), "real")
    estimator = Estimator(graph, ("h100",), optimizer="none")
    solver = Solver(graph, SolveOptions(), estimator)
    full = estimator.estimate(Policy("full")).peak_bytes
    assert solver.floor_bytes <= full
    lowest = min(
        estimator.estimate(Policy(p)).peak_bytes for p in ("none", "full", "titan-full", "default")
    )
    assert solver.floor_bytes <= lowest
    assert solver.solve(solver.floor_bytes).estimate.peak_bytes <= solver.floor_bytes


def test_exported_policy_names_the_op_eager_sac_sees() -> None:
    """Issue 37 item 6: Mixtral's router writes topk's values in place: WRITTEN_LATER names
    `aten.topk`, not the FX getitem eager SAC never dispatches, and the eager preset counts
    GPT-2's addmm matmuls."""
    graph = trace(load_workload("hf:mixtral"), "real")
    namespace: dict[str, Any] = {"__name__": "mixtral_policy"}
    exec(compile(export(Policy("default"), "policy_fn", graph), "<export>", "exec"), namespace)
    written = namespace["WRITTEN_LATER"]
    assert "model.layers.0.mlp.gate::aten.topk.default#0" in written
    assert not any("getitem" in key for key in written)
    gpt2 = trace(load_workload("hf:gpt2"), "real")
    recomputed = remat(gpt2, Policy("eager")).decisions
    addmm = [n for n, info in gpt2.nodes.items() if info.op == "aten.addmm.default"]
    in_layers = [n for n in addmm if gpt2.nodes[n].layer is not None and n in recomputed]
    assert any(recomputed[n].recompute for n in in_layers)


def test_apply_ac_names_the_models_module_lists() -> None:
    workload = load_workload("hf:gpt2")
    namespace: dict[str, Any] = {"__name__": "gpt2_policy"}
    exec(compile(export(Policy("full"), "policy_fn"), "<export>", "exec"), namespace)
    with pytest.raises(ValueError, match=r"has no 'layers'.*module lists: transformer\.h"):
        namespace["apply_ac"](workload.model)


def test_dtype_reaches_factories_or_is_refused() -> None:
    """Issue 37 item 4: --dtype is applied to a factory (its dtype argument, or the default
    dtype it builds under) or refused, never ignored."""
    built = load_workload("user_models:mlp", dtype="bfloat16")
    assert {p.dtype for p in built.model.parameters()} == {torch.bfloat16}
    given = load_workload("user_models:mlp_with_dtype", dtype="bfloat16")
    assert given.config["dtype_given"] == "torch.bfloat16"
    with pytest.raises(WorkbenchError, match="--dtype bfloat16: model factory .* built float32"):
        load_workload("user_models:mlp_float32", dtype="bfloat16")


@pytest.mark.parametrize("name", ["llama", "mixtral", "vit"])
def test_torchs_memory_estimator_agrees_without_recomputation(name: str) -> None:
    """An oracle from torch itself (issue 37, item 7): inductor's `memory_estimator` (its
    device filter opened to the CPU) gives the workbench's peak on the graph without
    recomputation. After torch's remat pass it over-counts (recomputed copies share their
    original's fake storage), so only `none` is compared."""
    from unittest import mock

    from torch._inductor.fx_passes import memory_estimator

    graph = trace(load_workload(f"hf:{name}", device="meta"), "fake", kernels="cpu")
    gm = remat(graph, Policy("none")).gm
    with mock.patch.object(memory_estimator, "device_filter", lambda device: True):
        profile = memory_estimator.build_memory_profile(gm.graph, lambda n: n.op != "placeholder")
    estimate = Estimator(graph, (), optimizer="none").estimate(Policy("none"), 1)
    assert max(profile) == estimate.peak_bytes
