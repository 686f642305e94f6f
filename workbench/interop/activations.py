"""The per-activation table torchtitan's graph trainer logs, from the workbench, for any policy.

Entry points: `activation_rows(graph, policy) -> list[ActivationRow]` (one row per forward
value backward reads, tagged by `policy`) and `activation_log(rows) -> str`, the text of
graph trainer's activation-memory log, so the two can be compared line by line.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.ops import op_name
from workbench.decide.decider import decide
from workbench.decide.policy import Policy
from workbench.decide.presets import TITAN_NOT_IN_LAYERS, titan_layer
from workbench.decide.tags import Tag, Why
from workbench.units import format_bytes

__all__ = ["ActivationRow", "activation_log", "activation_rows", "log_bytes", "totals"]

# Graph trainer's short names for a tag; "SAVE*" is a node it left untagged (saved).
UNTAGGED = "SAVE*"
_SHORT = {
    CheckpointPolicy.MUST_SAVE: "SAVE",
    CheckpointPolicy.PREFER_SAVE: "SAVE",  # graph trainer never tags PREFER_SAVE
    CheckpointPolicy.PREFER_RECOMPUTE: "RECOMPUTE",
    CheckpointPolicy.MUST_RECOMPUTE: "RECOMPUTE!",
    CheckpointPolicy.MUST_CPU_OFFLOAD: "OFFLOAD",
}
_TORCHTITAN_PATH = "torchtitan/"


@dataclasses.dataclass(frozen=True)
class ActivationRow:
    """One forward value that backward reads, as graph trainer's log describes it."""

    layer: int  # graph trainer's layer id: N for layers.N..., -1 elsewhere
    node: str
    bytes: int
    dtype: str
    policy: str  # SAVE, RECOMPUTE, RECOMPUTE!, OFFLOAD or SAVE* (untagged)
    shape: str
    module: str
    op: str  # the op producing the value (through getitem)
    source: str
    # the op traced, where a cleanup pass retargeted the node (`view` -> `reshape`), else ""
    traced_op: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def log_bytes(nbytes: int) -> str:
    """Bytes the way graph trainer's log prints them (two digits after the point).

    >>> log_bytes(512), log_bytes(3 * 2**19), log_bytes(2**31)
    ('512 B', '1.50 MiB', '2.00 GiB')
    """
    return format_bytes(nbytes, digits=2)


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(list(value.shape))
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in value) + ")"
    return "Scalar" if isinstance(value, (int, float, bool)) else "?"


