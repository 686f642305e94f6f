"""The explorer page's actions as data: each request the front end sends (`{"type": NAME,
...fields}`), the method it calls and the fields it carries, each checked before anything
runs, so a malformed request changes nothing and says what is wrong in one line.

Entry points: `ACTIONS` (name -> `Action`), `perform(content, model, widget)` and `field`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.errors import WorkbenchError

__all__ = ["ACTIONS", "Action", "Field", "field", "perform"]

_REQUIRED = object()


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a request: its name, its type and its default (none: required)."""

    name: str
    kind: type
    default: Any = _REQUIRED


@dataclass(frozen=True, slots=True)
class Action:
    """What one request calls: `method` of the session (`ExplorerModel`), or of the widget
    where `widget` (opening another stage switches the session shown; a pipelined job's
    Suggest, Sweep and history are its stages'), with the request's `fields` in order, then
    `keywords` (argument name -> field)."""

    method: str
    fields: tuple[Field, ...] = ()
    keywords: tuple[tuple[str, Field], ...] = ()
    widget: bool = False


def _a(method: str, *fields: Field, **keywords: Field) -> Action:
    return Action(method, fields, tuple(keywords.items()))


ACTIONS: dict[str, Action] = {
    "click": _a("click", Field("id", str), select_only=Field("shift", bool, False)),
    "show": _a("show", Field("view", str)),
    "search": _a("search", Field("query", str)),
    "peak": _a("go_to_peak"),
    "preset": _a("set_preset", Field("name", str)),
    "fsdp": _a("set_fsdp_reshard", Field("reshard", bool)),
    "selector": _a("add_selector", Field("select", str), Field("action", str)),
    "switch": _a("switch_op", Field("module", str), Field("op", str), Field("action", str)),
    "remove_selector": _a("remove_selector", Field("index", int)),
    "edit_selector": _a("edit_selector", Field("index", int), Field("action", str)),
    "override": _a("set_override", Field("key", str), Field("action", str, None)),
    "offload": _a(
        "set_offload",
        Field("budget_bytes", int, None),
        Field("prefetch_layers", int, 1),
        Field("defer_layers", int, 0),
    ),
    "undo": _a("undo"),
    "redo": _a("redo"),
    "reset": _a("reset"),
    # a pipelined job's Suggest, Sweep and history are per GPU over the schedule: the
    # widget sends them to its stages
    "restore": Action("restore", (Field("index", int),), widget=True),
    "save_export": _a("save_export", Field("path", str, None)),
    "run": _a("run"),
    "suggest": Action("suggest", (Field("budget", int),), widget=True),
    "sweep": Action("sweep", widget=True),
    "host_budget": _a("set_host_budget", Field("bytes", int)),
    "stage": Action("open_stage", (Field("stage", int),), widget=True),
    "baselines": _a("show_baselines"),
}


def field(content: dict[str, Any], spec: Field) -> Any:
    """One field of a request, checked: a one-line error names what is wrong.

    >>> field({"type": "restore", "index": 2.0}, Field("index", int))
    2
    """
    action = content.get("type")
    if content.get(spec.name) is None:
        if spec.default is not _REQUIRED:
            return spec.default
        kind = spec.kind.__name__
        raise WorkbenchError(f"message {action!r} lacks the field {spec.name!r} ({kind})")
    value = content[spec.name]
    if spec.kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, spec.kind) or (spec.kind is not bool and isinstance(value, bool)):
        raise WorkbenchError(
            f"message {action!r}: field {spec.name!r} must be {spec.kind.__name__}, "
            f"not {type(value).__name__}"
        )
    return value


def perform(content: object, model: Any, widget: Any) -> Any:
    """Run the request `content` on `model` (or `widget`, for the actions that switch the
    session it shows): fields checked first, then the call; returns what the method does."""
    if not isinstance(content, dict):
        raise WorkbenchError(f"ignored a message that is not an object: {type(content).__name__}")
    name = content.get("type")
    if not isinstance(name, str) or name not in ACTIONS:
        raise WorkbenchError(f"unknown action {name!r}; known: {', '.join(ACTIONS)}")
    action = ACTIONS[name]
    args = [field(content, spec) for spec in action.fields]
    kwargs = {key: field(content, spec) for key, spec in action.keywords}
    target = widget if action.widget else model
    return getattr(target, action.method)(*args, **kwargs)
