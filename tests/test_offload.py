"""CPU offload: the decision in rules and policies, the placement rule, the pass, numerics."""

from __future__ import annotations

import json
import operator
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.ops import op_name, storage_inputs
from workbench.capture.parallel import Parallel
from workbench.capture.trace import trace
from workbench.cli import main
from workbench.cost.estimate import Estimator, estimate_remat
from workbench.cost.measure import bitwise_mismatches
from workbench.decide.decider import decide, flip, next_action, node_keys, rules_of
from workbench.decide.engine import Request, decide_ops, eager_tag
from workbench.decide.facts import MIN_OFFLOAD_BYTES, Storage, alias_input, op_facts, storage_of
from workbench.decide.offloadable import OffloadOptions, offload_refusal
from workbench.decide.policy import Policy
from workbench.decide.presets import PRESETS
from workbench.decide.tags import Why
from workbench.errors import WorkbenchError
from workbench.files import MARK_KEY
from workbench.interop.baselines import measure_eager
from workbench.interop.eager import eager_decisions
from workbench.rewrite.host_ops import host_usage, ops_for
from workbench.rewrite.offload import offload_pass
from workbench.rewrite.placement import (
    NO_LAYER,
    OFFLOAD_META,
    Offloaded,
    Place,
    Step,
    interleave,
    is_offload_node,
    place_offloads,
    place_offloads_arrays,
)
from workbench.rewrite.remat import remat
from workbench.show.viz import diff, render_view
from workbench.show.viz.style import GREEN, KIND_STYLE, node_kind
from workbench.show.widgets import PolicyExplorer

Fixture = tuple[Workload, JointGraph]


def offloaded(graph: JointGraph, policy: Policy) -> list[str]:
    return [n for n, t in decide(graph, policy).items() if t.offload]


# --- the decision -----------------------------------------------------------------------


def storage(nbytes: int = 8192, **kw: bool) -> Storage:
    facts = {"contiguous": True, "fresh": True, "output": False}
    return Storage(nbytes, **{**facts, "mutated": False, **kw})


def row(name: str, module: str, op: str = "aten.mm.default", **kw: object) -> tuple[object, ...]:
    return (
        name,
        module,
        op,
        kw.get("random", False),
        kw.get("mutation", False),
        None,
        kw.get("users", ()),
        None,
        kw.get("storage", storage()),
    )


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"storage": None}, "no single tensor"),
        ({"module": "norm"}, "outside the layers"),
        ({"module": "layers.1.ff"}, "last layer"),
        ({"random": True}, "random op"),
        ({"mutation": True}, "written in place"),
        ({"storage": storage(mutated=True)}, "written in place"),
        ({"storage": storage(fresh=False)}, "view or alias"),
        ({"storage": storage(output=True)}, "returned by the step"),
        ({"storage": storage(contiguous=False)}, "not contiguous"),
        ({"storage": storage(MIN_OFFLOAD_BYTES - 4)}, "under the 4096-byte minimum"),
        ({"op": "_c10d_functional.wait_tensor.default"}, "collective"),
    ],
)
def test_what_may_not_be_offloaded_says_why(kw: dict[str, object], reason: str) -> None:
    module = str(kw.pop("module", "layers.0.ff"))
    (facts,) = op_facts([row("a", module, **kw)])  # type: ignore[list-item]
    refused = offload_refusal(facts, last=1)
    assert refused is not None and reason in refused.words
    (fine,) = op_facts([row("a", "layers.0.ff")])  # type: ignore[list-item]
    assert offload_refusal(fine, last=1) is None


