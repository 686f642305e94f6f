"""The explorer's policy state in plain Python: the current policy with undo and redo, its
decisions and their what-if estimate, each computed once per change.

Entry points: `PolicyState(graph, estimator, policy)` (`change`, `undo`, `redo`, `estimate`,
`preset_decisions`), `Edits` (the undo and redo stacks alone), `policy_label` and
`start_policy`.
"""

from __future__ import annotations

from typing import Any

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimate, Estimator
from workbench.decide.decider import Decisions, decide
from workbench.decide.policy import Policy
from workbench.decide.presets import PRESETS
from workbench.errors import WorkbenchError

__all__ = ["Edits", "PolicyState", "policy_label", "start_policy"]


class Edits:
    """The current policy with undo and redo stacks; a new change clears redo."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._undo: list[Policy] = []
        self._redo: list[Policy] = []

    @property
    def can_undo(self) -> bool:
        return bool(self._undo)

    @property
    def can_redo(self) -> bool:
        return bool(self._redo)

    def change(self, policy: Policy) -> bool:
        """Make `policy` current (undoable); False when it equals the current one."""
        if policy == self.policy:
            return False
        self._undo.append(self.policy)
        self._redo.clear()
        self.policy = policy
        return True

    def undo(self) -> Policy:
        if not self._undo:
            raise WorkbenchError("nothing to undo")
        self._redo.append(self.policy)
        self.policy = self._undo.pop()
        return self.policy

    def redo(self) -> Policy:
        if not self._redo:
            raise WorkbenchError("nothing to redo")
        self._undo.append(self.policy)
        self.policy = self._redo.pop()
        return self.policy


def policy_label(policy: dict[str, Any]) -> str:
    """`eager + 3 edits`: the preset and how many selectors and overrides sit on it."""
    changes = len(policy["selectors"]) + len(policy["overrides"])
    return policy["preset"] + (f" + {changes} edits" if changes else "")


def start_policy(policy: Policy | str) -> Policy:
    """The policy an explorer opens with, from a preset name or a Policy.

    >>> start_policy("eager").preset
    'eager'
    """
    if not isinstance(policy, Policy | str):
        raise TypeError(
            f"policy must be a preset name ({', '.join(PRESETS)}) or a Policy, got {policy!r}"
        )
    return Policy(policy) if isinstance(policy, str) else policy


class PolicyState:
    """The policy an explorer shows, with undo and redo: its decisions are made when it
    becomes current (a policy the rules refuse changes nothing), its what-if estimate under
    the policy's offload options (prefetch, defer) on first use."""

    def __init__(self, graph: JointGraph, estimator: Estimator, policy: Policy) -> None:
        self.graph = graph
        self.estimator = estimator
        self.edits = Edits(policy)
        self.decisions: Decisions = decide(graph, policy)
        self._estimate: Estimate | None = None
        self._preset_decisions: dict[tuple[str, bool], Decisions] = {}

    @property
    def policy(self) -> Policy:
        return self.edits.policy

    @property
    def can_undo(self) -> bool:
        return self.edits.can_undo

    @property
    def can_redo(self) -> bool:
        return self.edits.can_redo

    @property
    def estimate(self) -> Estimate:
        """The what-if estimate of the current decisions, computed once per change."""
        if self._estimate is None:
            order = self.estimator.order_for(self.decisions, self.policy.offload)
            self._estimate = self.estimator.simulate(order)
        return self._estimate

    def change(self, policy: Policy) -> bool:
        """Make `policy` current (undoable); False when it is the current one. Decided
        first, so a policy the rules refuse raises and changes nothing."""
        if policy == self.policy:
            return False
        decisions = decide(self.graph, policy)
        self.edits.change(policy)
        self._decided(decisions)
        return True

    def undo(self) -> Policy:
        self._decided(decide(self.graph, self.edits.undo()))
        return self.policy

    def redo(self) -> Policy:
        self._decided(decide(self.graph, self.edits.redo()))
        return self.policy

    def renew(self) -> None:
        """Estimate again on next use (after a change the decisions do not show)."""
        self._estimate = None

    def preset_decisions(self) -> Decisions:
        """What the current policy's preset alone (with its FSDP choice) decides."""
        key = (self.policy.preset, self.policy.fsdp_reshard)
        if key not in self._preset_decisions:
            preset = Policy(key[0], fsdp_reshard=key[1])
            self._preset_decisions[key] = decide(self.graph, preset)
        return self._preset_decisions[key]

    def _decided(self, decisions: Decisions) -> None:
        self.decisions = decisions
        self._estimate = None
