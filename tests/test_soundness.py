"""Every policy the workbench accepts gives eager's loss and gradients bit for bit.

The in-place rule (`rules.save_written_inputs`) on the policy issue 22 found and on a model
built to break each of its three cases, where it is stated (verify, explain, explorer,
exports), eager SAC's side of it, and the property itself: seeded random policies on both
reference models and a per-rank graph, in float32 and bfloat16. Run more by hand with
`SAC_SOUNDNESS_POLICIES=200 python -m pytest tests/test_soundness.py` (per case) or
`python -m workbench verify --model M --random 200 --seed S`.
"""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.trace import trace
from workbench.capture.workload import eager_step
from workbench.cli import main
from workbench.cost.measure import bitwise_equal, bitwise_mismatches
from workbench.decide import engine
from workbench.decide.decider import decide, forced_by_reason, rules_of
from workbench.decide.facts import alias_input, fx_rows, op_facts, written_inputs
from workbench.decide.policy import Policy
from workbench.decide.presets import PRESETS
from workbench.decide.tables import decide_tables, replayed_by
from workbench.decide.tags import Why
from workbench.interop.eager import apply_eager_sac
from workbench.interop.export import export, torchtitan_options
from workbench.interop.titan import WRITTEN_FORCED, compare, explained_by
from workbench.rewrite.remat import remat
from workbench.search.soundness import (
    check_policies,
    check_rank_policies,
    random_policies,
    random_policy,
    run_soundness,
)
from workbench.show.explain import explain, explain_text
from workbench.show.widgets import PolicyExplorer

Fixture = tuple[Workload, JointGraph]
# Random policies per case in CI; set the variable to run hundreds by hand.
COUNT = int(os.environ.get("SAC_SOUNDNESS_POLICIES", "10"))

# The policy of issue 22: graph trainer's `default` recomputes RMSNorm's in-place `add_` of
# eps, and the selectors save the `mean` it writes.
ISSUE_22 = {
    "schema": "sac-workbench/policy",
    "version": 1,
    "preset": "titan-default",
    "selectors": [
        {"select": "layers.*.attention_norm::aten.mean.dim", "action": "save"},
        {"select": "layers.*.ffn_norm::aten.mean.dim", "action": "save"},
    ],
}
# Policies random_policies found unsound before the rule (seed 1 on the 2-layer, 32-token
# graphs; `# model, index`): an offload request the rules refuse saves `mean` as well.
REGRESSIONS = [
    ISSUE_22,
    # llama3-debug, 1
    {
        "schema": "sac-workbench/policy",
        "version": 3,
        "preset": "titan-sac_and_offload",
        "overrides": {
            "layers.*.attention_norm::aten.detach.default#0": "offload",
            "layers.*.attention_norm::aten.mean.dim#0": "offload",
        },
        "offload": {"budget_bytes": None, "prefetch_layers": 2, "defer_layers": 0},
    },
    # llama3-debug, 4
    {
        "schema": "sac-workbench/policy",
        "version": 3,
        "preset": "titan-sac_and_offload",
        "selectors": [
            {"select": "norm::aten.mean.*", "action": "offload"},
            {"select": "**::aten.rsqrt.default", "action": "recompute"},
            {"select": "layers.*.attention::getitem", "action": "recompute"},
        ],
        "overrides": {
            "layers.*.attention::getitem#2": "offload",
            "layers.1.attention.wo::aten.view.default#0": "offload",
            "layers.1.attention::aten.unsqueeze.default#1": "save",
        },
        "offload": {"budget_bytes": None, "prefetch_layers": 0, "defer_layers": 2},
    },
    # llama3-debug, 12 (and dsv3-debug, 13)
    {
        "schema": "sac-workbench/policy",
        "version": 3,
        "preset": "titan-full",
        "selectors": [{"select": "**::aten.add.*", "action": "offload"}],
        "overrides": {
            "layers.*.attention_norm::aten.add_.Scalar#0": "recompute",
            "layers.0.ffn_norm::aten.mean.dim#0": "offload",
            "layers.1.attention_norm::aten.mean.dim#0": "recompute",
            "layers.1.attention_norm::aten.rsqrt.default#0": "save",
        },
    },
    # dsv3-debug, 27
    {
        "schema": "sac-workbench/policy",
        "version": 3,
        "preset": "titan-eager",
        "selectors": [{"select": "norm::aten.mean.*", "action": "offload"}],
        "overrides": {"layers.1.attention_norm::aten.add_.Scalar#0": "recompute"},
        "offload": {"budget_bytes": None, "prefetch_layers": 1, "defer_layers": 2},
    },
]