def test_a_getitem_owns_what_a_multi_output_op_made_for_it() -> None:
    """`topk` makes its outputs: each getitem owns its storage (fresh, offloadable, no alias);
    `split` returns views of its input: each getitem shares that input's storage."""

    def step(x: torch.Tensor) -> list[torch.Tensor]:
        values, indices = torch.topk(x, 2)
        first, _ = torch.split(x, 2)
        return [values * 2, indices + 1, first * 3]

    gm = make_fx(step, tracing_mode="fake")(torch.randn(4, 8))
    by_name = {n.name: n for n in gm.graph.nodes}
    getitems = {
        op_name(n.args[0].target): [g for g in n.args[0].users]
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is operator.getitem
    }
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    for getitem in getitems["aten.topk.default"]:
        assert storage_inputs(getitem) == [x]  # the op's inputs, which it does not alias
        assert storage_of(getitem).fresh and alias_input(getitem) is None  # type: ignore[union-attr]
    for getitem in getitems["aten.split.Tensor"]:
        assert storage_inputs(getitem) == [x]
        assert not storage_of(getitem).fresh  # type: ignore[union-attr]
        assert alias_input(getitem) == getitem.args[0].name  # the split, a view of x
    assert storage_inputs(by_name["mul"]) == by_name["mul"].all_input_nodes


def test_refused_requests_are_saved_with_the_reason_and_the_budget_is_largest_first() -> None:
    rows = [
        row("small", "layers.0.ff", users=("bwd",), storage=storage(8192)),
        row("big", "layers.0.ff", users=("bwd",), storage=storage(65536)),
        row("mid", "layers.0.ff", users=("bwd",), storage=storage(16384)),
        row("last", "layers.1.ff", users=("bwd",)),
    ]
    facts = op_facts(rows)  # type: ignore[arg-type]
    budget = OffloadOptions(budget_bytes=65536 + 8192)
    tags = decide_ops(facts, Request("offload", offload=budget))
    assert [tags[n].action for n in ("big", "small", "mid", "last")] == [
        "offload",
        "offload",
        "save",
        "save",
    ]
    assert tags["mid"].why is Why.PRESET  # the preset's save, not a refusal
    asked = decide_ops(
        facts,
        Request(
            "none",
            overrides={
                "layers.*.ff::aten.mm.default#0": "offload",
                "layers.1.ff::aten.mm.default#0": "offload",
            },
            offload=OffloadOptions(budget_bytes=4096),
        ),
    )
    assert asked["small"].why is Why.OFFLOAD_REFUSED and "over the offload budget" in (
        asked["small"].detail_words
    )
    assert asked["last"].explanation.startswith("offload refused: is in the last layer")
    assert asked["last"].policy is CheckpointPolicy.MUST_SAVE and not asked["last"].forced


