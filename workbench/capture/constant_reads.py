"""Values a traced step reads from tensors it built itself, and the user's frame of a
data-dependent failure.

make_fx refuses to read a value out of a real tensor while tracing ("It appears that you're
trying to get value out of a tracing tensor"): in general a real tensor may be an input whose
value differs from run to run, and reading it would burn one run's value into the graph. In a
workbench trace every input (parameters, buffers, batch, target) is a fake tensor, so a real
tensor is one the step built from constants: transformers' causal LMs build position ids with
`torch.arange` and ask whether they restart (`masking_utils.find_packed_sequence_indices`,
`.all()`), a check whose answer is the same on every run. The trace reads such values as eager
does (`make_fx(..., _error_on_data_dependent_ops=False)`), and `drop_constant_reads` takes the
reads out of the graph afterwards: the branch they decided is in the graph, the read is not.
A value read from a random op's output differs between runs: that is refused.

Entry points: `drop_constant_reads(gm, name)`, `user_frame(err)`.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
import torch.fx as fx

from workbench.errors import WorkbenchError

__all__ = ["DATA_DEPENDENT_ADVICE", "drop_constant_reads", "user_frame"]

_READS = (torch.ops.aten._local_scalar_dense.default,)
_TORCH = str(Path(torch.__file__).parent)
_WORKBENCH = str(Path(__file__).resolve().parent.parent)

DATA_DEPENDENT_ADVICE = (
    "compute the value from shapes, not tensor values, or give the model what it would "
    "otherwise compute from data (transformers: an attention_mask or position_ids argument), "
    "or use torch.where / torch.cond in place of the Python branch"
)


def drop_constant_reads(gm: fx.GraphModule, name: str) -> int:
    """Remove the value reads (`aten._local_scalar_dense`) nobody uses and the ops that only
    fed them; returns how many nodes went. A read of a random op's output is refused (its
    value would be one run's draw)."""
    dropped = 0
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or node.target not in _READS or node.users:
            continue
        random = _random_ancestor(node)
        if random is not None:
            raise WorkbenchError(
                f"model {name!r} cannot be traced: Python control flow reads a random value "
                f"({random.target} → {node.name}{_frame_of(node)}), which differs between "
                "runs; draw it outside the step or branch with torch.where"
            )
        dropped += _erase_unused_chain(gm.graph, node)
    if dropped:
        gm.recompile()
    return dropped


def _random_ancestor(node: fx.Node) -> fx.Node | None:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        target = current.target
        if isinstance(target, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in target.tags
        ):
            return current
        stack.extend(current.all_input_nodes)
    return None


def _erase_unused_chain(graph: fx.Graph, read: fx.Node) -> int:
    """Erase `read`, then every input of an erased node left without users that is a pure
    op (no placeholder, nothing that writes or draws)."""
    erased = 0
    stack = [read]
    while stack:
        node = stack.pop()
        if node.users or node.op != "call_function" or (node is not read and node.is_impure()):
            continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        erased += 1
        stack.extend(inputs)
    return erased


def _frame_of(node: fx.Node) -> str:
    frames = [
        line.strip()
        for line in (node.meta.get("stack_trace") or "").splitlines()
        if line.strip().startswith("File ") and _TORCH not in line
    ]
    return f", {frames[-1]}" if frames else ""


def user_frame(err: BaseException) -> str:
    """Where a failure came from in the user's (or their library's) code: the last frame of
    the exception's traceback (or of what caused it) outside torch and the workbench, as
    `path:line in function: source`; empty when every frame is torch's."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    for exc in chain:
        frames = [
            frame
            for frame in traceback.extract_tb(exc.__traceback__)
            if not frame.filename.startswith((_TORCH, _WORKBENCH))
        ]
        if frames:
            last = frames[-1]
            code = f": {last.line.strip()}" if last.line else ""
            return f"{last.filename}:{last.lineno} in {last.name}{code}"
    return ""
