"""Whose fault a mismatch is: before a policy is judged, the step it rewrites is checked.

`verify` used to compare the rematerialized graph with eager directly, so a traced program
that differs from eager before any policy (transformers builds a dense mask under tracing
and calls another SDPA kernel) or a step that eager itself does not reproduce (an MoE's
`index_put(accumulate=True)` on CPU) failed every policy. Three comparisons now keep the
causes apart:

1. eager against eager (two seeded runs): is the step reproducible at all?
2. the traced graph with nothing rematerialized against eager: is the traced program the
   eager program?
3. the policy's verdict: the rematerialized graph against the traced graph (graph against
   graph, the only thing a policy changes).

Entry points: `reference_run(graph, workload, seed)` (1 and 2, once per model) and
`policy_mismatches(graph, gm, reference, seed)` (3, once per policy).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.capture.graph import JointGraph
from workbench.capture.ops import op_name
from workbench.capture.workload import Workload, eager_step
from workbench.cost.measure import (
    bitwise_equal,
    device_of,
    fails_in_one_line,
    refuse_written_inputs,
)

__all__ = ["NONDETERMINISTIC_ON_CPU", "Reference", "policy_mismatches", "reference_run"]

# Ops torch documents as nondeterministic on the CPU unless
# `torch.use_deterministic_algorithms(True)` (accumulating writes in parallel).
NONDETERMINISTIC_ON_CPU = frozenset(
    {
        "aten.index_put.default",
        "aten.index_put_.default",
        "aten._index_put_impl_.default",
        "aten.index_add.default",
        "aten.index_add_.default",
        "aten.scatter_add.default",
        "aten.scatter_add_.default",
        "aten.scatter_reduce.two",
        "aten.put_.default",
    }
)
# Bookkeeping the trace and eager count differently without computing anything else.
_IGNORED = frozenset({"aten.detach.default", "aten.alias.default", "aten._to_copy.default"})
_SHOWN = 4  # ops listed per side in the verdict


@dataclass(frozen=True)
class Reference:
    """The traced step's own outputs (what a policy is compared with) and what the checks
    before any policy found: output names (`loss`, parameters) that differ."""

    outputs: list[torch.Tensor] = field(repr=False)
    eager_repeat: tuple[str, ...]  # eager against eager
    graph_repeat: tuple[str, ...]  # the traced graph against itself
    traced_vs_eager: tuple[str, ...]  # the traced graph, nothing rematerialized, against eager
    largest_difference: float  # over traced_vs_eager, in absolute value
    only_traced: dict[str, int]  # ops the graph runs more often than eager
    only_eager: dict[str, int]
    nondeterministic: tuple[str, ...]  # the graph's ops of NONDETERMINISTIC_ON_CPU

    @property
    def reproducible(self) -> bool:
        return not self.eager_repeat and not self.graph_repeat

    def verdict(self) -> str | None:
        """Why the traced step does not match eager before any policy, or None."""
        if not self.reproducible:
            runs = "eager" if self.eager_repeat else "the traced graph"
            names = self.eager_repeat or self.graph_repeat
            ops = ", ".join(self.nondeterministic) or "none of the ops torch lists"
            return (
                f"the step is not reproducible before any policy: two runs of {runs} differ in "
                f"{_names(names)} (nondeterministic ops in the graph: {ops}); set "
                "torch.use_deterministic_algorithms(True) in the factory to compare bitwise"
            )
        if not self.traced_vs_eager:
            return None
        return (
            "the traced program differs from the eager program before any policy: "
            f"{_names(self.traced_vs_eager)} differ by up to {self.largest_difference:.3g} "
            f"({self._ops_differ()}); the policy's verdict compares the rematerialized graph "
            "with the traced one"
        )

    def _ops_differ(self) -> str:
        if not self.only_traced and not self.only_eager:
            return "the same ops, other arguments or order"
        parts = []
        if self.only_traced:
            parts.append(f"the graph runs {_ops(self.only_traced)} more")
        if self.only_eager:
            parts.append(f"eager runs {_ops(self.only_eager)} more")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "eager_reproducible": not self.eager_repeat,
            "graph_reproducible": not self.graph_repeat,
            "traced_equals_eager": not self.traced_vs_eager,
            "traced_mismatched": list(self.traced_vs_eager),
            "largest_difference": self.largest_difference,
            "ops_only_traced": self.only_traced,
            "ops_only_eager": self.only_eager,
            "nondeterministic_ops": list(self.nondeterministic),
            "verdict": self.verdict(),
        }


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _ops(counts: dict[str, int]) -> str:
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:_SHOWN]
    more = f" (+{len(counts) - _SHOWN} ops)" if len(counts) > _SHOWN else ""
    return ", ".join(f"{op} ×{n}" for op, n in top) + more


def _computes(op: Any) -> bool:
    """An op that makes new values: not a view (views differ in how the two programs
    reshape, not in what they compute)."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    returns = op._schema.returns
    return not returns or all(r.alias_info is None for r in returns)