def test_offload_preset_offloads_what_default_keeps(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    default, offload = decide(graph, Policy("default")), decide(graph, Policy("offload"))
    moved = [n for n, t in offload.items() if t.offload]
    assert moved and all(not default[n].recompute and graph.nodes[n].layer == 0 for n in moved)
    assert {n for n, t in offload.items() if t.recompute} == {
        n for n, t in default.items() if t.recompute
    }
    assert all(offload[n].explanation == "preset:offload" for n in moved)


def test_eager_tag_saves_an_offload_request() -> None:
    (facts,) = op_facts([row("a", "layers.0.ff")])  # type: ignore[list-item]
    overrides = {"layers.*.ff::aten.mm.default#0": "offload"}
    tag = eager_tag(facts, PRESETS["none"].rule(), Request("none", overrides=overrides))
    assert tag.why is Why.OFFLOAD_REFUSED and "eager SAC cannot offload" in tag.detail_words


def test_flip_cycles_save_recompute_offload(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    node = next(n for n, i in graph.nodes.items() if i.op == "aten.mm.default" and i.layer == 0)
    policy, seen = Policy("default"), []
    for _ in range(4):
        seen.append(decide(graph, policy)[node].action)
        policy = flip(graph, policy, node)
    assert seen == ["save", "recompute", "offload", "save"]
    last = next(n for n, i in graph.nodes.items() if i.op == "aten.mm.default" and i.layer == 1)
    recompute = Policy("full")
    action, why = next_action(graph, recompute, last, decide(graph, recompute))
    assert action == "save" and why is not None and "last layer" in why.words


# --- policy files -----------------------------------------------------------------------


def test_policy_json_writes_version_3_only_when_it_offloads(tmp_path: object) -> None:
    assert Policy("default").to_json()["version"] == 1
    policy = Policy("offload", offload=OffloadOptions(2**20, 2, 1))
    data = policy.to_json()
    assert data["version"] == 3 and data["offload"] == {
        "budget_bytes": 2**20,
        "prefetch_layers": 2,
        "defer_layers": 1,
    }
    assert Policy.from_json(json.loads(json.dumps(data))) == policy
    assert Policy(overrides={"a::b#0": "offload"}).to_json()["version"] == 3
    old = {"schema": "sac-workbench/policy", "version": 1, "preset": "eager"}
    assert Policy.from_json(old) == Policy("eager")
    with pytest.raises(WorkbenchError, match="unknown policy fields \\['offload'\\]"):
        Policy.from_json({**old, "offload": {}})
    with pytest.raises(WorkbenchError, match="offload needs policy version 3"):
        Policy.from_json({**old, "overrides": {"a::b#0": "offload"}})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"budget_bytes": 0}, "would offload nothing"),
        ({"budget_bytes": -1}, "would offload nothing"),
        ({"budget_bytes": 1.5}, "whole number of bytes or null"),
        ({"budget_bytes": True}, "whole number of bytes or null"),
        ({"prefetch_layers": -1}, "prefetch_layers -1 must be a whole number"),
        ({"defer_layers": "1"}, "defer_layers '1' must be a whole number"),
        ({"prefetch": 1}, "unknown fields \\['prefetch'\\]"),
    ],
)
def test_bad_offload_options_are_refused(options: dict[str, object], message: str) -> None:
    data = {"schema": "sac-workbench/policy", "version": 3, "offload": options}
    with pytest.raises(WorkbenchError, match=message):
        Policy.from_json(data)


# --- placement --------------------------------------------------------------------------

#            0  1  2  3  4  5  6  7  8  9 10 11
LAYER = [None, 0, 0, 1, 1, 2, 2, 1, 1, 0, 0, None]
BACKWARD = [False] * 7 + [True] * 5


def test_place_offloads_defers_and_prefetches_by_layers() -> None:
    value = Offloaded(producer=1, last_forward_use=2, first_backward_use=9)
    now = place_offloads(BACKWARD, LAYER, [value], OffloadOptions(None, 0, 0))
    assert now == [Place(1, 2, 9, 9)]
    later = place_offloads(BACKWARD, LAYER, [value], OffloadOptions(None, 1, 1))
    assert later == [Place(1, 4, 7, 9)]  # freed at the end of layer 1; reloaded with its bwd
    far = place_offloads(BACKWARD, LAYER, [value], OffloadOptions(None, 5, 9))
    assert far == [Place(1, 6, 7, 9)]  # clamped to the end of forward and its first bwd node
    with pytest.raises(WorkbenchError, match="made in forward"):
        place_offloads(BACKWARD, LAYER, [Offloaded(8, 8, 9)], OffloadOptions())


def test_prefetch_counts_layers_from_the_producers_layer() -> None:
    """As graph trainer does: with N = 1, layer 0's output, first read in layer 1's
    backward, is reloaded where layer 1's backward starts, as layer 0's own values are (not
    a layer before its reader's); outside the layers, right before the reader."""
    #        0     1  2  3  4  5  6  7  8  9 10 11 12  13
    layer = [None, 0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, None]
    backward = [False] * 7 + [True] * 7
    output = Offloaded(producer=2, last_forward_use=3, first_backward_use=10)
    inner = Offloaded(producer=1, last_forward_use=2, first_backward_use=11)
    places = place_offloads(backward, layer, [output, inner], OffloadOptions(None, 1, 0))
    assert [p.reload_before for p in places] == [9, 9]  # layer 1's first backward node
    places = place_offloads(backward, layer, [output, inner], OffloadOptions(None, 2, 0))
    assert [p.reload_before for p in places] == [7, 7]  # layer 2's
    outside = Offloaded(producer=0, last_forward_use=1, first_backward_use=12)
    assert place_offloads(backward, layer, [outside], OffloadOptions(None, 2, 0))[0][2] == 12


