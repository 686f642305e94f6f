"""The planner on a tiny model: the enumeration divides the GPUs and the model, the memory
bound stays below what the estimate holds, alike stage graphs are traced once and estimate
as fresh traces do, `plan --json` ranks its configs best first, and MoE models add EP."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from workbench.capture.degrees import Degrees
from workbench.capture.models import Workload, load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.stages import trace_stages
from workbench.cli import main
from workbench.cli.plan import plan_table
from workbench.cost.stages import PipelineModel
from workbench.decide.policy import Policy
from workbench.search.planner import (
    Candidate,
    ParamCounts,
    Plan,
    PlanOptions,
    default_jobs,
    ep_degrees,
    layouts,
    lower_bound_bytes,
    plan,
)
from workbench.show.viz.plots import plan_front, plot_plan

GIB = 2**30
# Two GPUs, two layers, short sequences: every layout traces in about a second.
TINY = PlanOptions(
    model="llama3-debug",
    gpus=2,
    layers=2,
    seq=32,
    memory_bytes=GIB,
    schedules=("1F1B", "Interleaved1F1B", "ZBVZeroBubble"),
)


@pytest.fixture(scope="module")
def tiny() -> Plan:
    return plan(TINY)


def test_worker_processes_plan_as_one_process(tiny: Plan) -> None:
    """Groups of layouts evaluated in two spawned workers give the plan one process gives,
    config for config and in the same ranking; only the clock differs."""
    pooled = plan(replace(TINY, jobs=2))
    assert (tiny.jobs, pooled.jobs) == (1, 2)

    def figures(result: Plan) -> dict[str, object]:
        clock = ("seconds", "trace_seconds", "jobs")
        return {k: v for k, v in result.to_json().items() if k not in clock}

    assert figures(pooled) == figures(tiny)
    assert pooled.traces == tiny.traces and pooled.traces_reused == tiny.traces_reused


def test_default_jobs_is_one_per_cpu_this_process_may_use() -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_jobs() == cpus >= 1


def _workload(batch: int = 1) -> Workload:
    return load_workload("llama3-debug", layers=2, seq=TINY.seq, batch=batch, device="meta")


def test_layouts_divide_the_gpus_and_the_model() -> None:
    options = PlanOptions(model="llama3-debug", gpus=8, layers=2, seq=32, memory_bytes=GIB)
    kept, pruned = layouts(options, _workload())
    assert kept
    heads = _workload().model.config.n_heads
    for c in kept:
        d = c.degrees
        assert d.fsdp * d.tp * d.pp == d.gpus == options.gpus
        assert heads % d.tp == 0 and d.tp <= 8
        assert c.local_batch * d.fsdp == options.batch
        assert c.local_batch % c.microbatches == 0
        if c.schedule is not None:
            stages = d.pp * (1 if c.schedule == "1F1B" else 2)
            assert c.microbatches % stages == 0
    tried = {(c.degrees, c.schedule) for c in kept}
    dropped = {(p.degrees, p.schedule) for p in pruned}
    assert not tried & dropped
    # 2 layers + embedding + output cannot make the 16 stages of pp 8 interleaved
    assert any(p.degrees.pp == 8 and "cannot split" in p.reason for p in pruned)
    twice = replace(options, microbatch_multiples=(2,), schedules=("1F1B",))
    piped = [c for c in layouts(twice, _workload())[0] if c.schedule]
    assert piped and all(c.microbatches == 2 * c.degrees.pp for c in piped)


def test_memory_prunes_before_tracing() -> None:
    options = PlanOptions(model="llama3-debug", gpus=4, layers=2, seq=32, memory_bytes=2**20)
    kept, pruned = layouts(options, _workload())
    counts = ParamCounts.of(_workload().model)
    memory = [p for p in pruned if p.lower_bound_bytes is not None]
    assert memory and all(p.lower_bound_bytes > options.budget_bytes for p in memory)
    for c in kept:
        layout = c.pipeline().layout(2) if c.schedule else None
        assert lower_bound_bytes(counts, c, layout) <= options.budget_bytes


def test_param_counts_cover_the_model() -> None:
    model = _workload().model
    counts = ParamCounts.of(model)
    assert counts.stage((0, 1), True, True) == sum(p.numel() for p in model.parameters())
    assert counts.itemsize == 4


def test_lower_bound_is_below_the_estimate() -> None:
    """What the bound counts is a part of what the pipeline estimate holds, at any policy."""
    candidate = Candidate(Degrees(fsdp=2, pp=2), schedule="1F1B", microbatches=2, local_batch=2)
    layout = candidate.pipeline().layout(2)
    workload = _workload(candidate.local_batch)
    graphs = trace_stages(workload, "fake", Parallel(fsdp=2), candidate.pipeline())
    estimate = PipelineModel(graphs, layout).estimate(Policy("full"))
    bound = lower_bound_bytes(ParamCounts.of(workload.model), candidate, layout)
    assert 0 < bound <= estimate.peak_bytes
    whole = Candidate(Degrees(fsdp=2), schedule=None, microbatches=1, local_batch=2)
    params = sum(p.numel() for p in workload.model.parameters())
    assert lower_bound_bytes(ParamCounts.of(workload.model), whole, None) == params * 16 // 2


def test_plan_ranks_best_first(tiny: Plan) -> None:
    rows = [c for c in tiny.configs if c.feasible]
    assert rows and rows == tiny.configs[: len(rows)]
    rates = [c.tokens_per_second_per_gpu for c in rows]
    assert rates == sorted(rates, reverse=True)
    for c in tiny.configs:
        assert c.feasible == (c.peak_bytes <= TINY.budget_bytes)
        stages = 1 if c.candidate.schedule is None else len(c.candidate.pipeline().layout(2).layers)
        assert len(c.stage_peaks) == len(c.policies) == stages
    schedules = {c.candidate.schedule for c in tiny.configs}
    assert schedules == {None, "1F1B", "Interleaved1F1B", "ZBVZeroBubble"}


def test_alike_stages_are_traced_once_and_estimate_as_fresh_traces(tiny: Plan) -> None:
    """Interleaved 1F1B traces its four stages first; ZBV's (the same split) are reused."""
    assert tiny.traces_reused >= 4
    zbv = next(c for c in tiny.configs if c.candidate.schedule == "ZBVZeroBubble")
    candidate = zbv.candidate
    fresh = trace_stages(
        _workload(candidate.local_batch),
        "fake",
        candidate.parallel(),
        candidate.pipeline(),
    )
    estimate = PipelineModel(fresh, candidate.pipeline().layout(2)).estimate(zbv.policies)
    assert [row.peak_bytes for row in estimate.schedule.stages] == zbv.stage_peaks
    assert estimate.schedule.step_seconds == pytest.approx(zbv.step_seconds)
    assert estimate.tokens_per_second_per_gpu == pytest.approx(zbv.tokens_per_second_per_gpu)


