"""The one rule source: decide(), the exports and the studies all run workbench.decide."""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.capture.ops import module_matches
from workbench.decide import EMBEDDED, engine
from workbench.decide.decider import decide, flip, rules_of
from workbench.decide.engine import (
    STEPS,
    TITAN_STEPS,
    UNTAGGED,
    Request,
    Step,
    apply_overrides,
    decide_ops,
    decide_titan_ops,
    eager_tag,
    follow_leaders,
    forced_save,
    fsdp_tag,
    requested,
    save_layer_boundaries,
    save_written_inputs,
    titan_follows,
    titan_keep_unsharded,
    titan_request,
    titan_untagged,
)
from workbench.decide.facts import OpFacts, op_facts
from workbench.decide.offloadable import (
    OffloadOptions,
    decide_offload,
    kept_for_backward,
    may_offload,
    offload_refusal,
    offload_refusal_in,
)
from workbench.decide.policy import Policy, Selector
from workbench.decide.presets import GRAPH_TRAINER, PRESETS, preset_record
from workbench.decide.tables import decide_tables, last_layer
from workbench.decide.tags import Refusal, Refused, SelectorRow, Tag, Why
from workbench.interop.export import export, rules_source


def test_embedded_rules_import_only_torch_the_stdlib_and_each_other() -> None:
    """Each embedded file imports torch, the standard library and the files before it."""
    for i, name in enumerate(EMBEDDED):
        tree = ast.parse(inspect.getsource(importlib.import_module(name)))
        roots, own = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if module.startswith("workbench"):
                    own.add(module)
                else:
                    roots.add(module.split(".")[0])
        assert roots - {"torch", "__future__"} <= set(sys.stdlib_module_names), name
        assert own <= set(EMBEDDED[:i]), name


@pytest.mark.parametrize("fmt", ["policy_fn", "graph_pass"])
def test_exports_embed_the_rule_source_verbatim(fmt: str) -> None:
    imports, body = rules_source()
    code = export(Policy("eager", overrides={"layers.*::aten.mm.default#0": "save"}), fmt)
    assert body in code
    assert "def decide_ops(" in body and "def eager_tag(" in body and "PRESETS" in body
    assert inspect.getsource(decide_ops) in code
    for statement in imports:  # every import the rules need is there (merged with others)
        for node in ast.parse(statement).body:
            names = [a.name for a in node.names]  # type: ignore[attr-defined]
            assert all(name in code for name in names)


def test_exported_rules_are_the_workbench_rules(
    small_graphs: dict[str, tuple[Workload, JointGraph]],
) -> None:
    """The exported namespace's decide_ops, run on the graph's facts, equals decide()."""
    _, graph = small_graphs["llama3-debug"]
    namespace: dict[str, object] = {"__name__": "exported"}
    exec(compile(export(Policy("eager"), "graph_pass"), "<export>", "exec"), namespace)
    exported_decide = namespace["decide_ops"]
    exported_facts = namespace["op_facts"]
    rows = [tuple(f)[:3] + tuple(f)[6:] for f in rules_of(graph).facts]
    rows = [
        (f.name, f.module, f.op, f.random, f.mutation, f.parent, f.users, f.gather)
        for f in rules_of(graph).facts
    ]
    request = namespace["Request"]("eager")  # type: ignore[operator]
    tags = exported_decide(exported_facts(rows), request)  # type: ignore[operator]
    expected = decide(graph, Policy("eager"))
    assert {n: t.policy for n, t in tags.items()} == {n: d.policy for n, d in expected.items()}


def facts(name: str, module: str, op: str = "aten.mm.default", **kw: object) -> OpFacts:
    row = (
        name,
        module,
        op,
        kw.get("random", False),
        kw.get("mutation", False),
        None,
        kw.get("users", ()),
        None,
    )
    return op_facts([row])[0]  # type: ignore[list-item]


def test_forced_saves_and_layer_boundary() -> None:
    rows = [
        ("a", "layers.0.ff", "aten.mul.Tensor", False, False, None, ("b",), None),
        ("b", "layers.1.ff", "aten.mul.Tensor", False, False, None, (), None),
        ("r", "layers.1.ff", "aten.bernoulli.p", True, False, None, (), None),
        ("m", "layers.1.ff", "aten.add_.Tensor", False, True, None, (), None),
    ]
    tags = decide_ops(op_facts(rows), Request("full"))  # type: ignore[arg-type]
    assert tags["a"].why is Why.LAYER_BOUNDARY and tags["a"].detail == "b"
    assert tags["a"].policy == CheckpointPolicy.MUST_SAVE and tags["a"].forced
    assert tags["b"].recompute and tags["b"].why is Why.PRESET
    assert tags["r"].why is Why.RANDOM and tags["m"].why is Why.MUTATION
    assert tags["a"].reason == "forced:layer boundary (recomputed user b is in another layer)"


