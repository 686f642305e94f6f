"""The rules' view of one traced graph, built once and kept beside it: every question the
stages above `decide` ask of the rules goes through it.

Entry points: `rules_of(graph) -> GraphRules` (facts, `DecideTables`, node keys; `decide`,
`offload_refusal`), and on a graph and a policy: `decide`, `validate`, `node_keys`,
`next_action` / `flip` (a click in the explorer) and `restrict` (what of a policy applies).
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from workbench.capture.graph import JointGraph, NodeInfo
from workbench.capture.ops import NodeKey, layer_pattern, module_matches, op_key
from workbench.decide.engine import decide_ops, selector_matches
from workbench.decide.facts import OpFacts, fx_rows, op_facts
from workbench.decide.offloadable import offload_refusal_in
from workbench.decide.policy import Action, Policy
from workbench.decide.tables import DecideTables, decide_tables
from workbench.decide.tags import Refused, Tag, Why
from workbench.errors import WorkbenchError

__all__ = [
    "Decisions",
    "GraphRules",
    "decidable",
    "decide",
    "flip",
    "forced_by_reason",
    "layer_key",
    "next_action",
    "node_keys",
    "restrict",
    "rules_of",
    "validate",
]

# A node's tag and why, by node name, in graph order.
Decisions = dict[str, Tag]


def forced_by_reason(decisions: Decisions) -> dict[str, int]:
    """How many decisions no request can change, by reason (`Why.value`), in `Why` order."""
    counts = collections.Counter(tag.why for tag in decisions.values() if tag.forced)
    return {why.value: counts[why] for why in Why if counts[why]}


def decidable(info: NodeInfo) -> bool:
    """Forward and loss call nodes: the ones whose outputs can be saved or recomputed."""
    return info.phase in ("forward", "loss")


@dataclass(frozen=True, eq=False)
class GraphRules:
    """What the rules derive from one graph's facts alone, and the questions asked of them.
    Holds no reference to the graph (`rules_of` keeps one per graph, weakly)."""

    model_name: str
    facts: list[OpFacts]  # the decidable nodes, in graph order
    tables: DecideTables
    keys: dict[str, str]  # node -> `MODULE::OP#k`, `layers.*` for the op in every layer
    override_keys: frozenset[str]  # what an override may name: keys and per-layer keys
    backward_pairs: frozenset[str]  # `MODULE::OP` of backward ops, for the error
    forward_pairs: frozenset[str]

    def decide(self, policy: Policy) -> Decisions:
        """Every decidable node's tag under `policy` (`decide_ops` on the tables: a flip
        re-decides only the nodes it can change). `validate` the policy first."""
        return decide_ops(self.facts, policy.request(), self.tables)

    def offload_refusal(
        self, name: str, decisions: Mapping[str, Tag], preset: str
    ) -> Refused | None:
        """Why `name` may not be offloaded under `decisions` (None if it may)."""
        return offload_refusal_in(self.tables, decisions, name, preset)

    def validate(self, policy: Policy) -> None:
        """Selectors must match a node and overrides must name a forward node; the error
        names what is wrong and the close matches."""
        for selector in policy.selectors:
            module, op = selector.module_pattern, selector.op_pattern
            if any(selector_matches(module, op, f.module, f.op) for f in self.facts):
                continue
            paths = {f.module for f in self.facts}
            modules = sorted(paths | {layer_pattern(m) for m in paths})
            ops = sorted({f.op for f in self.facts})
            if not any(module_matches(module, m) for m in modules):
                raise WorkbenchError(
                    f"selector {selector.select!r}: no module matches {module!r}"
                    f"{_suggest(module, modules)}"
                )
            if not any(selector_matches("**", op, "", o) for o in ops):
                raise WorkbenchError(
                    f"selector {selector.select!r}: no op matches {op!r}; it must be an "
                    f"OpOverload such as aten.mm.default{_suggest(op, ops)}"
                )
            raise WorkbenchError(
                f"selector {selector.select!r}: module and op both exist, but never together"
            )
        for key in policy.overrides:
            if key in self.override_keys:
                continue
            parsed = NodeKey.parse(key)
            pair = parsed.pair if parsed is not None else key  # `MODULE::OP` without `#k`
            if pair in self.backward_pairs and pair not in self.forward_pairs:
                raise WorkbenchError(
                    f"override {key!r} names a backward node: only forward activations can be "
                    "saved or recomputed"
                )
            raise WorkbenchError(
                f"override {key!r} names no forward node{_suggest(key, self.override_keys)}"
            )


_RULES: weakref.WeakKeyDictionary[JointGraph, GraphRules] = weakref.WeakKeyDictionary()


def rules_of(graph: JointGraph) -> GraphRules:
    """The graph's `GraphRules`, built on first use and kept while the graph lives."""
    if graph not in _RULES:
        facts = op_facts(fx_rows(graph.gm, lambda node: graph.nodes[node.name].module))
        keys = {f.name: f.key for f in facts}
        override_keys = frozenset(keys.values()) | {f.layer_key for f in facts}
        backward = frozenset(
            op_key(module, info.op)
            for info in graph.nodes.values()
            if info.phase == "backward"
            for module in (info.module, layer_pattern(info.module))
        )
        forward = frozenset(NodeKey(f.module, f.op, 0).pair for f in facts) | {
            NodeKey(layer_pattern(f.module), f.op, 0).pair for f in facts
        }
        _RULES[graph] = GraphRules(
            graph.model_name, facts, decide_tables(facts), keys, override_keys, backward, forward
        )
    return _RULES[graph]