def _plain_place_offloads(
    backward: list[bool], layer: list[int | None], values: list[Offloaded], options: OffloadOptions
) -> list[Place]:
    """The placement rule one position and one value at a time, as the docstring of
    `place_offloads` says it."""
    end = next((p for p, b in enumerate(backward) if b), len(backward))
    region_end: list[int] = []
    region_of: list[int] = []
    for p in range(end):
        if p and layer[p] != layer[p - 1]:
            region_end.append(p - 1)
        region_of.append(len(region_end))
    if end:
        region_end.append(end - 1)
    first_in_backward: dict[int, int] = {}
    for p in range(end, len(backward)):
        lid = layer[p]
        if backward[p] and lid is not None and lid not in first_in_backward:
            first_in_backward[lid] = p
    order = sorted(first_in_backward, key=first_in_backward.__getitem__)
    rank = {lid: i for i, lid in enumerate(order)}
    places = []
    for producer, last_use, q in values:
        if not producer < end <= q:
            raise WorkbenchError(
                f"offloaded value at {producer} must be made in forward (before {end}) and "
                f"read in backward, not first at {q}"
            )
        free = max(producer, last_use)
        if options.defer_layers:
            target = min(region_of[producer] + options.defer_layers, len(region_end) - 1)
            free = max(free, region_end[target])
        reload = q
        lid = layer[producer]
        if options.prefetch_layers and lid in rank:
            earlier = rank[lid] - options.prefetch_layers
            reload = min(q, first_in_backward[order[earlier]] if earlier >= 0 else end)
        places.append(Place(producer, free, reload, q))
    return places


def _random_order(rng: random.Random) -> tuple[list[bool], list[int | None]]:
    """A node order: forward, then backward from its first backward node (with some
    positions not marked backward), layer ids in runs or scattered, None among them."""
    length = rng.randint(1, 40)
    end = rng.randint(0, length)
    backward = [False] * end + [p == end or rng.random() < 0.8 for p in range(end, length)]
    choices: list[int | None] = [None, *range(rng.randint(1, 5))]
    layer: list[int | None] = []
    while len(layer) < length:
        layer += [rng.choice(choices)] * (rng.randint(1, 6) if rng.random() < 0.7 else 1)
    return backward, layer[:length]


def _outcome(place: Callable[..., list[Place]], *args: Any) -> list[Place] | str:
    try:
        return place(*args)
    except WorkbenchError as err:
        return str(err)


def test_place_offloads_equals_a_plain_placement_on_random_orders() -> None:
    """Both forms, against the rule applied position by position: prefetch and defer 0..3,
    values read or not in forward, and misplaced values refused with the same words."""
    rng = random.Random(0)
    outcomes = []
    for _ in range(400):
        backward, layer = _random_order(rng)
        end = backward.index(True) if True in backward else len(backward)
        values = []
        for _ in range(rng.randint(0, 6)):
            producer = rng.randrange(end) if end else 0
            last_use = rng.randint(producer, end - 1) if end and rng.random() < 0.7 else producer
            q = rng.randrange(end, len(backward)) if end < len(backward) else end - 1
            values.append(Offloaded(producer, last_use, q))
        options = OffloadOptions(None, rng.randint(0, 3), rng.randint(0, 3))
        ids = np.array([NO_LAYER if x is None else x for x in layer], np.int64)
        expected = _outcome(_plain_place_offloads, backward, layer, values, options)
        assert _outcome(place_offloads, backward, layer, values, options) == expected
        assert _outcome(place_offloads_arrays, np.array(backward), ids, values, options) == expected
        outcomes.append(expected)
    refused = sum(isinstance(o, str) for o in outcomes)
    assert refused > 10 and sum(len(o) > 1 for o in outcomes if not isinstance(o, str)) > 200


