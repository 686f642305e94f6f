"""Policies: presets, selectors, overrides, forced saves, layer boundaries, JSON, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.decide import presets
from workbench.decide.decider import (
    decidable,
    decide,
    flip,
    layer_key,
    node_keys,
    restrict,
    validate,
)
from workbench.decide.facts import OpFacts
from workbench.decide.policy import SCHEMA_VERSION, Policy, Selector, parse_policy
from workbench.decide.presets import (
    COMPUTE_INTENSIVE_OPS,
    GRAPH_TRAINER,
    PRESETS,
    preset_rule,
    register_preset,
)
from workbench.errors import WorkbenchError

Fixture = tuple[Workload, JointGraph]
SDPA_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


def recompute_ops(graph: JointGraph, policy: Policy) -> dict[str, bool]:
    return {n: d.recompute for n, d in decide(graph, policy).items()}


def test_only_forward_and_loss_nodes_are_decided(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    decisions = decide(graph, Policy("full"))
    assert set(decisions) == {i.name for i in graph.nodes.values() if decidable(i)}
    assert all(graph.nodes[n].phase in ("forward", "loss") for n in decisions)


def test_none_saves_everything(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    assert not any(recompute_ops(graph, Policy("none")).values())


def test_full_recomputes_all_but_forced(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    decisions = decide(graph, Policy("full"))
    saved = [d for d in decisions.values() if not d.recompute]
    assert saved and all(d.forced for d in saved)
    assert all(
        d.policy is CheckpointPolicy.PREFER_RECOMPUTE for d in decisions.values() if d.recompute
    )


def test_default_saves_compute_intensive_ops(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    for name, decision in decide(graph, Policy("default")).items():
        info = graph.nodes[name]
        if info.op in COMPUTE_INTENSIVE_OPS:
            assert not decision.recompute, name
        elif not decision.forced:
            assert decision.recompute, name
            assert decision.reason == "preset:default"


def test_eager_recomputes_every_second_mm_per_layer(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    decisions = decide(graph, Policy("eager"))
    for layer in range(6):
        mms = [
            n
            for n, i in graph.nodes.items()
            if i.layer == layer and i.op == "aten.mm.default" and n in decisions
        ]
        assert len(mms) == 7  # wq wk wv wo w1 w3 w2
        assert [decisions[n].recompute for n in mms] == [False, True] * 3 + [False]
    outside = [n for n in decisions if graph.nodes[n].layer is None]
    assert outside and not any(decisions[n].recompute for n in outside)


def test_random_ops_are_forced_saves_with_a_reason(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    key = next(k for n, k in node_keys(graph).items() if graph.nodes[n].is_random)
    decisions = decide(graph, Policy("full", overrides={key: "recompute"}))
    random = [n for n in decisions if graph.nodes[n].is_random]
    assert len(random) == 6
    for name in random:
        assert decisions[name].policy is CheckpointPolicy.MUST_SAVE
        assert "random op" in decisions[name].reason


def test_layer_boundary_saves(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    decisions = decide(graph, Policy("full"))
    boundary = [n for n, d in decisions.items() if "layer boundary" in d.reason]
    assert boundary
    for node in graph.gm.graph.nodes:
        d = decisions.get(node.name)
        if d is None or not d.recompute:
            continue
        layer = graph.nodes[node.name].layer
        for user in node.users:
            other = decisions.get(user.name)
            assert not (other and other.recompute and graph.nodes[user.name].layer != layer)


def test_getitem_follows_its_multi_output_parent(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    decisions = decide(graph, Policy("full"))
    for node in graph.gm.graph.nodes:
        if node.name in decisions and graph.nodes[node.name].op == "getitem":
            parent = decisions[node.args[0].name]
            assert decisions[node.name].recompute == parent.recompute


def test_selectors_force_and_later_ones_win(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    policy = Policy(
        "default",
        selectors=[
            Selector("layers.*.attention.**::aten.mm.default", "recompute"),
            Selector("layers.*.attention.wo::aten.mm.default", "save"),
        ],
    )
    decisions = decide(graph, policy)
    for name, decision in decisions.items():
        info = graph.nodes[name]
        if info.op != "aten.mm.default" or info.layer is None:
            continue
        if info.module.endswith("attention.wo"):
            assert decision.policy is CheckpointPolicy.MUST_SAVE
        elif ".attention." in info.module:
            assert decision.policy is CheckpointPolicy.MUST_RECOMPUTE
            assert decision.reason == "selector:layers.*.attention.**::aten.mm.default"


def test_overrides_apply_to_all_layers_or_one(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    keys = node_keys(graph)
    w1 = [n for n, k in keys.items() if k == "layers.*.feed_forward.w1::aten.mm.default#0"]
    assert len(w1) == 6
    every = decide(graph, Policy("default", overrides={keys[w1[0]]: "recompute"}))
    assert all(every[n].policy is CheckpointPolicy.MUST_RECOMPUTE for n in w1)
    one_key = layer_key(graph.nodes[w1[2]], keys[w1[2]])
    assert one_key == "layers.2.feed_forward.w1::aten.mm.default#0"
    both = {keys[w1[0]]: "recompute", one_key: "save"}
    mixed = decide(graph, Policy("default", overrides=both))
    assert [mixed[n].recompute for n in w1] == [True, True, False, True, True, True]


def test_keys_are_stable_across_traces(llama_debug: Fixture) -> None:
    from workbench.capture.models import load_workload
    from workbench.capture.trace import trace

    _, graph = llama_debug
    again = trace(load_workload("llama3-debug", layers=2, seq=16), mode="real")
    first = set(node_keys(graph).values())
    assert set(node_keys(again).values()) <= first  # fewer layers, the same keys


def test_json_round_trip_and_schema(tmp_path: Path) -> None:
    policy = Policy(
        "eager",
        selectors=[Selector("layers.*.attention.wo::aten.mm.default", "save")],
        overrides={"layers.*.attention::aten.mul.Tensor#2": "recompute"},
    )
    data = policy.to_json()
    # version 1 while fsdp_reshard keeps its default: older workbenches still read it
    assert data["schema"] == "sac-workbench/policy" and data["version"] == 1 < SCHEMA_VERSION
    assert Policy.from_json(json.loads(json.dumps(data))) == policy
    path = policy.save(tmp_path / "p.json")
    assert Policy.load(path) == policy
    assert parse_policy(str(path)) == policy
    assert parse_policy("full") == Policy("full")
    # the same JSON as --policy's text, as a command line carries it (validate's rows)
    assert parse_policy(" " + json.dumps(data, separators=(",", ":"))) == policy


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"preset": "full"', r"^--policy JSON is not valid JSON: "),
        ('{"preset": "full"}', r"^--policy JSON: not a workbench policy \(schema must be"),
        (
            '{"schema": "sac-workbench/policy", "version": 1, "preset": "ful"}',
            r"^--policy JSON: unknown preset 'ful' \(did you mean 'full'\?\)",
        ),
    ],
)
def test_policy_text_is_checked_as_a_file_is(text: str, message: str) -> None:
    with pytest.raises(WorkbenchError, match=message):
        parse_policy(text)


def test_save_never_overwrites_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text("user's work")
    with pytest.raises(WorkbenchError, match="exists"):
        Policy("full").save(path)
    assert path.read_text() == "user's work"
    Policy("full").save(path, overwrite=True)
    assert Policy.load(path) == Policy("full")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not valid JSON: .* line 1, column 2"),
        ("[]", "a policy is a JSON object"),
        ('{"schema": "other"}', "not a workbench policy"),
        ('{"schema": "sac-workbench/policy", "version": 99}', "version 99 is newer"),
        (
            '{"schema": "sac-workbench/policy", "version": 1, "preset": "fll"}',
            "did you mean 'full'",
        ),
        ('{"schema": "sac-workbench/policy", "version": 1, "extra": 1}', "unknown policy fields"),
        (
            '{"schema": "sac-workbench/policy", "version": 1, "selectors": [{"select": "x"}]}',
            "must be an object with exactly the fields",
        ),
        (
            '{"schema": "sac-workbench/policy", "version": 1, "overrides": {"a::b#0": "keep"}}',
            "must be one of",
        ),
    ],
)
def test_bad_policy_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(WorkbenchError, match=message):
        Policy.load(path)
    assert path.read_text() == text  # never rewritten


def test_unknown_preset_and_missing_file() -> None:
    with pytest.raises(WorkbenchError, match="one of none, full, default, eager, offload, titan-"):
        parse_policy("selective")
    with pytest.raises(WorkbenchError, match="cannot read policy file"):
        parse_policy("missing/policy.json")
    assert set(PRESETS) == {"none", "full", "default", "eager", "offload"} | {
        f"titan-{name}" for name in ("default", "full", "eager", "sac_and_offload")
    }


def test_preset_registry_lists_what_is_available_and_derives_its_traits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="unknown preset 'x'; available: none, full, default, "):
        preset_rule("x")
    assert preset_rule("none")(None) is CheckpointPolicy.PREFER_SAVE  # type: ignore[arg-type]
    titan = [name for name, p in PRESETS.items() if p.dialect == GRAPH_TRAINER]
    assert titan == [p for p in PRESETS if p.startswith("titan-")]
    offloads = {name: p.offloads for name, p in PRESETS.items() if p.offloads is not None}
    assert offloads == {"offload": "default", "titan-sac_and_offload": "titan-default"}
    monkeypatch.setattr(presets, "PRESETS", dict(presets.PRESETS))  # a registry of its own

    @register_preset("titan-mine", dialect=GRAPH_TRAINER, offloads="titan-full")
    def mine() -> presets.Rule:
        """Recompute everything (a test preset)."""
        return lambda facts: CheckpointPolicy.MUST_RECOMPUTE

    assert presets.PRESETS["titan-mine"].rule is mine
    assert presets.PRESETS["titan-mine"].dialect == GRAPH_TRAINER
    assert presets.PRESETS["titan-mine"].offloads == "titan-full"
    with pytest.raises(ValueError, match="'titan-mine' is registered twice"):
        register_preset("titan-mine")(mine)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            Policy(selectors=[Selector("layers.*.atention.wo::aten.mm.default", "save")]),
            "no module matches 'layers.*.atention.wo' .*layers.*.attention.wo",
        ),
        (
            Policy(selectors=[Selector("layers.*.attention.wo::aten.mm", "save")]),
            "must be an OpOverload such as aten.mm.default .*aten.mm.default",
        ),
        (
            Policy(selectors=[Selector("layers.*.attention.wo::aten.silu.default", "save")]),
            "never together",
        ),
        (
            Policy(overrides={"layers.*.feed_forward.w1::aten.mm.default#7": "save"}),
            "names no forward node .*close matches",
        ),
        (
            Policy(overrides={f"layers.*.attention::{SDPA_BACKWARD}#0": "save"}),
            "names a backward node",
        ),
    ],
)
def test_bad_selectors_and_overrides(llama_debug: Fixture, policy: Policy, message: str) -> None:
    _, graph = llama_debug
    with pytest.raises(WorkbenchError, match=message):
        validate(graph, policy)


def test_malformed_selector() -> None:
    with pytest.raises(WorkbenchError, match="must be MODULE_PATTERN::OP_OVERLOAD"):
        Selector("layers.*.attention.wo", "save")
    with pytest.raises(WorkbenchError, match="action 'keep'"):
        Selector("a::b", "keep")  # type: ignore[arg-type]


def test_flip_reverses_one_op_in_every_identical_layer(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    policy = Policy("default")
    before = decide(graph, policy)
    node = next(n for n, d in before.items() if graph.nodes[n].op == "aten.mm.default")
    flipped = flip(graph, policy, node, decisions=before)
    after = decide(graph, flipped)
    key = node_keys(graph)[node]
    same_op = [n for n, k in node_keys(graph).items() if k == key]
    assert len(same_op) == graph.config["layers"] and all(after[n].recompute for n in same_op)
    assert {n for n in before if before[n] != after[n]} <= set(same_op) | {
        n
        for n in after
        if after[n].forced  # a boundary rule may follow the flip
    }
    assert policy.overrides == {} and flipped.overrides == {key: "recompute"}
    back = flip(graph, flipped, node)
    assert all(not d.recompute for n, d in decide(graph, back).items() if n in same_op)


def test_flip_in_one_layer_only(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    policy = Policy("default")
    node = next(
        n
        for n, d in decide(graph, policy).items()
        if graph.nodes[n].op == "aten.mm.default" and graph.nodes[n].layer == 2
    )
    after = decide(graph, flip(graph, policy, node, all_layers=False))
    key = node_keys(graph)[node]
    changed = [n for n, k in node_keys(graph).items() if k == key and after[n].recompute]
    assert changed == [node]
    # an all-layer flip of the same op replaces the layer-specific override
    both = flip(graph, flip(graph, policy, node, all_layers=False), node, all_layers=True)
    assert list(both.overrides) == [key]


def test_flip_refuses_backward_and_forced_nodes(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    decisions = decide(graph, Policy("full"))
    backward = next(i.name for i in graph.nodes.values() if i.phase == "backward")
    with pytest.raises(WorkbenchError, match="backward node: only forward and loss"):
        flip(graph, Policy("full"), backward)
    forced = next(n for n, d in decisions.items() if d.forced)
    with pytest.raises(WorkbenchError, match="must be saved .*cannot flip"):
        flip(graph, Policy("full"), forced, decisions=decisions)
    with pytest.raises(WorkbenchError, match="no node 'nope'"):
        flip(graph, Policy("full"), "nope")


def test_restrict_keeps_what_applies_and_lists_the_rest(llama_debug: Fixture) -> None:
    _, graph = llama_debug
    stale = Policy(
        "eager",
        [
            Selector("layers.*.attention.wo::aten.mm.default", "save"),
            Selector("layers.*.moe.router::aten.mm.default", "save"),
        ],
        {
            "layers.*.attention::aten.mul.Tensor#0": "save",
            "layers.9.attention::aten.mul.Tensor#0": "save",
        },
    )
    kept, dropped = restrict(graph, stale)
    assert [s.select for s in kept.selectors] == ["layers.*.attention.wo::aten.mm.default"]
    assert kept.overrides == {"layers.*.attention::aten.mul.Tensor#0": "save"}
    assert len(dropped) == 2 and "layers.*.moe.router" in dropped[0] and "layers.9" in dropped[1]
    assert restrict(graph, kept) == (kept, [])


# --- a new preset is one registration ------------------------------------------------------

NEW_PRESET = "test-save-matmuls"


def test_a_preset_registered_once_is_seen_everywhere(
    small_graphs: dict[str, Fixture], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One `register_preset` here, nothing else touched: the policy file, `decide`, `policy
    explain` (the CLI's too), the three exports (the Python ones carry the registration and
    decide as `decide` does in a namespace of their own) and the explorer's preset list all
    know it; unregistered, it is gone again."""
    from workbench.cli import main
    from workbench.decide.engine import STEPS
    from workbench.decide.facts import MATMUL_OPS
    from workbench.interop.export import export
    from workbench.rewrite.remat import copy_graph_module
    from workbench.show.explain import explain, explain_text
    from workbench.show.widgets import PolicyExplorer

    _, graph = small_graphs["llama3-debug"]
    assert NEW_PRESET not in PRESETS

    @register_preset(  # self-contained: the Python exports carry this source verbatim
        "test-save-matmuls",
        memory_policy="default",
        memory_policy_note="a test's preset: only the matmuls of torchtitan's save list.",
        differences=("in-place",),
    )
    def _save_matmuls() -> presets.Rule:
        """Save the matmuls, recompute the rest (a preset a test registers)."""

        def rule(facts: OpFacts) -> CheckpointPolicy:
            if facts.op in MATMUL_OPS:
                return CheckpointPolicy.PREFER_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return rule

    try:
        policy = parse_policy(NEW_PRESET)
        path = policy.save(tmp_path / "policy.json")
        assert Policy.load(path) == Policy.from_json(policy.to_json()) == policy
        decisions = decide(graph, policy)
        matmuls = [n for n, i in graph.nodes.items() if i.op in MATMUL_OPS and n in decisions]
        assert matmuls and all(decisions[n].explanation == f"preset:{NEW_PRESET}" for n in matmuls)

        result = explain(policy)
        assert result["kind"] == "workbench" and result["graph_trainer_counterpart"] == "default"
        assert result["rule"] == "Save the matmuls, recompute the rest (a preset a test registers)."
        assert result["steps"] == [step.words for step in STEPS]
        assert [d["key"] for d in result["differences"]] == ["in-place"]
        assert "differs from graph trainer's `default` (`titan-default` here)" in (
            explain_text(result)
        )
        assert main(["policy", "explain", "--policy", NEW_PRESET, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["preset"] == NEW_PRESET

        options = export(policy, "torchtitan", graph).splitlines()
        assert "--compile.memory_policy default" in options
        assert any("a test's preset: only the matmuls" in line for line in options)
        namespaces: dict[str, dict[str, Any]] = {}
        for fmt in ("graph_pass", "policy_fn"):
            namespaces[fmt] = {"__name__": "exported"}
            exec(compile(export(policy, fmt, graph), f"<{fmt}>", "exec"), namespaces[fmt])
            assert NEW_PRESET in namespaces[fmt]["PRESETS"]
        gm = namespaces["graph_pass"]["tag_graph"](copy_graph_module(graph.gm))
        tagged = {n.name: n.meta.get("recompute") for n in gm.graph.nodes if n.name in decisions}
        assert tagged == {n: t.policy for n, t in decisions.items()}

        explorer = PolicyExplorer(graph, NEW_PRESET, autosave=tmp_path / "explorer.json")
        assert NEW_PRESET in explorer.presets and explorer.policy_json["preset"] == NEW_PRESET
    finally:
        del PRESETS[NEW_PRESET]
    assert NEW_PRESET not in PolicyExplorer(graph, autosave=tmp_path / "after.json").presets
    with pytest.raises(WorkbenchError, match=f"unknown preset '{NEW_PRESET}'"):
        Policy(NEW_PRESET)