class _OpCounts(TorchDispatchMode):
    """Counts the ATen ops eager runs (forward and backward), views left out."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _computes(func):
            self.counts[op_name(func)] += 1
        return func(*args, **(kwargs or {}))


def _graph_ops(gm: fx.GraphModule) -> collections.Counter[str]:
    return collections.Counter(
        op_name(n.target) for n in gm.graph.nodes if n.op == "call_function" and _computes(n.target)
    )


def _run_seeded(run: Callable[[], Sequence[torch.Tensor]], seed: int, devices: list[Any]) -> Any:
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return list(run())


def _differ(names: Sequence[str], a: Sequence[Any], b: Sequence[Any]) -> tuple[str, ...]:
    return tuple(n for n, x, y in zip(names, a, b, strict=True) if not bitwise_equal(x, y))


def reference_run(graph: JointGraph, workload: Workload, seed: int = 0) -> Reference:
    """Run eager twice and the traced graph (nothing rematerialized, under no_grad) twice,
    all from one generator state, and compare."""
    inputs = graph.example_inputs
    assert inputs is not None, "reference_run runs the graph: trace it in real mode"
    device = device_of(inputs)
    devices = [device] if device.type == "cuda" else []
    names = ["loss", *graph.param_names]

    def run_graph() -> list[torch.Tensor]:
        with torch.no_grad():
            return list(graph.gm(*inputs))

    kinds = [spec.kind for spec in graph.inputs]
    before = [
        t.clone() if isinstance(t, torch.Tensor) and kind == "param" else None
        for t, kind in zip(inputs, kinds, strict=False)
    ]
    with fails_in_one_line(f"the graph of {graph.model_name!r}"):
        traced = _run_seeded(run_graph, seed, devices)
    refuse_written_inputs(graph, inputs, before)  # eager would start from other weights
    with fails_in_one_line(f"the graph of {graph.model_name!r}"):
        traced_again = _run_seeded(run_graph, seed, devices)
    counter = _OpCounts()
    with fails_in_one_line(f"the eager step of {graph.model_name!r}"):
        with counter:
            eager = _run_seeded(lambda: eager_step(workload), seed, devices)
        eager_again = _run_seeded(lambda: eager_step(workload), seed, devices)
    mismatched = _differ(names, traced, eager)
    largest = max(
        (
            float((a.double() - b.double()).abs().max())
            for n, a, b in zip(names, traced, eager, strict=True)
            if n in mismatched and a.shape == b.shape and a.numel()
        ),
        default=0.0,
    )
    graph_ops = _graph_ops(graph.gm)
    eager_ops = counter.counts
    return Reference(
        outputs=traced,
        eager_repeat=_differ(names, eager, eager_again),
        graph_repeat=_differ(names, traced, traced_again),
        traced_vs_eager=mismatched,
        largest_difference=largest,
        only_traced=_excess(graph_ops, eager_ops),
        only_eager=_excess(eager_ops, graph_ops),
        nondeterministic=tuple(sorted(set(graph_ops) & NONDETERMINISTIC_ON_CPU)),
    )


def _excess(a: collections.Counter[str], b: collections.Counter[str]) -> dict[str, int]:
    return {op: n - b[op] for op, n in sorted(a.items()) if n > b[op] and op not in _IGNORED}


def policy_mismatches(
    graph: JointGraph, gm: fx.GraphModule, reference: Reference, seed: int = 0
) -> list[str]:
    """The policy's verdict: outputs where the rematerialized `gm` differs in any bit from
    the traced graph's own (`reference.outputs`), run from the same generator state."""
    inputs = graph.example_inputs
    assert inputs is not None
    device = device_of(inputs)
    devices = [device] if device.type == "cuda" else []

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return list(gm(*inputs))

    with fails_in_one_line(f"the graph of {graph.model_name!r}"):
        outputs = _run_seeded(run, seed, devices)
    return list(_differ(["loss", *graph.param_names], outputs, reference.outputs))
