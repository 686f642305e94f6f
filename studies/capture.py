"""Full-graph capture of an eager SAC model: does `torch.compile(fullgraph=True)` take it?

Entry point: `compile_eager_sac(workload, policy)` runs one compiled train step (forward and
loss compiled as one graph, backward through AOTAutograd) and reports what happened.
"""

from __future__ import annotations

import collections
import copy
import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from workbench.capture.ops import is_random, mutates, op_name
from workbench.capture.workload import Workload, eager_step
from workbench.decide.engine import Request, eager_tag
from workbench.decide.facts import OpCounter
from workbench.decide.policy import Policy
from workbench.decide.presets import preset_rule
from workbench.errors import logger_level
from workbench.interop.export import export

PolicyFnFactory = Callable[[], Callable[..., CheckpointPolicy]]


@dataclass
class CaptureResult:
    """One compiled step. `choices` counts what the policy_fn answered per (module, op) in the
    original forward (not in recomputation), as it was called under compilation."""

    name: str
    ok: bool
    error_type: str = ""
    error_line: str = ""
    bitwise_equal: bool = False
    choices: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)

    def summary(self) -> str:
        """One deterministic line: what ran, and how it ended."""
        if not self.ok:
            return f"{self.name}: {self.error_type}: {self.error_line}"
        check = "bitwise equal to eager" if self.bitwise_equal else "NOT bitwise equal to eager"
        return f"{self.name}: compiled step ran, loss and grads {check}"

    def choice_counts(self, op: str) -> dict[str, int]:
        """How often `op` (e.g. 'aten.mm.default') was saved / recomputed, by module seen."""
        counts: dict[str, int] = collections.Counter()
        for (module, seen_op, choice), n in self.choices.items():
            if seen_op == op:
                counts[f"{module or '<no module>'} {choice}"] += n
        return dict(sorted(counts.items()))


def load_policy_module(policy: Policy, name: str) -> types.ModuleType:
    """The `policy_fn` export as an importable module (dynamo resolves globals by module
    name, so an exec'd namespace that is not in `sys.modules` cannot be traced)."""
    module = types.ModuleType(name)
    source = export(policy, "policy_fn")
    sys.modules[name] = module
    exec(compile(source, f"<policy_fn export {name}>", "exec"), module.__dict__)
    return module


class _Checkpointed(torch.nn.Module):
    """A block run under `torch.utils.checkpoint` with a selective policy (torchtitan style:
    the policy counts ops in a dict of its own, nothing else changes in forward)."""

    def __init__(self, block: torch.nn.Module, make_policy_fn: PolicyFnFactory) -> None:
        super().__init__()
        self.block = block

        # Built here, outside the traced forward: dynamo takes a context_fn defined
        # before tracing, not a function nested in the code it traces.
        def context_fn() -> Any:
            return create_selective_checkpoint_contexts(make_policy_fn())

        self.context_fn = context_fn

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self.context_fn)


def every_other_mm_policy() -> Callable[..., CheckpointPolicy]:
    """torchtitan's rule as a plain policy_fn: the `eager` preset of `workbench.decide` with
    no module knowledge (every op counted as if in one layer), so every second mm of the
    forward is recomputed and compute-intensive ops are saved."""
    rule = preset_rule("eager")
    counters = {False: OpCounter(), True: OpCounter()}

    def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        op = op_name(func)
        row = (op, "layers.0", op, is_random(func), mutates(func), None, (), None, None)
        facts = counters[bool(ctx.is_recompute)].facts(row)
        return eager_tag(facts, rule, Request("eager")).policy

    return policy_fn


def _recording(
    decide: Callable[..., CheckpointPolicy],
    choices: collections.Counter[tuple[str, str, str]],
    module_of: Callable[[], str],
) -> Callable[..., CheckpointPolicy]:
    @functools.wraps(decide)
    def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        choice = decide(ctx, func, *args, **kwargs)
        if not ctx.is_recompute:
            action = "save" if choice in _SAVES else "recompute"
            choices[(module_of(), str(func), action)] += 1
        return choice

    return policy_fn


_SAVES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def compile_eager_sac(
    workload: Workload,
    policy: Policy | None = None,
    *,
    policy_fn: PolicyFnFactory | None = None,
    backend: str = "aot_eager",
    skip_fwd_side_effects: bool = False,
    layers_attr: str = "layers",
) -> CaptureResult:
    """Wrap a copy of the model's blocks in eager SAC, compile it with `fullgraph=True`, run
    forward + loss + backward once and compare loss and gradients bitwise with a plain eager
    step. Eager SAC is either the workbench export of `policy` (module-aware: it keeps a
    module stack from forward hooks) or a plain `policy_fn` factory (torchtitan style).
    Errors are caught and reported by type and first line. `skip_fwd_side_effects` sets
    dynamo's `skip_fwd_side_effects_in_bwd_under_checkpoint` for this call only."""
    if (policy is None) == (policy_fn is None):
        raise ValueError("pass exactly one of policy (a workbench Policy) or policy_fn")
    model = copy.deepcopy(workload.model)
    choices: collections.Counter[tuple[str, str, str]] = collections.Counter()
    if policy is not None:
        name = f"workbench export of {policy.preset!r}"
        module = load_policy_module(policy, f"sac_workbench_capture_{policy.preset}")
        decide: Callable[..., CheckpointPolicy] = module.__dict__["policy_fn"]
        module.policy_fn = _recording(decide, choices, module.current_module)  # type: ignore[attr-defined]
        model = module.apply_ac(model, layers_attr)
    else:
        assert policy_fn is not None
        name = f"plain policy_fn {getattr(policy_fn, '__name__', 'policy_fn')!r}"
        blocks = getattr(model, layers_attr)
        for key, block in list(blocks.named_children()):  # a ModuleList's or ModuleDict's
            setattr(
                blocks,
                key,
                _Checkpointed(block, lambda: _recording(policy_fn(), choices, lambda: "")),
            )
    if skip_fwd_side_effects:
        name += " (side effects skipped)"
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    params = list(model.parameters())
    assert workload.loss_fn is not None
    try:
        with (
            logger_level("torch._higher_order_ops.wrap"),  # its once-per-process in-place warning
            torch._dynamo.config.patch(
                skip_fwd_side_effects_in_bwd_under_checkpoint=skip_fwd_side_effects
            ),
        ):
            loss = workload.loss_fn(compiled(*workload.inputs), workload.target)
            grads = torch.autograd.grad(loss, params)
    except Exception as error:  # reported, not raised: the failure is the result
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return CaptureResult(name, False, type(error).__name__, first, choices=choices)
    finally:
        torch._dynamo.reset()
    reference = eager_step(workload)
    equal = all(torch.equal(a, b) for a, b in zip([loss.detach(), *grads], reference, strict=True))
    return CaptureResult(name, True, bitwise_equal=equal, choices=choices)