def test_interleave_orders_steps_around_their_nodes() -> None:
    places = [Place(1, 1, 3, 3), Place(1, 2, 3, 4)]
    assert interleave(5, places) == [
        Step("node", 0),
        Step("node", 1),
        Step("offload", 0),
        Step("offload", 1),
        Step("free", 0),
        Step("node", 2),
        Step("free", 1),
        Step("reload", 0),
        Step("reload", 1),
        Step("wait", 0),
        Step("node", 3),
        Step("wait", 1),
        Step("node", 4),
    ]


# --- the pass and numerics --------------------------------------------------------------

POLICIES = {
    "offload": Policy("offload"),
    "now": Policy("offload", offload=OffloadOptions(prefetch_layers=0, defer_layers=0)),
    "early-late": Policy("offload", offload=OffloadOptions(prefetch_layers=2, defer_layers=1)),
    "budget": Policy("offload", offload=OffloadOptions(budget_bytes=100_000)),
    "titan": Policy("titan-sac_and_offload"),
    # every matmul of layer 0 asked by name on a save-everything policy: backward reads
    # some through saved views, which the pass replays on the reloaded tensor
    "views": Policy(
        "none", selectors=[{"select": "layers.0.**::aten.mm.default", "action": "offload"}]
    ),
}
CASES = [("llama3-debug", name) for name in POLICIES] + [
    ("dsv3-debug", name) for name in ("offload", "early-late", "views")
]


@pytest.mark.parametrize(("model", "name"), CASES)
def test_offloaded_graphs_are_bitwise_equal_to_eager(
    small_graphs: dict[str, Fixture], model: str, name: str
) -> None:
    workload, graph = small_graphs[model]
    policy = POLICIES[name]
    result = remat(graph, policy)
    plan = result.report.offload
    assert plan is not None and plan.names and result.gm.meta[OFFLOAD_META] is plan
    assert set(plan.names) <= set(offloaded(graph, policy))
    inserted = [n for n in result.gm.graph.nodes if is_offload_node(n)]
    assert len(inserted) == 4 * len(plan.names)
    with host_usage() as usage:
        assert bitwise_mismatches(graph, result.gm, workload) == []
    # every copy made, every host buffer freed after its reload; together they were all live
    assert usage.copies == len(plan.names) and usage.live_bytes == 0
    assert usage.peak_bytes == plan.offloaded_bytes
    assert result.report.to_json()["offload"]["offloaded"] == len(plan.names)


