"""Parity with torchtitan's graph trainer: its own memory-policy pass run on a workbench graph.

Entry points: `graph_trainer_tags(graph, memory_policy)` (torchtitan's tags per forward node),
`graph_trainer_log(graph, memory_policy)` (its activation-memory log) and
`compare(graph, policy, memory_policy=None) -> list[Mismatch]` against `decide`.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from workbench.errors import WorkbenchError
from workbench.graph import JointGraph
from workbench.policy import Policy, decidable, decide
from workbench.remat import copy_graph_module
from workbench.rules import RECOMPUTE

__all__ = ["MEMORY_POLICIES", "Mismatch", "compare", "graph_trainer_log", "graph_trainer_tags"]

# Graph trainer's memory policies the harness runs (`sac_and_offload` needs an accelerator
# stream), and the key its pass reads the module path from (`common_utils._MODULE_FQN`).
MEMORY_POLICIES = ("default", "full", "eager")
MODULE_FQN = "module_fqn"
_POLICY_MODULE = "torchtitan.experiments.graph_trainer.memory_policy"


def _registry() -> dict[str, Any]:
    try:
        importlib.import_module(_POLICY_MODULE)  # registers the policies
        registry = importlib.import_module("torchtitan.experiments.graph_trainer.registry")
    except ImportError as err:
        raise WorkbenchError(
            f"the graph trainer parity check needs torchtitan ({err}): "
            "pip install -e '.[torchtitan]'"
        ) from None
    return registry.MEMORY_POLICY_REGISTRY  # type: ignore[no-any-return]


def _config(memory_policy: str) -> Any:
    """The slice of graph trainer's config its memory-policy passes read (single device)."""
    from torchtitan.config import ParallelismConfig

    return types.SimpleNamespace(
        parallelism=ParallelismConfig(),
        compile=types.SimpleNamespace(memory_policy=memory_policy),
    )


def _tagged_copy(graph: JointGraph, memory_policy: str) -> fx.GraphModule:
    """A copy of the graph tagged by graph trainer's registered pass for `memory_policy`,
    its nodes carrying what the pass reads: `meta["custom"]["module_fqn"]` (the workbench's
    module path, as its `annotate_module_fqns` would set it) and `meta["autograd_backward"]`
    (already set by tracing)."""
    if memory_policy not in MEMORY_POLICIES:
        raise WorkbenchError(
            f"unknown graph trainer memory policy {memory_policy!r}; choose one of "
            f"{', '.join(MEMORY_POLICIES)}"
        )
    registry = _registry()
    gm = copy_graph_module(graph.gm)
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        custom = dict(node.meta.get("custom") or {})
        custom[MODULE_FQN] = graph.nodes[node.name].module
        node.meta["custom"] = custom
    with _torchtitan_log(logging.WARNING):  # its per-layer summary is for training logs
        registry[memory_policy](gm, config=_config(memory_policy))
    return gm


@contextlib.contextmanager
def _torchtitan_log(level: int, handler: logging.Handler | None = None) -> Iterator[None]:
    logger = logging.getLogger()  # torchtitan logs through the root logger
    previous = logger.level
    logger.setLevel(level)
    if handler is not None:
        logger.addHandler(handler)
    try:
        yield
    finally:
        logger.setLevel(previous)
        if handler is not None:
            logger.removeHandler(handler)


def graph_trainer_tags(graph: JointGraph, memory_policy: str) -> dict[str, CheckpointPolicy | None]:
    """torchtitan's tag (None: untagged) for every forward and loss node of `graph`, from
    graph trainer's own pass on a copy of it; the graph itself is not changed."""
    gm = _tagged_copy(graph, memory_policy)
    return {
        node.name: node.meta.get("recompute")
        for node in gm.graph.nodes
        if decidable(graph.nodes[node.name])
    }


def graph_trainer_log(graph: JointGraph, memory_policy: str) -> str:
    """The activation-memory table graph trainer logs after tagging `graph` with its own
    `memory_policy` (`log_activation_memory_policy`, captured from its debug log)."""
    from torchtitan.experiments.graph_trainer.log_activation_memory_policy import (
        log_activation_memory_policy,
    )

    gm = _tagged_copy(graph, memory_policy)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    with _torchtitan_log(logging.DEBUG, handler):
        log_activation_memory_policy(gm)
    text = stream.getvalue()
    return text[text.index("\n") + 1 :].rstrip("\n")  # without its one-line heading


@dataclass(frozen=True)
class Mismatch:
    """A node the workbench saves where graph trainer recomputes it, or the reverse."""

    node: str
    op: str
    module: str
    graph_trainer: CheckpointPolicy | None
    workbench: CheckpointPolicy
    reason: str  # the workbench's reason for its tag

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "op": self.op,
            "module": self.module,
            "graph_trainer": self.graph_trainer.name if self.graph_trainer else "untagged",
            "workbench": self.workbench.name,
            "reason": self.reason,
        }


def compare(
    graph: JointGraph, policy: Policy | str, memory_policy: str | None = None
) -> list[Mismatch]:
    """Nodes where `decide(graph, policy)` and graph trainer's `memory_policy` (default: the
    preset's name without `titan-`) disagree on save vs recompute, in graph order."""
    policy = policy if isinstance(policy, Policy) else Policy(policy)
    memory_policy = memory_policy or policy.preset.removeprefix("titan-")
    theirs = graph_trainer_tags(graph, memory_policy)
    ours = decide(graph, policy)
    return [
        Mismatch(
            node=name,
            op=graph.nodes[name].op,
            module=graph.nodes[name].module,
            graph_trainer=theirs.get(name),
            workbench=tag.policy,
            reason=tag.reason,
        )
        for name, tag in ours.items()
        if (theirs.get(name) in RECOMPUTE) != tag.recompute
    ]