def test_overrides_then_followers_and_forced_saves_stay() -> None:
    rows = [
        ("mm", "layers.0.ff", "aten.mm.default", False, False, None, ("g",), None),
        ("g", "layers.0.ff", "getitem", False, False, "mm", (), None),
        ("m", "layers.0.ff", "aten.add_.Tensor", False, True, None, (), None),
    ]
    facts_ = op_facts(rows)  # type: ignore[arg-type]
    tables = decide_tables(facts_)
    asked = {f.name: requested(f, PRESETS["none"].rule(), Request("none")) for f in facts_}
    asked["m"] = Tag(CheckpointPolicy.MUST_SAVE, Why.MUTATION)
    tags = dict(asked)
    overrides = {
        "layers.*.ff::aten.mm.default#0": "recompute",
        "layers.0.ff::aten.mm.default#0": "save",
        "layers.*.ff::aten.add_.Tensor#0": "recompute",
    }
    assert apply_overrides(tags, asked, tables, overrides) == {"mm"}
    assert tags["mm"] == Tag(
        CheckpointPolicy.MUST_SAVE, Why.OVERRIDE, "layers.0.ff::aten.mm.default#0"
    )
    assert tags["m"].why is Why.MUTATION  # forced saves stay
    tags["mm"] = Tag(CheckpointPolicy.MUST_RECOMPUTE, Why.OVERRIDE, "k")
    follow_leaders(tags, asked, tables.leaders, {"mm"})
    assert tags["g"] == tags["mm"]  # the getitem follows its changed leader


def test_graph_trainers_steps_on_one_node() -> None:
    rows = [
        (
            "ag",
            "layers.0.wq",
            "_c10d_functional.all_gather_into_tensor.default",
            False,
            False,
            None,
            ("w",),
            "ag",
        ),
        (
            "w",
            "layers.0.wq",
            "_c10d_functional.wait_tensor.default",
            False,
            False,
            "ag",
            (),
            "ag",
            None,
            ("ag",),
            None,
            (),
            True,
        ),  # the unsharded value
        ("log", "loss", "aten._log_softmax.default", False, False, None, (), None),
        ("sdpa", "layers.0.attention", "aten.bernoulli.p", True, False, None, ("g",), None),
        ("g", "layers.0.attention", "getitem", False, False, "sdpa", (), None),
    ]
    ag, w, log, sdpa, g = op_facts(rows)  # type: ignore[arg-type]
    assert w.unshard_output and not ag.unshard_output
    assert titan_keep_unsharded(w) == fsdp_tag(False)  # only the wait, not its all-gather
    assert titan_keep_unsharded(ag) is None and titan_keep_unsharded(log) is None
    assert titan_untagged(log, Request("titan-full")).why is Why.UNTAGGED  # type: ignore[union-attr]
    selected = titan_untagged(log, Request("titan-full", [("loss", "*", "recompute")]))
    assert selected is not None and selected.why is Why.SELECTOR
    assert titan_untagged(sdpa, Request("titan-full")) is None
    default = PRESETS["titan-default"].rule()  # asks to recompute the random op
    tag = titan_request(sdpa, default, Request("titan-default"))
    assert tag == Tag(CheckpointPolicy.MUST_SAVE, Why.RANDOM)
    assert titan_follows(g, {"sdpa": tag}) == tag and titan_follows(sdpa, {}) is None
    assert titan_follows(w, {}) is UNTAGGED


def test_eager_tag_lets_the_in_place_rule_win_over_random() -> None:
    bernoulli_ = facts("x", "layers.0.dropout", "aten.bernoulli_.float", random=True, mutation=True)
    tag = eager_tag(bernoulli_, PRESETS["none"].rule(), Request("none"))
    assert tag.policy == CheckpointPolicy.PREFER_RECOMPUTE and tag.why is Why.MUTATION


def test_counter_counts_ops_per_module_and_matmuls_per_layer() -> None:
    rows = [
        ("a", "layers.0.wq", "aten.mm.default", False, False, None, (), None),
        ("b", "layers.0.wk", "aten.mm.default", False, False, None, (), None),
        ("c", "layers.0.wk", "aten.mm.default", False, False, None, (), None),
        ("d", "layers.1.wq", "aten.mm.default", False, False, None, (), None),
    ]
    got = [(f.occurrence, f.matmul_index, f.key) for f in op_facts(rows)]  # type: ignore[arg-type]
    assert got == [
        (0, 1, "layers.*.wq::aten.mm.default#0"),
        (0, 2, "layers.*.wk::aten.mm.default#0"),
        (1, 3, "layers.*.wk::aten.mm.default#1"),
        (0, 1, "layers.*.wq::aten.mm.default#0"),
    ]