@pytest.fixture(scope="module")
def bf16_graphs() -> dict[str, Fixture]:
    """The two reference models as `small_graphs`, in bfloat16."""
    result = {}
    for model in ("llama3-debug", "dsv3-debug"):
        workload = load_workload(model, layers=2, seq=32, dtype="bfloat16")
        result[model] = (workload, trace(workload, mode="real"))
    return result


@pytest.fixture(scope="module")
def written() -> Fixture:
    """`user_models.WrittenBlocks`: each layer reads a matmul's output, then writes it."""
    workload = load_workload("user_models:written_blocks")
    return workload, trace(workload, mode="real")


def _written(graph: JointGraph, policy: Policy) -> dict[str, str]:
    return {n: t.detail for n, t in decide(graph, policy).items() if t.why is Why.WRITTEN_INPUT}


# --- the cause and the rule on the issue's policy ------------------------------------------


def test_issue_policy_verifies_bitwise_and_says_what_it_forced(
    small_graphs: dict[str, Fixture], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    workload, graph = small_graphs["llama3-debug"]
    policy = Policy.from_json(ISSUE_22)
    forced = _written(graph, policy)
    # the four norms' `add_` (mean += eps, in place): recomputed from the saved, already
    # written mean, it would add eps twice
    assert sorted(forced) == ["add_", "add__1", "add__2", "add__3"]
    assert forced["add_"].startswith("add_ writes mean, which is not recomputed")
    by_reason = forced_by_reason(decide(graph, policy))
    assert by_reason["written in place"] == 4 and list(by_reason) == [
        why.value for why in Why if why.value in by_reason
    ]
    result = remat(graph, policy)
    assert bitwise_mismatches(graph, result.gm, workload) == []
    path = tmp_path / "issue22.json"
    path.write_text(json.dumps(ISSUE_22))
    args = ["verify", "--model", "llama3-debug", "--layers", "2", "--seq", "32"]
    assert main([*args, "--policy", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bitwise_equal"] and out["problems"] == []
    assert out["forced"]["add_"].startswith("written in place (add_ writes mean")


def test_without_the_rule_the_issue_policy_differs(
    small_graphs: dict[str, Fixture], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: the same remat with the rule switched off recomputes add_ and
    the gradients differ (the check can fail)."""
    workload, graph = small_graphs["llama3-debug"]
    monkeypatch.setattr(engine, "save_written_inputs", lambda tags, tables: None)
    rules_of(graph).tables.request_memo.clear()
    decisions = engine.decide_ops(
        op_facts(fx_rows(graph.gm, lambda n: graph.nodes[n.name].module)),
        engine.Request("titan-default", [s.row() for s in Policy.from_json(ISSUE_22).selectors]),
    )
    assert decisions["add_"].recompute
    mismatched = bitwise_mismatches(graph, remat(graph, decisions).gm, workload)
    assert "layers.0.attention_norm.weight" in mismatched


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug"])
@pytest.mark.parametrize("index", range(len(REGRESSIONS)))
def test_regressions_verify_bitwise(
    small_graphs: dict[str, Fixture], bf16_graphs: dict[str, Fixture], model: str, index: int
) -> None:
    for graphs in (small_graphs, bf16_graphs):
        workload, graph = graphs[model]
        (check,) = check_policies(workload, graph, [Policy.from_json(REGRESSIONS[index])])
        assert check.bitwise_equal, (check.mismatched, check.error)


# --- the three cases of the rule, on a model built for them ---------------------------------


def test_every_preset_is_sound_on_a_model_that_writes_what_it_read(written: Fixture) -> None:
    """`b = a * 3; a.mul_(0.5)`: recomputing `b` from the written `a`, recomputing `mul_` on
    a saved `a`, or replaying `mul_` before `b`, each changes the gradients."""
    workload, graph = written
    checks = check_policies(workload, graph, [Policy(p) for p in PRESETS])
    assert [c.policy.preset for c in checks if not c.bitwise_equal] == []
    reads_later = _written(graph, Policy("default"))  # mul_ is saved as an in-place op
    assert sorted(reads_later) == ["mul", "mul_1"]
    assert reads_later["mul"] == (
        "reads addmm, which mul_ writes in place later in forward: its recompute in "
        "backward would read the written value"
    )
    titan = _written(graph, Policy("titan-default"))  # addmm saved, mul_ recomputed
    assert titan["mul_"].startswith("mul_ writes addmm, which is not recomputed")
    replay = _written(graph, Policy("titan-full"))  # all recomputed: order matters
    assert sorted(replay) == ["mul", "mul_1"]
    assert "no data path between them" in replay["mul"]


@pytest.mark.parametrize("preset", ["default", "titan-default", "titan-full"])
def test_each_case_fails_without_the_rule(
    written: Fixture, preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    workload, graph = written
    monkeypatch.setattr(engine, "save_written_inputs", lambda tags, tables: None)
    rules_of(graph).tables.request_memo.clear()
    (check,) = check_policies(workload, graph, [Policy(preset)])
    assert not check.bitwise_equal


def test_rule_on_rows() -> None:
    """The rule from facts alone: `a` saved, `b` reads it and `w` writes it afterwards."""
    rows = [
        (
            "a",
            "layers.0.f",
            "aten.mm.default",
            False,
            False,
            None,
            ("b", "w"),
            None,
            None,
            ("x",),
            None,
            (),
        ),
        (
            "b",
            "layers.0.f",
            "aten.mul.Tensor",
            False,
            False,
            None,
            ("bw",),
            None,
            None,
            ("a",),
            None,
            (),
        ),
        (
            "w",
            "layers.0.f",
            "aten.mul_.Tensor",
            False,
            True,
            None,
            ("bw",),
            None,
            None,
            ("a",),
            "a",
            ("a",),
        ),
    ]
    facts = op_facts(rows)
    tables = decide_tables(facts)
    assert tables.writes.root == {"a": "a", "b": "b", "w": "a"}
    assert tables.writes.writes == {"a": [(2, "w")]} and tables.writes.readers == ("b", "w")
    assert engine.written_later_keys(tables) == {"layers.0.f::aten.mm.default#0"}
    # saves the mm, recomputes b, w forced saved
    tags = engine.decide_ops(facts, engine.Request("default"))
    assert tags["b"].why is Why.WRITTEN_INPUT and tags["b"].forced
    assert tags["b"].policy is CheckpointPolicy.MUST_SAVE
    # also recomputes w on the saved a
    titan = engine.decide_ops(facts, engine.Request("titan-default"))
    assert titan["w"].why is Why.WRITTEN_INPUT and "second time" in titan["w"].detail
    assert replayed_by(titan, tables.by_name)("b") is False  # saved now


def test_alias_and_written_inputs_read_the_schema(written: Fixture) -> None:
    """From the traced graph's fake tensors and the ops' schemas: a view and an in-place op
    share their input's storage, and only the in-place op writes it."""
    _, graph = written
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    assert alias_input(nodes["addmm"]) is None and written_inputs(nodes["mul"]) == ()
    assert alias_input(nodes["mul_"]) == "addmm"
    assert written_inputs(nodes["mul_"]) == ("addmm",)
    assert alias_input(nodes["t"]) == nodes["t"].all_input_nodes[0].name  # a view
    assert written_inputs(nodes["t"]) == ()


# --- where the forced decision is stated ----------------------------------------------------


def test_explain_lists_the_saves_and_the_step(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["llama3-debug"]
    result = explain(Policy.from_json(ISSUE_22), graph)
    assert [r["node"] for r in result["written_in_place"]] == ["add_", "add__1", "add__2", "add__3"]
    assert result["decisions_by_reason"]["written in place"] == {
        "save": 4,
        "recompute": 0,
        "offload": 0,
    }
    assert any("would not see what forward saw" in step for step in result["steps"])
    assert "saved, written in place: add_ (layers.0.attention_norm): add_ writes mean" in (
        explain_text(result)
    )
    mismatches = {m.node: m for m in compare(graph, Policy.from_json(ISSUE_22))}
    assert explained_by(mismatches["add_"], "titan-default") == WRITTEN_FORCED.key


def test_explorer_shows_the_forced_save_a_flip_causes(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    workload, graph = small_graphs["llama3-debug"]
    ex = PolicyExplorer(graph, "titan-default", workload=workload, autosave=tmp_path / "p.json")
    ex.flip("mean")  # recompute -> save: its add_ may no longer be recomputed
    assert "mean is now saved" in ex.message
    assert "forced in turn: add_, add__2 saved (written in place (add_ writes mean" in ex.message
    ex.select("add_")
    assert not ex.details["can_flip"] and "written in place" in ex.details["reason"]
    policy = dict(ex.policy_json)
    ex.click(f"n-{'add_'}")
    assert "cannot flip" in ex.message and ex.policy_json == policy


def test_exports_state_it(
    small_graphs: dict[str, Fixture], written: Fixture, tmp_path: Path
) -> None:
    workload, graph = small_graphs["llama3-debug"]
    code = export(Policy.from_json(ISSUE_22), "graph_pass", graph)
    assert "# Saved, written in place: add_ (layers.0.attention_norm): add_ writes mean" in code
    namespace: dict[str, object] = {"__name__": "exported"}
    exec(compile(code, "<graph_pass>", "exec"), namespace)
    gm = namespace["tag_graph"](remat.__globals__["copy_graph_module"](graph.gm))  # type: ignore[operator]
    tags = {n.name: n.meta.get("recompute") for n in gm.graph.nodes if "recompute" in n.meta}
    assert tags["add_"] is CheckpointPolicy.MUST_SAVE  # the job forces the same save
    _, wgraph = written
    options = torchtitan_options(Policy("titan-default"), wgraph)
    assert "cannot express a sound run on this graph: graph trainer's own 'default'" in options
    assert "cannot express a sound run" not in torchtitan_options(Policy("default"), graph)


def test_eager_sac_recomputes_what_forward_writes_later(
    small_graphs: dict[str, Fixture], written: Fixture
) -> None:
    """torch's SAC refuses a cached tensor written after caching ("... has been mutated"):
    with the traced graph, the export recomputes those ops, and eager SAC equals eager."""
    for (workload, graph), policy in (
        (small_graphs["llama3-debug"], Policy.from_json(ISSUE_22)),
        (written, Policy("default")),
    ):
        reference = eager_step(workload)
        model = apply_eager_sac(copy.deepcopy(workload.model), policy, graph=graph)
        sac = Workload(model, workload.inputs, workload.target, workload.loss_fn, workload.name)
        assert all(bitwise_equal(a, b) for a, b in zip(eager_step(sac), reference, strict=True))
        unknown = apply_eager_sac(copy.deepcopy(workload.model), policy)  # no graph
        blind = Workload(unknown, workload.inputs, workload.target, workload.loss_fn, "x")
        with pytest.raises(RuntimeError, match="mutated"):
            eager_step(blind)
    assert "WRITTEN_LATER: frozenset[str] = frozenset()" in export(Policy("default"), "policy_fn")


# --- the property: random policies, bitwise -------------------------------------------------


def test_random_policies_are_seeded_and_apply(small_graphs: dict[str, Fixture]) -> None:
    _, graph = small_graphs["dsv3-debug"]
    first = random_policies(graph, 8, seed=3)
    assert [p.to_json() for p in first] == [p.to_json() for p in random_policies(graph, 8, 3)]
    for policy in first:
        decide(graph, policy)  # validates: every selector and override names a node
    presets = {random_policy(graph, random.Random(i)).preset for i in range(60)}
    assert presets == set(PRESETS)


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_policies_verify_bitwise(
    small_graphs: dict[str, Fixture], bf16_graphs: dict[str, Fixture], model: str, dtype: str
) -> None:
    workload, graph = (small_graphs if dtype == "float32" else bf16_graphs)[model]
    seed = {"llama3-debug": 11, "dsv3-debug": 12}[model]
    report = run_soundness(workload, graph, COUNT, seed)
    assert [(c.index, c.mismatched, c.error) for c in report.failures] == []
    assert len(report.checks) == COUNT


# Found by the per-rank property (float32, seed 7, index 15): the bf16 cast of a sequence-
# parallel norm's output, offloaded and freed (defer 0) after its all-gather's call but
# before the all-gather's wait: gloo read freed memory and the rank died of a segfault.
COLLECTIVE_INPUT_OFFLOAD = Policy(
    "default", overrides={"layers.*.attention_norm::aten._to_copy.default#2": "offload"}
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_policies_verify_bitwise_on_every_rank(dtype: str) -> None:
    """One rank's graph names the policies; each of the four gloo ranks (FSDP2 x TP2) runs
    them all against its eager step, after the issue's policy and the collective's input."""
    parallel = Parallel(fsdp=2, tp=2)
    shape = {"layers": 2, "seq": 32, "dtype": dtype}
    workload = load_workload("llama3-debug", device="meta", **shape)  # type: ignore[arg-type]
    graph = trace(workload, "fake", parallel, kernels="cpu")  # the kernels the gloo ranks run
    fixed = [Policy.from_json(ISSUE_22)]
    if dtype == "float32":  # a bfloat16 model has no cast to offload there
        fixed.append(COLLECTIVE_INPUT_OFFLOAD)
    policies = [*fixed, *random_policies(graph, max(COUNT // 2, 4), 21)]
    checks = check_rank_policies("llama3-debug", parallel, policies, **shape)  # type: ignore[arg-type]
    assert len(checks) == 4 * len(policies)
    assert [(c.rank, c.index, c.mismatched, c.error) for c in checks if not c.bitwise_equal] == []


def test_verify_random_cli(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["verify", "--model", "dsv3-debug", "--layers", "2", "--seq", "32"]
    assert main([*args, "--random", "3", "--seed", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policies"] == 3 and out["bitwise_equal"] and out["seed"] == 5
    assert out["failures"] == [] and "random op" in out["forced_by_reason"]
    # bad values of --random and --seed: tests/test_bad_inputs.py
