"""The offload what-if: exact against the graph the offload pass builds, host bytes apart,
the two-stream transfer model, and the estimate against CPU measurements."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.trace import trace
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.measure import measure_graph
from workbench.cost.profiles import H100
from workbench.cost.replay import offload_order, recompute_flags, replay
from workbench.decide.decider import decide, flip, rules_of
from workbench.decide.offloadable import OffloadOptions, may_offload
from workbench.decide.policy import Policy
from workbench.decide.tags import Refusal, Refused
from workbench.errors import WorkbenchError
from workbench.rewrite.entries import OFFLOAD_STEPS as STEPS
from workbench.rewrite.host_ops import host_usage
from workbench.rewrite.offload import offload_pass
from workbench.rewrite.placement import (
    OFFLOAD_META,
    STEP_KINDS,
    Place,
    Step,
    interleave,
    interleave_arrays,
)
from workbench.rewrite.remat import remat

Fixture = tuple[Workload, JointGraph]
PROFILES = ("h100",)
OPTIONS = [OffloadOptions(), OffloadOptions(prefetch_layers=0, defer_layers=1)]


@pytest.mark.parametrize("options", OPTIONS, ids=["prefetch1", "defer1"])
@pytest.mark.parametrize("preset", ["offload", "titan-sac_and_offload"])
@pytest.mark.parametrize("name", ["llama3-debug", "dsv3-debug", "llama3-debug-fsdp2-tp2"])
def test_whatif_equals_the_offloaded_graph(
    name: str, preset: str, options: OffloadOptions, small_graphs_and_rank: dict[str, JointGraph]
) -> None:
    graph = small_graphs_and_rank[name]
    estimator = Estimator(graph, PROFILES)
    policy = Policy(preset, offload=options)
    result = remat(graph, policy)
    assert result.report.offload is not None and result.report.offload.names
    order = estimator.order_of(result.gm)
    assert estimator.order_for(decide(graph, policy), options).entries.tolist() == order[0]
    fast = estimator.estimate(policy)
    assert fast == estimate_remat(graph, result, estimator)
    assert fast.offloaded_bytes == result.report.offload.offloaded_bytes
    assert 0 < fast.host_peak_bytes <= fast.offloaded_bytes
    assert {row["node"] for row in fast.transfers} == set(result.report.offload.names)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
@pytest.mark.parametrize("name", ["llama3-debug", "dsv3-debug", "llama3-debug-fsdp2-tp2"])
def test_whatif_equals_full_path_on_random_flips_with_offload(
    name: str, data: st.DataObject, small_graphs_and_rank: dict[str, JointGraph]
) -> None:
    graph = small_graphs_and_rank[name]
    estimator = Estimator(graph, PROFILES)
    policy = Policy(data.draw(st.sampled_from(["offload", "default", "eager"]), label="preset"))
    decisions = decide(graph, policy)
    flippable = sorted(n for n, d in decisions.items() if not d.forced)
    for _ in range(data.draw(st.integers(1, 5), label="flips")):
        node = data.draw(st.sampled_from(flippable), label="node")
        policy = flip(graph, policy, node, all_layers=data.draw(st.booleans()), decisions=decisions)
        decisions = decide(graph, policy)
        fast = estimator.estimate(policy)
        full = estimate_remat(graph, remat(graph, policy), estimator)
        assert fast == full, policy.to_json()


def test_offload_lowers_the_device_bytes_and_holds_them_on_the_host(
    small_graphs: dict[str, Fixture],
) -> None:
    _, graph = small_graphs["llama3-debug"]
    estimator = Estimator(graph, PROFILES)
    kept, offloaded = estimator.estimate(Policy("default")), estimator.estimate(Policy("offload"))
    assert kept.host_peak_bytes == kept.offloaded_bytes == 0 and kept.transfers == []
    # the device copies are freed after their last forward reader: less live at its end
    end = offloaded.order.index(next(n for n in offloaded.order if n.endswith("_reload")))
    assert offloaded.totals()[end - 1] < kept.totals()[kept.order.index(offloaded.order[end - 1])]
    assert max(offloaded.host_timeline) == offloaded.host_peak_bytes > 0
    assert offloaded.saved_activation_bytes == kept.saved_activation_bytes


def test_estimate_matches_measured_device_and_host_bytes(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    estimator = Estimator(graph, PROFILES, optimizer="none")
    result = remat(graph, Policy("offload"))
    est = estimate_remat(graph, result, estimator)
    with host_usage() as usage:
        measured = measure_graph(graph, result.gm, warmup=0, repeats=1)
    assert usage.peak_bytes == est.host_peak_bytes > 0
    # on the CPU the host buffers are CPU memory too: measured = device + host, step by step
    both = max(d + h for d, h in zip(est.totals(), est.host_timeline, strict=True))
    assert abs(measured.peak_bytes - both) <= 0.03 * both
    assert measured.peak_bytes >= both


def test_slow_host_link_exposes_the_copies(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    slow = replace(H100, name="slow", host_bytes_per_s=1e6, host_hbm_contention=False)
    fast = replace(H100, name="fast", host_bytes_per_s=1e15, host_hbm_contention=False)
    est = Estimator(graph, (slow, fast)).estimate(Policy("offload"))
    kept = Estimator(graph, (slow, fast)).estimate(Policy("default"))
    assert est.exposed_transfer_seconds["fast"] < 1e-9
    assert est.exposed_transfer_seconds["slow"] > 0.5 * est.transfer_seconds["slow"]
    assert est.transfer_seconds["slow"] == pytest.approx(
        2 * est.offloaded_bytes / (1e6 * H100.host_in_step_factor)
    )
    compute = kept.step_seconds["slow"]
    assert est.step_seconds["slow"] == pytest.approx(compute + est.exposed_transfer_seconds["slow"])
    row = est.transfers[0]
    assert row["d2h_exposed_seconds"]["slow"] + row["h2d_exposed_seconds"]["slow"] > 0


def test_offload_order_skips_what_the_pass_skips(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    estimator = Estimator(graph, PROFILES)
    decisions = decide(graph, Policy("titan-sac_and_offload"))
    flat = replay(estimator.index, recompute_flags(estimator.index, decisions))
    names = [n for n, tag in decisions.items() if tag.offload]
    _, skipped = offload_order(estimator.index, flat, names, OffloadOptions())
    assert skipped == remat(graph, decisions).report.offload.skipped  # type: ignore[union-attr]
    assert offload_order(estimator.index, flat, [], OffloadOptions()) == (flat, {})
    _, skipped = offload_order(estimator.index, flat, ["primals_1"], OffloadOptions())
    assert skipped == {"primals_1": Refused(Refusal.NOT_FORWARD)}


def _refusal(refused: Refused) -> Refusal:
    """The member of the vocabulary a refusal is (a value, never a sentence parsed back)."""
    assert isinstance(refused, Refused) and isinstance(refused.why, Refusal)
    return refused.why


def test_the_three_offload_checks_refuse_in_one_vocabulary(
    small_graphs: dict[str, Fixture],
) -> None:
    """The rules (facts), the offload pass (the rematerialized graph) and its replay (index
    arrays), asked about every forward node: each refusal is a `Refused` of `Refusal`, the
    pass and the replay refuse the same nodes alike, and a node the rules refuse for a
    reason the pass also checks is refused there alike."""
    _, graph = small_graphs["llama3-debug"]
    decisions = decide(graph, Policy("none"))
    names = list(decisions)
    rules = {n: rules_of(graph).offload_refusal(n, decisions, "none") for n in names}
    rules = {n: why for n, why in rules.items() if why is not None}
    gm = offload_pass(remat(graph, decisions).gm, names, lambda n: None)
    by_pass = gm.meta[OFFLOAD_META].skipped
    estimator = Estimator(graph, PROFILES)
    flat = replay(estimator.index, recompute_flags(estimator.index, decisions))
    _, by_replay = offload_order(estimator.index, flat, names, OffloadOptions())
    assert by_replay == by_pass
    said = {_refusal(why) for why in [*rules.values(), *by_pass.values()]}
    assert {Refusal.NOT_ONE_TENSOR, Refusal.OUTSIDE_LAYERS, Refusal.WRITTEN_BY} <= said
    shared = {_refusal(why) for why in by_pass.values()}  # what the pass can say
    both = [n for n in rules if n in by_pass and _refusal(rules[n]) in shared]
    assert all(rules[n] == by_pass[n] for n in both)
    assert {_refusal(rules[n]) for n in both} == {
        Refusal.NOT_ONE_TENSOR,
        Refusal.ALIAS,
        Refusal.NOT_READ,
    }


def test_host_rate_of_the_profiles() -> None:
    # the published step rate over the benchmarked one derates the reused pool's rate
    assert H100.host_rate() == pytest.approx(53.1e9 * 32.3 / 52)
    fresh = replace(H100, host_pinned_reused=False)
    assert fresh.host_rate() == pytest.approx(11.2e9 * 32.3 / 52)
    bench = replace(H100, host_in_step_factor=1.0)
    assert bench.host_rate() == 53.1e9
    assert replace(bench, host_bytes_per_s=None).host_rate() == H100.bytes_per_s / 2


def test_copies_take_hbm_bandwidth_from_compute(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    free = replace(H100, name="free", host_hbm_contention=False)
    est = Estimator(graph, (H100, free)).estimate(Policy("offload"))
    extra = est.compute_seconds["h100"] - est.compute_seconds["free"]
    assert extra == pytest.approx(2 * est.offloaded_bytes / H100.bytes_per_s)


def test_entry_node_reads_every_entry_space(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    index = Estimator(graph, PROFILES).index
    n = index.n
    entries = np.array([5, n + 5, 2 * n + 5, 3 * n + 4 * 5, 3 * n + 4 * 5 + 3])
    assert index.space.node(entries).tolist() == [5] * 5


@given(
    st.lists(
        st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)),
        max_size=5,
    )
)
def test_interleave_arrays_is_interleave(places: list[tuple[int, int, int, int]]) -> None:
    """The order the pass builds, from a plain loop: before each node its reloads (in the
    order of their first backward readers) then its waits, after it its copies then its
    frees, otherwise values in order."""
    expected: list[Step] = []
    for p in range(10):
        reloads = sorted((pl[3], k) for k, pl in enumerate(places) if pl[2] == p)
        expected += [Step("reload", k) for _, k in reloads]
        expected += [Step("wait", k) for k, pl in enumerate(places) if pl[3] == p]
        expected.append(Step("node", p))
        for kind, col in (("offload", 0), ("free", 1)):
            expected += [Step(kind, k) for k, pl in enumerate(places) if pl[col] == p]  # type: ignore[arg-type]
    assert interleave(10, [Place(*p) for p in places]) == expected
    kinds, at = interleave_arrays(10, [Place(*p) for p in places])
    assert [Step(STEP_KINDS[k], a) for k, a in zip(kinds, at, strict=True)] == expected


def test_may_offload_names_every_way_to_ask() -> None:
    assert not may_offload("default", [("layers.*", "aten.mm*", "recompute")], {"k": "save"})
    assert may_offload("offload", [], None) and may_offload("titan-sac_and_offload", [], None)
    assert may_offload("default", [("layers.*", "aten.mm*", "offload")], None)
    assert may_offload("full", [], {"layers.*.feed_forward.w1::aten.mm.default#0": "offload"})


def test_traced_node_names_the_node_behind_every_step(
    small_graphs_and_rank: dict[str, JointGraph],
) -> None:
    graph = small_graphs_and_rank["llama3-debug"]
    estimator = Estimator(graph, PROFILES)
    est = estimator.estimate(Policy("offload", offload=OffloadOptions(defer_layers=1)))
    traced = {name: estimator.traced_node(name) for name in est.order}
    assert set(traced.values()) <= set(graph.nodes)
    assert all(traced[n] == n for n in est.order if n in graph.nodes)
    assert est.recomputed_nodes
    assert {traced[f"{n}_recomputed"] for n in est.recomputed_nodes} == set(est.recomputed_nodes)
    moved = {row["node"] for row in est.transfers}
    assert moved and all(traced[f"{n}_{step}"] == n for n in moved for step in STEPS)
    with pytest.raises(WorkbenchError, match="'nope' names no node of the estimates"):
        estimator.traced_node("nope")


def test_a_value_a_collective_reads_is_freed_after_its_wait() -> None:
    """An all-gather reads its input until its wait_tensor (gloo and NCCL run it
    asynchronously): with defer 0 the offloaded input is freed after that wait, not after the
    all-gather's call, in the pass and in the what-if alike. Freed at the call, gloo read
    freed memory (a segfault on one FSDP2 x TP2 rank). The rank is the CPU's, as gloo ran
    it: its norm is the composite, whose bf16 cast the sequence-parallel all-gather reads."""
    workload = load_workload("llama3-debug", device="meta", layers=2, seq=128)
    graph = trace(workload, "fake", Parallel(fsdp=2, tp=2), kernels="cpu")
    cast = "layers.*.attention_norm::aten._to_copy.default#2"  # bf16 cast, then all-gather
    policy = Policy("default", overrides={cast: "offload"}, offload=OffloadOptions(defer_layers=0))
    result = remat(graph, policy)
    assert result.report.offload is not None and "_to_copy_3" in result.report.offload.names
    nodes = list(result.gm.graph.nodes)
    at = {node.name: p for p, node in enumerate(nodes)}
    value = next(n for n in nodes if n.name == "_to_copy_3")
    gather = next(u for u in value.users if "all_gather" in str(u.target))
    (wait,) = gather.users
    free = next(n for n in nodes if n.kwargs.get("keepalive") is value or value in n.args[1:2])
    assert at[free.name] > at[wait.name]
    estimator = Estimator(graph, PROFILES)
    assert estimator.estimate(policy) == estimate_remat(graph, result, estimator)


def test_floor_takes_the_host_link_setting(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from workbench.cli import main

    rates, floor_steps = {}, {}
    for link in ("in-step", "benchmark", "fresh-pinned"):
        argv = ["floor", "--model", "llama3-debug", "--layers", "2", "--seq", "64"]
        assert main([*argv, "--host-link", link, "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["host_link"] == link
        rates[link] = result["host_bytes_per_s"]
        floor_steps[link] = result["floor"]["est_step_seconds"]
    # the floor offloads everything it still saves: its step slows as the link does
    assert floor_steps["benchmark"] < floor_steps["in-step"] < floor_steps["fresh-pinned"]
    assert rates["in-step"] == pytest.approx(H100.host_rate())
    assert rates["benchmark"] == pytest.approx(53.1e9)
    assert rates["fresh-pinned"] == pytest.approx(11.2e9 * 32.3 / 52)