def test_tokens_per_second_per_gpu_counts_one_replica(tiny: Plan) -> None:
    """A rank's tokens (its local batch) over the pp x tp GPUs sharing them, whatever fsdp."""
    for c in tiny.configs:
        local = c.candidate.local_batch * TINY.seq
        assert c.tokens_per_second_per_gpu == pytest.approx(
            local / c.step_seconds / (c.candidate.degrees.pp * c.candidate.degrees.tp)
        )


def test_plan_json_and_table(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["plan", "--model", "llama3-debug", "--gpus", "2", "--layers", "2", "--seq", "32"]
    argv += ["--memory-gib", "1", "--schedules", "1F1B", "--plot", str(tmp_path / "plan.svg")]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    configs = result["configs"]
    assert configs and (tmp_path / "plan.svg").stat().st_size > 0
    keys = {"fsdp", "tp", "pp", "schedule", "microbatches", "peak_bytes", "stage_peaks"}
    assert keys | {"est_tokens_per_second_per_gpu", "feasible", "policy"} <= set(configs[0])
    assert all(c["peak_bytes"] == max(c["stage_peaks"]) for c in configs)
    assert result["seconds"] >= result["trace_seconds"] > 0
    table = plan_table(result)
    assert table.count("\n") >= len(configs) + 2
    assert f"{configs[0]['est_tokens_per_second_per_gpu']:,.0f}" in table.splitlines()[2]
    # what the ranking rests on, in the JSON and the table
    assert result["time_basis"].startswith("roofline at NVIDIA H100 SXM datasheet peaks")
    assert f"tokens/s per GPU (the ranking): {result['time_basis']}" in table


def test_plan_front_keeps_what_nothing_beats() -> None:
    def point(rate: float, peak: int, feasible: bool = True) -> dict[str, object]:
        return {"est_tokens_per_second_per_gpu": rate, "peak_bytes": peak, "feasible": feasible}

    a, b, c, d = point(10, 50), point(8, 40), point(7, 45), point(20, 10, feasible=False)
    assert plan_front([a, b, c, d]) == [a, b]
    a |= {"fsdp": 4, "tp": 2, "pp": 2, "schedule": "1F1B"}
    figure = plot_plan([a, b, c, d], 60)
    assert figure.axes[0].get_xlabel() == "estimated tokens/s per GPU"
    assert [t.get_text() for t in figure.axes[0].texts] == ["4x2x2 1F1B"]  # b has no layout


# The reference MoE on four GPUs, one microbatch count, 1F1B only: EP 2 and 4 beside ep 1,
# with and without PP (its first stage holds only the dense layer 0).
MOE = PlanOptions(
    model="dsv3-debug",
    gpus=4,
    layers=2,
    seq=32,
    memory_bytes=GIB,
    schedules=("1F1B",),
    microbatch_multiples=(1,),
)


@pytest.fixture(scope="module")
def moe() -> Plan:
    return plan(MOE)


def _moe_workload() -> Workload:
    return load_workload("dsv3-debug", layers=2, seq=32, device="meta")


def test_moe_plan_lists_ep_layouts_with_their_peaks(moe: Plan) -> None:
    result = moe.to_json()
    eps = {(c["fsdp"], c["tp"], c["pp"], c["ep"]) for c in result["configs"]}
    assert {(4, 1, 1, 4), (2, 2, 1, 2), (2, 1, 2, 2)} <= eps  # EP with TP, with PP
    assert {ep for *_, ep in eps} == {1, 2, 4}
    for c in result["configs"]:
        assert c["fsdp"] * c["tp"] % c["ep"] == 0 and 8 % c["ep"] == 0
        assert c["peak_bytes"] == max(c["stage_peaks"]) > 0
    counts = ParamCounts.of(_moe_workload().model)
    for config in moe.configs:  # the bound stays below what each layout holds
        c = config.candidate
        layout = c.pipeline().layout(2) if c.schedule else None
        assert lower_bound_bytes(counts, c, layout) <= config.peak_bytes
    ep4 = next(c for c in moe.configs if c.candidate.degrees == Degrees(fsdp=4, ep=4))
    assert ep4.candidate.describe() == "fsdp 4 x tp 1 x pp 1 x ep 4"
    assert any(
        line.split()[1:6] == ["4", "x", "1", "x", "1"] and "ep 4" in line
        for line in plan_table(result, rows=100).splitlines()
    )
    assert [n for n in moe.notes if n.startswith("expert routing: fake tensors cannot route")]
    assert not any("not planned" in note for note in moe.notes)


def test_moe_stages_of_dense_and_moe_layers_are_not_shared(moe: Plan) -> None:
    """pp 4 over dsv3-debug's 2 layers: the middle stages hold the dense layer 0 and the MoE
    layer 1, alike in count and role but not in graph; each estimates as its fresh trace."""
    config = next(c for c in moe.configs if c.candidate.degrees.pp == 4)
    candidate = config.candidate
    fresh = trace_stages(
        load_workload("dsv3-debug", layers=2, seq=32, batch=candidate.local_batch, device="meta"),
        "fake",
        candidate.parallel(),
        candidate.pipeline(),
    )
    layout = candidate.pipeline().layout(2)
    assert layout.layers[1:3] == ((0,), (1,))
    estimate = PipelineModel(fresh, layout).estimate(config.policies)
    assert [row.peak_bytes for row in estimate.schedule.stages] == config.stage_peaks


def test_ep_lower_bound_by_hand() -> None:
    """dsv3-debug, 2 layers: layer 1's routed experts (3 x 8 x 256 x 256) sharded over
    fsdp alone without EP (replicated over TP), over ep x efsdp with it, gathered to 1/ep
    under PP; every other parameter over fsdp x tp. AdamW: 4 + 8 bytes a parameter, plus an
    fp32 gradient shard (no PP) or the unsharded bf16 weight and fp32 gradient (PP, FSDP)."""
    model = _moe_workload().model
    counts = ParamCounts.of(model)
    routed = 3 * 8 * 256 * 256
    total = sum(p.numel() for p in model.parameters())
    assert counts.experts == (0, routed)
    assert counts.stage_experts((0, 1)) == counts.stage_experts((1,)) == routed
    assert ParamCounts.of(_workload().model).stage_experts((0, 1)) == 0  # dense
    dense = total - routed

    def whole(fsdp: int, tp: int, ep: int) -> int:
        degrees = Degrees(fsdp=fsdp, tp=tp, ep=ep)
        return lower_bound_bytes(counts, Candidate(degrees, None, 1, 2), None)

    assert whole(2, 2, 1) == dense * 16 // 4 + routed * 16 // 2
    assert whole(2, 2, 2) == whole(2, 2, 4) == dense * 16 // 4 + routed * 16 // 4
    candidate = Candidate(Degrees(fsdp=2, tp=2, pp=2, ep=2), "1F1B", 2, 2)  # efsdp 2 x 2 / 2
    layout = candidate.pipeline().layout(2)
    assert layout.layers == ((0,), (1,))
    last = counts.stage((1,), False, True) - routed
    held = last * 12 // 4 + last * 6 // 2 + routed * 12 // 4 + routed * 6 // 2
    first = counts.stage((0,), True, False)
    assert lower_bound_bytes(counts, candidate, layout) == max(
        held, first * 12 // 4 + first * 6 // 2
    )
    no_ep = Candidate(Degrees(fsdp=2, tp=2, pp=2), "1F1B", 2, 2)
    held = last * 12 // 4 + last * 6 // 2 + routed * 12 // 2 + routed * 6 // 1
    assert lower_bound_bytes(counts, no_ep, layout) == max(held, first * 12 // 4 + first * 6 // 2)


def test_ep_degrees_divide_the_experts_and_the_ranks() -> None:
    assert ep_degrees(_moe_workload(), 16) == [1, 2, 4, 8]
    assert ep_degrees(_moe_workload(), 6) == [1, 2]
    assert ep_degrees(_workload(), 16) == [1]


def test_dense_models_plan_ep_1_only(tiny: Plan) -> None:
    options = PlanOptions(model="llama3-debug", gpus=8, layers=2, seq=32, memory_bytes=GIB)
    kept, pruned = layouts(options, _workload())
    assert {c.degrees.ep for c in kept} == {p.degrees.ep for p in pruned} == {1}
    assert {c.candidate.degrees.ep for c in tiny.configs} == {1}
    assert all(c["ep"] == 1 for c in tiny.to_json()["configs"])
    assert tiny.notes == []  # a dense model: nothing to say
    assert "ep" not in plan_table(tiny.to_json()).split("\n")[2]


def test_memory_pruning_keeps_the_unpruned_searchs_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory bound prunes only layouts that cannot fit: Llama3-8B's blocks (2 layers,
    16 tokens) on 4 GPUs under 8,000 MiB, where the bound prunes fsdp 2 x pp 2, rank the same
    layouts, policies and figures as a search that prunes nothing for memory (every layout
    traced and solved)."""
    import workbench.search.layouts as search_layouts

    options = PlanOptions(
        model="llama3-8b",
        gpus=4,
        layers=2,
        seq=16,
        memory_bytes=8000 * 2**20,
        schedules=("Interleaved1F1B",),
        jobs=1,
    )
    pruned = plan(options)
    assert [p for p in pruned.pruned if p.lower_bound_bytes is not None]
    monkeypatch.setattr(search_layouts, "lower_bound_bytes", lambda *args: 0)
    unpruned = plan(options)
    assert not [p for p in unpruned.pruned if p.lower_bound_bytes is not None]
    assert len(unpruned.configs) > len(pruned.configs)

    def fitting(found: Plan) -> list[dict[str, object]]:
        return [c.to_json() for c in found.configs if c.feasible]

    assert fitting(pruned) and fitting(pruned) == fitting(unpruned)