def test_the_pass_builds_the_order_interleave_gives(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    policy = Policy("offload", offload=OffloadOptions(prefetch_layers=1, defer_layers=1))
    result = remat(graph, policy)
    plan = result.report.offload
    assert plan is not None
    steps = interleave(len(result.gm.graph.nodes) - 4 * len(plan.names), plan.places)
    kinds = {"offload": "offload", "reload": "reload"}
    seen = []
    for node in result.gm.graph.nodes:
        if not is_offload_node(node):
            seen.append("node")
        else:
            name = node.target._opname  # type: ignore[union-attr]
            backward = bool(node.meta.get("autograd_backward"))
            seen.append(kinds.get(name, "wait" if backward else "free"))
    assert seen == [s.kind for s in steps]
    assert plan.places[0].free_after > plan.values[0].last_forward_use  # deferred a layer


def test_the_pass_skips_what_it_cannot_offload_safely(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    result = remat(graph, Policy("default"))
    view = next(n.name for n in result.gm.graph.nodes if "view" in str(n.target))
    gm = offload_pass(result.gm, [view, "nope"], lambda n: None)
    assert gm.meta[OFFLOAD_META].names == []
    assert set(gm.meta[OFFLOAD_META].skipped) == {view, "nope"}


def test_offloaded_graphs_run_on_fake_tensors(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    result = remat(graph, Policy("offload"))
    assert graph.example_inputs is not None
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        inputs = [mode.from_tensor(t) for t in graph.example_inputs]
        with torch.no_grad():
            outputs = result.gm(*inputs)
    assert [o.shape for o in outputs] == [o.shape for o in graph.run()]


def test_offload_keys_name_the_preset_choice(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["dsv3-debug"]
    keys = node_keys(graph)
    moved = offloaded(graph, Policy("offload"))
    assert moved and all(keys[n].startswith("layers.*") for n in moved)
    assert {f.name for f in rules_of(graph).facts if f.storage is None} & set(moved) == set()


def test_the_cpu_uses_the_workbench_ops_with_buffers_of_their_own() -> None:
    ops = ops_for(torch.device("cpu"))
    assert ops.offload is torch.ops.workbench.offload.default
    x = torch.arange(1024.0)
    with host_usage() as usage:
        host = ops.wait(ops.offload(x), x)  # the device original is freed
        assert x.untyped_storage().nbytes() == 0 and usage.live_bytes == 4096
        back = ops.wait(ops.reload(host, x.device, [1024], [1]), host)
    assert torch.equal(back, torch.arange(1024.0)) and usage.live_bytes == 0
    assert host.untyped_storage().nbytes() == 0 and usage.peak_bytes == 4096


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's ao:: ops)")
def test_offload_on_cuda_uses_torchs_ops_as_the_pass_calls_them() -> None:
    ops = ops_for(torch.device("cuda"))
    assert ops.offload is torch.ops.ao.offload.default
    x = torch.arange(1024.0, device="cuda")
    host = ops.wait(ops.offload(x), x)  # the arguments the pass gives, in its order
    assert host.device.type == "cpu" and x.untyped_storage().nbytes() == 0
    back = ops.wait(ops.reload(host, x.device, [1024], [1]), host)
    assert torch.equal(back.cpu(), torch.arange(1024.0))


# --- explorer, pictures, diff -----------------------------------------------------------


def test_explorer_cycles_to_offload_and_back_with_undo(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    workload, graph = small_graphs["llama3-debug"]
    ex = PolicyExplorer(graph, "default", workload=workload, autosave=tmp_path / "p.json")
    ex.show("layer:0")
    ex.select("mm_4")
    ex.flip("mm_4")
    ex.flip("mm_4")
    assert ex.details["action"] == "offload" and ex.details["offload"] == "possible"
    assert "offloaded in every identical layer" in ex.message
    assert ex.policy_json["version"] == 3
    assert json.loads((tmp_path / "p.json").read_text())["version"] == 3
    assert ex.policy_json["overrides"] == {"layers.*.feed_forward.w1::aten.mm.default#0": "offload"}
    assert "host memory (offloaded)" in " ".join(ex.legend["lines"])
    ex.undo()
    assert ex.policy_json["overrides"] == {
        "layers.*.feed_forward.w1::aten.mm.default#0": "recompute"
    }
    ex.redo()
    ex._on_msg(ex, {"type": "offload", "budget_bytes": 2**20, "prefetch_layers": 2}, None)
    assert ex.policy_json["offload"] == {
        "budget_bytes": 2**20,
        "prefetch_layers": 2,
        "defer_layers": 0,
    }
    with pytest.raises(WorkbenchError, match="would offload nothing"):
        ex.set_offload(budget_bytes=0)
    ex.undo()
    assert "offload" not in ex.policy_json
    ex.flip("mm_4")
    assert ex.details["action"] == "save"
    # the last layer: the cycle passes over offload and says why
    last = next(n for n, i in graph.nodes.items() if i.op == "aten.mm.default" and i.layer == 1)
    ex.all_layers = False
    ex.select(last)
    ex.flip(last)
    ex.flip(last)
    assert ex.details["action"] == "save" and "offload not offered" in ex.message
    assert ex.details["offload"].startswith("not possible: it is in the last layer")
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved.pop(MARK_KEY).startswith("sac-workbench") and saved == ex.policy_json


def test_pictures_and_diff_show_offload(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    default, offload = decide(graph, Policy("default")), decide(graph, Policy("offload"))
    moved = [n for n, t in offload.items() if t.offload]
    assert {node_kind(graph.nodes[n], offload[n]) for n in moved} == {"offload"}
    assert KIND_STYLE["offload"][0]["fillcolor"] == GREEN
    picture = render_view(graph, offload, "layer:0")
    assert "offloaded for bwd" in picture.dot.source and GREEN in picture.dot.source
    changes = diff(graph, default, offload, ("default", "offload"))
    assert {r.node for r in changes.rows} == set(moved)
    assert all(r.before == "save" and r.after == "offload" for r in changes.rows)
    assert changes.offloaded_bytes_delta == sum(graph.nodes[n].bytes for n in moved)
    assert "Δ offloaded bytes" in changes.markdown()


def test_explorer_shows_why_policy_fn_cannot_export_offload(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    workload, graph = small_graphs["llama3-debug"]
    ex = PolicyExplorer(graph, "offload", workload=workload, autosave=tmp_path / "p.json")
    assert ex.export_code.startswith("# cannot export as policy_fn: policy_fn: offload")
    with pytest.raises(WorkbenchError, match="not expressible in eager SAC"):
        ex.save_export(str(tmp_path / "ac.py"))
    ex.export_format = "torchtitan"
    assert "--compile.memory_policy sac_and_offload" in ex.export_code


def test_cli_verify_estimate_and_render_take_offload_policies(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def run(*argv: str) -> dict[str, object]:
        assert main([*argv, "--model", "llama3-debug", "--layers", "2", "--seq", "32"]) == 0
        return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]

    policy = Policy("offload", offload=OffloadOptions(prefetch_layers=2, defer_layers=1))
    path = tmp_path / "offload.json"
    policy.save(path)
    verified = run("verify", "--policy", str(path), "--json")
    assert verified["bitwise_equal"] is True
    assert verified["offload"]["offloaded"] > 0  # type: ignore[index]
    assert run("estimate", "--policy", "titan-sac_and_offload", "--json")["peak_bytes"]
    out = tmp_path / "o.svg"
    assert run("render", "--policy", "offload", "--view", "layer:0", "--out", str(out), "--json")
    assert "offloaded for bwd" in out.read_text()


@pytest.mark.parametrize("name", ["offload", "views"])
def test_the_full_path_of_an_offloaded_graph_is_the_whatif(
    small_graphs: dict[str, Fixture], name: str
) -> None:
    """Until offload is priced, the rewritten graph estimates as torch's remat output does."""

    _, graph = small_graphs["llama3-debug"]
    estimator = Estimator(graph, ["h100"])
    result = remat(graph, POLICIES[name])
    assert estimate_remat(graph, result, estimator) == estimator.estimate(result.decisions)


def test_per_rank_graphs_offload_activations_not_collectives() -> None:
    graph = trace(load_workload("llama3-debug", layers=2, seq=32), "fake", Parallel(fsdp=2, tp=2))
    decisions = decide(graph, Policy("offload"))
    moved = [n for n, t in decisions.items() if t.offload]
    assert moved and not any(graph.nodes[n].op.startswith("_c10d") for n in moved)
    plan = remat(graph, Policy("offload")).report.offload
    assert plan is not None and plan.names == moved and not plan.skipped


def test_eager_sac_runs_an_offload_policy_as_its_saving_twin(
    small_graphs: dict[str, Fixture],
) -> None:
    workload, _ = small_graphs["llama3-debug"]
    policy = Policy(
        "offload",
        selectors=[{"select": "layers.*.attention.wo::aten.mm.default", "action": "offload"}],
        overrides={"layers.*.attention.wq::aten.mm.default#0": "offload"},
    )
    twin = policy.without_offload()
    assert twin.preset == "default" and not twin.offloads
    assert [s.action for s in twin.selectors] == ["save"] and set(twin.overrides.values()) == {
        "save"
    }
    assert eager_decisions(workload, policy) == eager_decisions(workload, twin)

    measured = measure_eager(workload, policy, warmup=0, repeats=1)
    assert measured.name == "eager SAC (offload, offload saved)"