def _dtype(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    if isinstance(value, (tuple, list)):
        dtypes = sorted({_dtype(v) for v in value} - {"?", "Scalar"})
        return "/".join(dtypes) if dtypes else "?"
    return "Scalar" if isinstance(value, (int, float, bool)) else "?"


_FRAME = re.compile(r'File "([^"]+)", line (\d+)[^\n]*\n?(?:\s+(?!File ")([^\n]*))?')


def _source(node: fx.Node) -> str:
    """The innermost torchtitan frame as `path/inside/torchtitan.py:LINE  code`, as graph
    trainer prints it; else the innermost frame outside torch (for graph trainer, whose
    stacks hold no torch frames here, the last one), as `file.py:LINE  code`."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    for path, line, code in reversed(frames):
        if _TORCHTITAN_PATH in path:
            location = f"{path[path.find(_TORCHTITAN_PATH) + len(_TORCHTITAN_PATH) :]}:{line}"
            return f"{location}  {code.strip()}" if code.strip() else location
    outside = [f for f in frames if "/torch/" not in f[0]] or frames
    if not outside:
        return ""
    path, line, code = outside[-1]
    location = f"{path.rsplit('/', 1)[-1]}:{line}"
    return f"{location}  {code.strip()}" if code.strip() else location


def _producer(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and op_name(node.target) == "getitem":
        parent = node.args[0]
        if not isinstance(parent, fx.Node) or parent.op != "call_function":
            break
        node = parent
    return node


def _traced_op(node: fx.Node) -> str:
    """The op make_fx recorded (`meta["original_aten"]`) where a pass retargeted the node."""
    original = node.meta.get("original_aten")
    return "" if original is None or str(original) == str(node.target) else str(original)


def _label(tag: Tag | None) -> str:
    if tag is None or tag.why is Why.UNTAGGED:
        return UNTAGGED
    return _SHORT[tag.policy]


def activation_rows(graph: JointGraph, policy: Policy | str) -> list[ActivationRow]:
    """Forward and loss nodes with at least one backward user, in graph order, before remat
    (as graph trainer lists them: recomputed ones included, with their tag)."""
    policy = policy if isinstance(policy, Policy) else Policy(policy)
    tags = decide(graph, policy)
    rows = []
    for node in graph.gm.graph.nodes:
        info = graph.nodes[node.name]
        if node.op != "call_function" or info.phase not in ("forward", "loss"):
            continue
        if not any(graph.nodes[user.name].phase == "backward" for user in node.users):
            continue
        value = node.meta.get("val")
        producer = _producer(node)
        rows.append(
            ActivationRow(
                layer=titan_layer(info.module),
                node=node.name,
                bytes=info.bytes,
                dtype=_dtype(value),
                policy=_label(tags.get(node.name)),
                shape=_shape(value),
                module=info.module,
                op=str(producer.target),
                source=_source(producer),
                traced_op=_traced_op(producer),
            )
        )
    return rows


def totals(rows: list[ActivationRow]) -> dict[str, Any]:
    """Count and bytes of all rows (graph trainer's "Total") and the bytes per tag."""
    by_policy: collections.Counter[str] = collections.Counter()
    for row in rows:
        by_policy[row.policy] += row.bytes
    total = sum(row.bytes for row in rows)
    return {
        "activations": len(rows),
        "bytes": total,
        "mib": round(total / 2**20, 2),
        "bytes_by_policy": dict(sorted(by_policy.items())),
    }


def _relative(module: str) -> str:
    parts = module.split(".", 2)
    return parts[2] if parts[0] == "layers" and len(parts) == 3 else module


def _line(index: int, row: ActivationRow, module: str) -> str:
    target = f"{row.op}  (<- {row.traced_op})" if row.traced_op else row.op
    return (
        f"  {index:<3} {log_bytes(row.bytes):>10}  {row.dtype:<10} {row.policy:<12} "
        f"{row.shape:<25} {module:<30} {target:<55} {row.source}"
    )


def activation_log(rows: list[ActivationRow]) -> str:
    """The log's text: non-layer rows, then each layer, layers with the same pattern (op,
    shape, dtype, tag per row) folded into one block, then the total."""
    by_layer: dict[int, list[ActivationRow]] = collections.defaultdict(list)
    for row in rows:
        by_layer[row.layer].append(row)
    groups: dict[tuple[Any, ...], list[int]] = collections.defaultdict(list)
    for layer in sorted(by_layer):
        if layer != TITAN_NOT_IN_LAYERS:
            pattern = tuple((r.op, r.shape, r.dtype, r.policy) for r in by_layer[layer])
            groups[pattern].append(layer)
    header = (
        f"  {'#':<3} {'Memory':>10}  {'DType':<10} {'Policy':<12} {'Shape':<25} "
        f"{'SubModule':<30} {'Target':<55} Source"
    )
    rule = "-" * len(header)
    lines = [rule, header, rule]
    other = by_layer.get(TITAN_NOT_IN_LAYERS, [])
    if other:
        other_bytes = log_bytes(sum(r.bytes for r in other))
        lines.append(f"[non-layer] ({len(other)} activations, {other_bytes})")
        lines += [_line(i, row, row.module) for i, row in enumerate(other)]
        lines.append("")
    for layers in sorted(groups.values()):
        block = by_layer[layers[0]]
        size = sum(r.bytes for r in block)
        if len(layers) == 1:
            label = f"[layer {layers[0]}]"
        else:
            label = f"[layers {layers[0]}-{layers[-1]}] (x{len(layers)}, same pattern)"
        lines.append(
            f"{label} ({len(block)} activations, {log_bytes(size)} each, "
            f"{log_bytes(size * len(layers))} total)"
        )
        lines += [_line(i, row, _relative(row.module)) for i, row in enumerate(block)]
        lines.append("")
    n_layers = sum(len(layers) for layers in groups.values())
    scope = f"{n_layers} layer(s)" + (" + non-layer" if other else "")
    summary = totals(rows)
    lines += [
        rule,
        f"Total: {summary['activations']} activations, {log_bytes(summary['bytes'])} "
        f"across {scope}",
        rule,
        f"{UNTAGGED} = untagged (kept in GPU memory by default)",
    ]
    return "\n".join(lines)
