"""What each policy control of the explorer makes of the current policy: pure functions from
a `Policy` to the edited one, each checked before anything changes, each keeping the fields
it does not edit (the FSDP choice, the offload options).

Entry points: `edited`, `with_selector`, `op_switch`, `without_selector`,
`with_selector_action`, `with_override`, `with_offload`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.decide.decider import validate
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import ACTIONS, Policy, Selector, offload_options
from workbench.errors import WorkbenchError

__all__ = [
    "edited",
    "op_switch",
    "with_offload",
    "with_override",
    "with_selector",
    "with_selector_action",
    "without_selector",
]


def edited(policy: Policy, **changes: Any) -> Policy:
    """`policy` with some fields changed and fresh copies of its selectors and overrides."""
    current = {"selectors": list(policy.selectors), "overrides": dict(policy.overrides)}
    return dataclasses.replace(policy, **{**current, **changes})


def with_selector(graph: JointGraph, policy: Policy, select: str, action: str) -> Policy:
    """`MODULE::OP` given `action` wherever it matches (later selectors win); a pattern that
    matches nothing in `graph` is refused."""
    selector = Selector(select, action)  # type: ignore[arg-type]
    result = edited(policy, selectors=[*policy.selectors, selector])
    validate(graph, result)
    return result


def op_switch(module: str, op: str, action: str) -> str:
    """The selector that gives every `op` under `module` the same `action`.

    >>> op_switch("layers.*.attention", "aten.mm.default", "save")
    'layers.*.attention.**::aten.mm.default'
    """
    if action not in ACTIONS:
        raise WorkbenchError(f"action {action!r} must be one of {ACTIONS}")
    pattern = module if module.endswith("**") else f"{module}.**" if module else "**"
    return f"{pattern}::{op}"


def _selectors_with(policy: Policy, index: int) -> list[Selector]:
    selectors = list(policy.selectors)
    if not 0 <= index < len(selectors):
        raise WorkbenchError(f"no selector #{index}; there are {len(selectors)}")
    return selectors


def without_selector(policy: Policy, index: int) -> Policy:
    selectors = _selectors_with(policy, index)
    del selectors[index]
    return edited(policy, selectors=selectors)


def with_selector_action(policy: Policy, index: int, action: str) -> Policy:
    """Selector #index with another action (save, recompute or offload)."""
    selectors = _selectors_with(policy, index)
    selectors[index] = Selector(selectors[index].select, action)  # type: ignore[arg-type]
    return edited(policy, selectors=selectors)


def with_override(policy: Policy, key: str, action: str | None) -> Policy:
    """One existing override with another action, or removed (`action=None`)."""
    overrides = dict(policy.overrides)
    if key not in overrides:
        raise WorkbenchError(f"no override {key!r}; the policy has {len(overrides)}")
    if action is None:
        del overrides[key]
    else:
        overrides[key] = action  # type: ignore[assignment]
    return edited(policy, overrides=overrides)


def with_offload(
    policy: Policy, budget_bytes: int | None, prefetch_layers: int, defer_layers: int
) -> Policy:
    """The offload options: host budget (None: no limit), reload N layers early, free the
    device copy M layers late (checked as a policy file's are)."""
    options = offload_options(OffloadOptions(budget_bytes, prefetch_layers, defer_layers))
    return edited(policy, offload=options)