@pytest.mark.parametrize(
    ("pattern", "module", "expected"),
    [
        ("layers.*.attention", "layers.3.attention", True),
        ("layers.*", "layers.3.attention", False),
        ("**", "", True),
        ("", "", True),
        ("**.wq", "layers.3.attention.wq", True),
        ("layers.**.wq", "layers.wq", True),
        ("layers.**.wk", "layers.3.attention.wq", False),
        ("a.**.**.b", "a.x.y.b", True),
    ],
)
def test_module_matches(pattern: str, module: str, expected: bool) -> None:
    assert module_matches(pattern, module) is expected


def test_module_matching_is_not_combinatorial() -> None:
    """Many `**` against a long path that almost matches: linear, not exponential."""
    pattern = ".".join(["**"] * 200 + ["nope"])
    assert module_matches(pattern, ".".join(["x"] * 200)) is False


def test_doctests() -> None:
    import doctest

    attempted = 0
    for name in EMBEDDED:
        result = doctest.testmod(importlib.import_module(name))
        assert result.failed == 0, name
        attempted += result.attempted
    assert attempted > 0


def _calls(function: Callable[..., Any], inline: dict[str, Callable[..., Any]]) -> list[str]:
    """The names `function` calls, in the order of its source; a call to one of `inline` is
    replaced by the calls in that helper's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    names: list[str] = []
    for call in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
        name = call.func.id  # type: ignore[attr-defined]
        names += _calls(inline[name], inline) if name in inline else [name]
    return names


@pytest.mark.parametrize(
    ("decider", "steps"), [(decide_ops, STEPS), (decide_titan_ops, TITAN_STEPS)]
)
def test_the_recorded_steps_are_the_ones_the_deciders_take_in_order(
    decider: Callable[..., Any], steps: tuple[Step, ...]
) -> None:
    """`STEPS` / `TITAN_STEPS` (what `policy explain` prints) name the functions the deciders
    call, in the order their code first calls them, and each says what it does."""
    inline = {
        "_requests": engine._requests,
        "_titan_requests": engine._titan_requests,
        "_titan_tag": engine._titan_tag,
    }
    calls = _calls(decider, inline)
    names = [step.function.__name__ for step in steps]
    first = [name for i, name in enumerate(calls) if name in names and name not in calls[:i]]
    assert first == names
    assert all(step.words for step in steps)


def _plain_decide(
    facts: list[OpFacts],
    preset: str,
    selectors: list[SelectorRow],
    overrides: dict[str, str],
    fsdp_reshard: bool,
) -> dict[str, Tag]:
    """Graph SAC's tags computed from scratch, node by node, as the rules say: the request
    or a forced save, followers take their leader's tag, then the layer boundaries, then
    the offload step."""
    rule = PRESETS[preset].rule()
    request = Request(preset, selectors, overrides)
    tags: dict[str, Tag] = {}
    for f in facts:
        forced = forced_save(f)
        tag = requested(f, rule, request)
        if forced is not None:
            tag = Tag(CheckpointPolicy.MUST_SAVE, forced)
        elif tag.why is Why.PRESET and f.gather == f.name:
            tag = fsdp_tag(fsdp_reshard)
        tags[f.name] = tag
    for f in facts:
        leader = f.gather if f.gather not in (None, f.name) else f.parent
        if leader is None or leader not in tags or tags[f.name].forced:
            continue
        if leader == f.gather or tags[leader].recompute != tags[f.name].recompute:
            tags[f.name] = tags[leader]
    by_name = {f.name: f for f in facts}
    for f in reversed(facts):
        if not tags[f.name].recompute:
            continue
        for user in f.users:
            other = tags.get(user)
            if other and other.recompute and by_name[user].layer != f.layer:
                tags[f.name] = Tag(CheckpointPolicy.MUST_SAVE, Why.LAYER_BOUNDARY, user)
                break
    decide_offload(facts, tags, PRESETS[preset], OffloadOptions())
    return tags


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug", "llama3-debug-fsdp2-tp2"])
def test_deciding_with_kept_tables_equals_deciding_from_scratch(
    small_graphs_and_rank: dict[str, JointGraph], model: str
) -> None:
    """decide() keeps each graph's decide tables and request tables: after random flips, selector
    and preset changes (more than the tables remember) its tags equal a plain decision."""
    graph = small_graphs_and_rank[model]
    facts = rules_of(graph).facts
    rng = random.Random(3)
    policy = Policy("default")
    selectors = [Selector("**::aten.mm.default", "save"), Selector("layers.1.**::*", "recompute")]
    for step in range(60):
        if step % 10 == 9:  # another preset, selector list or FSDP choice
            preset = rng.choice([p for p in PRESETS if p != policy.preset])
            chosen = rng.sample(selectors, rng.randint(0, 2))
            policy = Policy(preset, chosen, fsdp_reshard=rng.random() < 0.5)
        tags = decide(graph, policy)
        rows, overrides = [s.row() for s in policy.selectors], policy.overrides
        if PRESETS[policy.preset].dialect == GRAPH_TRAINER:
            assert tags == decide_ops(facts, policy.request())
        else:
            assert tags == _plain_decide(facts, policy.preset, rows, overrides, policy.fsdp_reshard)
        name = rng.choice([n for n, t in tags.items() if not t.forced])
        policy = flip(graph, policy, name, all_layers=rng.random() < 0.5, decisions=tags)


def _titan_from_scratch(facts: list[OpFacts], request: Request) -> dict[str, Tag]:
    """Graph trainer's tags with nothing kept: every node asked afresh by its per-node steps
    (a fresh rule counting every node, overrides read on each), then the later steps."""
    preset = PRESETS[request.preset]
    rule, keep = preset.rule(), not request.fsdp_reshard and preset.keeps_unsharded
    tags: dict[str, Tag] = {}
    for f in facts:
        tag = titan_untagged(f, request)
        if tag is None and keep:
            tag = titan_keep_unsharded(f)
        if tag is None:
            tag = titan_follows(f, tags)
        tags[f.name] = tag if tag is not None else titan_request(f, rule, request)
    tables = decide_tables(facts)
    save_layer_boundaries(tags, tables.boundaries[GRAPH_TRAINER])
    save_written_inputs(tags, tables)
    if may_offload(request.preset, request.selectors, request.overrides):
        decide_offload(facts, tags, preset, request.offload, tables)
    return tags


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug", "llama3-debug-fsdp2-tp2"])
def test_graph_trainer_flips_equal_deciding_from_scratch(
    small_graphs_and_rank: dict[str, JointGraph], model: str
) -> None:
    """Graph trainer's dialect keeps its rule's answers and the last overrides' tags, and
    re-tags only the nodes an override change names and their followers: after random
    flips (one layer or every layer), dropped overrides, FSDP and preset changes, its tags
    equal deciding from scratch, `titan-eager`'s counted matmuls included."""
    graph = small_graphs_and_rank[model]
    facts = rules_of(graph).facts
    rng = random.Random(7)
    titan = [p for p in PRESETS if PRESETS[p].dialect == GRAPH_TRAINER]
    policy = Policy("titan-eager")
    redone = 0
    for step in range(80):
        if step % 20 == 19:
            policy = Policy(rng.choice(titan), fsdp_reshard=rng.random() < 0.5)
        elif step % 7 == 6 and policy.overrides:  # an override dropped
            dropped = rng.choice(sorted(policy.overrides))
            overrides = {k: v for k, v in policy.overrides.items() if k != dropped}
            policy = Policy(policy.preset, overrides=overrides, fsdp_reshard=policy.fsdp_reshard)
        tags = decide(graph, policy)
        assert tags == _titan_from_scratch(facts, policy.request()), (step, policy)
        redone += bool(policy.overrides)
        name = rng.choice([n for n, t in tags.items() if not t.forced])
        policy = flip(graph, policy, name, all_layers=rng.random() < 0.5, decisions=tags)
    assert redone > 40  # most decisions started from kept tags


