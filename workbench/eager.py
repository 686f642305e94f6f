"""Eager baselines beside graph SAC: no activation checkpointing, and eager SAC as exported.

Entry points: `eager_step(workload) -> [loss, *grads]`, `apply_eager_sac(model, policy)` and
`eager_decisions(workload, policy)` (what eager SAC chose for each op, for comparisons).
"""

from __future__ import annotations

import collections
import copy
import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from workbench.errors import WorkbenchError
from workbench.export import WRAPPED_MARKER, export
from workbench.models import Workload
from workbench.policy import Policy


def eager_step(workload: Workload) -> list[torch.Tensor]:
    """One plain autograd train step: `[loss, *grads]`, grads in `model.parameters()` order
    (the order of `JointGraph.param_names`), so it lines up with a traced graph's outputs."""
    assert workload.loss_fn is not None
    params = list(workload.model.parameters())
    loss = workload.loss_fn(workload.model(*workload.inputs), workload.target)
    grads = torch.autograd.grad(loss, params)
    return [loss.detach(), *grads]


def load_policy_fn(policy: Policy) -> dict[str, Any]:
    """Run the `policy_fn` export in a fresh namespace: what is measured is what is exported,
    and each model gets its own module stack and counters."""
    source = export(policy, "policy_fn")
    namespace: dict[str, Any] = {"__name__": f"sac_workbench_policy_{policy.preset}"}
    exec(compile(source, f"<policy_fn export of preset {policy.preset!r}>", "exec"), namespace)
    return namespace


def apply_eager_sac(
    model: nn.Module,
    policy: Policy,
    layers_attr: str = "layers",
    *,
    namespace: dict[str, Any] | None = None,
) -> nn.Module:
    """Wrap every block of `model.<layers_attr>` in eager SAC with the exported `apply_ac`.

    In place: each block's forward is replaced and its submodules get forward hooks; the
    same model is returned. Deep-copy first to keep an unwrapped model. Preset `none` with
    nothing to recompute leaves the model as it is. `namespace`: an already loaded export.
    """
    blocks = getattr(model, layers_attr, None)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        raise WorkbenchError(
            f"{type(model).__name__} has no container of blocks at {layers_attr!r} "
            f"(found {type(blocks).__name__}); pass layers_attr naming its nn.ModuleList"
        )
    wrapped = [name for name, block in blocks.named_children() if hasattr(block, WRAPPED_MARKER)]
    if wrapped:
        raise WorkbenchError(
            f"{layers_attr}.{wrapped[0]} is already wrapped in eager SAC: apply it to a fresh "
            "model (copy.deepcopy before the first apply_eager_sac)"
        )
    exported = namespace if namespace is not None else load_policy_fn(policy)
    result: nn.Module = exported["apply_ac"](model, layers_attr)
    return result


def eager_decisions(
    workload: Workload, policy: Policy, layers_attr: str = "layers"
) -> dict[str, CheckpointPolicy]:
    """Run one eager SAC step on a copy of the model and return what the exported `policy_fn`
    chose in the original forward, keyed `MODULE::OP#k` like `workbench.policy.layer_key`
    (k counted here, independently of `policy_fn`'s own counters). Ops outside the layers are
    never checkpointed, so never asked; empty when the policy wraps nothing."""
    namespace = load_policy_fn(policy)
    decided = namespace["policy_fn"]
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    choices: dict[str, CheckpointPolicy] = {}

    @functools.wraps(decided)
    def recording(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        choice: CheckpointPolicy = decided(ctx, func, *args, **kwargs)
        if not ctx.is_recompute:
            module, op = namespace["current_module"](), namespace["op_name"](func)
            choices[f"{module}::{op}#{seen[(module, op)]}"] = choice
            seen[(module, op)] += 1
        return choice

    namespace["policy_fn"] = recording  # the exported context_fn looks it up at call time
    model = copy.deepcopy(workload.model)
    apply_eager_sac(model, policy, layers_attr, namespace=namespace)
    eager_step(Workload(model, workload.inputs, workload.target, workload.loss_fn, workload.name))
    return choices