def node_keys(graph: JointGraph) -> dict[str, str]:
    """Stable, layer-relative keys `MODULE::OP#k` (k-th such op in that module) for decidable
    nodes; `MODULE` uses `layers.*` so one key names the op in every identical layer."""
    return dict(rules_of(graph).keys)


def layer_key(info: NodeInfo, key: str) -> str:
    """The key naming this node in its own layer only (`layers.3.attention::...`).

    >>> layer_key(NodeInfo("mm", "aten.mm.default", "forward", "layers.3.wq", 3, (), None,
    ...                    0, 0, False, False, False, ""), "layers.*.wq::aten.mm.default#0")
    'layers.3.wq::aten.mm.default#0'
    """
    parsed = NodeKey.parse(key)
    if parsed is None:
        raise WorkbenchError(f"{key!r} is not a node key MODULE::OP#k")
    return parsed.in_module(info.module).text


def validate(graph: JointGraph, policy: Policy) -> None:
    """Selectors must match something and overrides must name forward nodes."""
    rules_of(graph).validate(policy)


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.5)
    return f" (close matches: {', '.join(close)})" if close else ""


def decide(graph: JointGraph, policy: Policy) -> Decisions:
    """The tag of every decidable node, in graph order, by the rules (`decide_ops`, whose
    `STEPS` say in order what it does; `policy explain` reads them).

    MUST_* for overrides, selectors and forced decisions, PREFER_* for preset choices.
    Raises `WorkbenchError` for a selector or override that names nothing in the graph.
    """
    rules = rules_of(graph)
    rules.validate(policy)
    return rules.decide(policy)


def next_action(
    graph: JointGraph, policy: Policy, node: str, decisions: Decisions
) -> tuple[Action, Refused | None]:
    """The decision a flip gives `node`, cycling save -> recompute -> offload -> save, and
    why offload was skipped when the cycle passes over it (None otherwise). Forced saves
    cannot flip: the error says why."""
    current = decisions[node]
    if current.forced:
        raise WorkbenchError(f"{node!r} must be saved ({current.explanation}): it cannot flip")
    if current.offload:
        return "save", None
    if not current.recompute:
        return "recompute", None
    refusal = rules_of(graph).offload_refusal(node, decisions, policy.preset)
    return ("save", refusal) if refusal else ("offload", None)


def flip(
    graph: JointGraph,
    policy: Policy,
    node: str,
    *,
    all_layers: bool = True,
    decisions: Decisions | None = None,
) -> Policy:
    """A new policy with `node`'s decision moved on by an override (`next_action`: save ->
    recompute -> offload where the rules allow it -> save).

    `all_layers` names the op in every identical layer (`layers.*`), replacing any
    layer-specific overrides of it; otherwise only this layer. Backward nodes and forced
    saves cannot flip: the error says why. The policy passed in is not changed.
    """
    info = graph.nodes.get(node)
    if info is None:
        raise WorkbenchError(f"no node {node!r} in the graph of {graph.model_name!r}")
    if not decidable(info):
        raise WorkbenchError(
            f"{node!r} is a {info.phase} node: only forward and loss activations can be saved "
            "or recomputed"
        )
    decisions = decisions if decisions is not None else decide(graph, policy)
    action, _ = next_action(graph, policy, node, decisions)
    key = rules_of(graph).keys[node]
    overrides = dict(policy.overrides)
    if all_layers:
        target = NodeKey.parse(key)
        for other in list(overrides):  # the op's keys in single layers go
            parsed = NodeKey.parse(other)
            if parsed is not None and parsed.in_module(layer_pattern(parsed.module)) == target:
                del overrides[other]
        overrides[key] = action
    else:
        overrides[layer_key(info, key)] = action
    return dataclasses.replace(policy, selectors=list(policy.selectors), overrides=overrides)


def restrict(graph: JointGraph, policy: Policy) -> tuple[Policy, list[str]]:
    """The part of `policy` that applies to `graph`, and a line for each selector or
    override that does not (a policy saved for another model or an older trace)."""
    rules = rules_of(graph)
    selectors, overrides, dropped = [], {}, []
    for selector in policy.selectors:
        try:
            rules.validate(Policy(policy.preset, [selector]))
            selectors.append(selector)
        except WorkbenchError as err:
            dropped.append(str(err))
    for key, action in policy.overrides.items():
        try:
            rules.validate(Policy(policy.preset, overrides={key: action}))
            overrides[key] = action
        except WorkbenchError as err:
            dropped.append(str(err))
    return dataclasses.replace(policy, selectors=selectors, overrides=overrides), dropped