def _plain_offload_refusal(
    facts: list[OpFacts], tags: dict[str, Tag], name: str, preset: str
) -> Refused | None:
    """`offload_refusal_in` from the facts alone: the look-ups built afresh for each node."""
    dialect = preset_record(preset).dialect
    by_name = {f.name: f for f in facts}
    refusal = offload_refusal(by_name[name], last_layer(facts, dialect), dialect)
    if refusal is None and not kept_for_backward(tags, by_name)(by_name[name]):
        return Refused(Refusal.NOT_READ)
    return refusal


@pytest.mark.parametrize("model", ["llama3-debug", "dsv3-debug"])
def test_offload_refusal_through_the_tables_equals_from_the_facts(
    small_graphs_and_rank: dict[str, JointGraph], model: str
) -> None:
    """The tables' kept look-ups give every node the answer the facts give, for graph SAC's
    and graph trainer's rules, whether the node is saved, recomputed or offloaded."""
    graph = small_graphs_and_rank[model]
    facts, tables = rules_of(graph).facts, rules_of(graph).tables
    presets = ["none", "eager", "full", "offload", "titan-default", "titan-sac_and_offload"]
    for preset in presets:
        tags = decide(graph, Policy(preset))
        answers = [offload_refusal_in(tables, tags, f.name, preset) for f in facts]
        assert answers == [_plain_offload_refusal(facts, tags, f.name, preset) for f in facts]
        assert None in answers and any(answers), preset
