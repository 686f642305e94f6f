"""Eager baselines beside graph SAC: no activation checkpointing, and eager SAC as exported.

Entry points: `eager_step(workload) -> [loss, *grads]`, `apply_eager_sac(model, policy)` (or
`apply_eager_sac_to(model, policy, regions)` for other granularities), `eager_decisions(workload,
policy)` (what eager SAC chose for each op) and `policy_from_eager` (the same choices as a graph
policy).
"""

from __future__ import annotations

import collections
import copy
import functools
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from workbench.capture.graph import JointGraph
from workbench.capture.ops import NodeKey, module_matches
from workbench.capture.workload import Workload, eager_step
from workbench.decide.decider import layer_key, node_keys
from workbench.decide.policy import Action, Policy
from workbench.errors import WorkbenchError
from workbench.interop.export import NEVER_DISPATCHED, export
from workbench.interop.templates.constants import WRAPPED_MARKER

RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def load_policy_fn(policy: Policy, graph: JointGraph | None = None) -> dict[str, Any]:
    """Run the `policy_fn` export in a fresh namespace: what is measured is what is exported,
    and each model gets its own module stack and counters. Eager SAC cannot offload: a
    policy that offloads runs as `policy.without_offload()` (what it offloads is saved).
    With the model's traced `graph`, the export knows which outputs forward writes in place
    later (`WRITTEN_LATER`), so a policy saving one runs instead of failing in backward."""
    policy = policy.without_offload()
    source = export(policy, "policy_fn", graph)
    namespace: dict[str, Any] = {"__name__": f"sac_workbench_policy_{policy.preset}"}
    exec(compile(source, f"<policy_fn export of preset {policy.preset!r}>", "exec"), namespace)
    return namespace


def apply_eager_sac(
    model: nn.Module,
    policy: Policy,
    layers_attr: str = "layers",
    *,
    namespace: dict[str, Any] | None = None,
    graph: JointGraph | None = None,
) -> nn.Module:
    """Wrap every block of `model.<layers_attr>` in eager SAC with the exported `apply_ac`.

    In place: each block's forward is replaced and its submodules get forward hooks; the
    same model is returned. Deep-copy first to keep an unwrapped model. Preset `none` with
    nothing to recompute leaves the model as it is. `namespace`: an already loaded export;
    `graph`: the model's traced graph, for the export (`load_policy_fn`).
    """
    blocks: Any = model  # a dotted path: `model.layers`, `transformer.h`
    for attr in layers_attr.split("."):
        blocks = getattr(blocks, attr, None)
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
    exported = namespace if namespace is not None else load_policy_fn(policy, graph)
    result: nn.Module = exported["apply_ac"](model, layers_attr)
    return result


def apply_eager_sac_to(
    model: nn.Module,
    policy: Policy,
    regions: Sequence[str],
    *,
    namespace: dict[str, Any] | None = None,
    graph: JointGraph | None = None,
) -> nn.Module:
    """Wrap every submodule whose path matches one of `regions` (the selectors' module
    patterns: `layers.*.attention`) in its own eager SAC region, with the exported `policy_fn`.

    The granularity choice `apply_eager_sac` fixes at one region per block: the every-other-
    matmul counter restarts in each region, and what runs outside every region (here, the
    norms and residual adds between two regions) is plain autograd, which keeps what its
    backward formulas need; a region's inputs are always kept. In place, like
    `apply_eager_sac`; raises when nothing matches, or when regions nest or are wrapped.
    """
    paths = [
        name for name, _ in model.named_modules() if any(module_matches(r, name) for r in regions)
    ]
    if not paths:
        children = ", ".join(name for name, _ in model.named_children())
        raise WorkbenchError(
            f"no submodule of {type(model).__name__} matches regions {list(regions)}; paths are "
            f"dotted with fnmatch per component, e.g. 'layers.*.attention' (children: {children})"
        )
    for path in paths:
        outer = next((p for p in paths if path.startswith(p + ".")), None)
        if outer is not None:
            raise WorkbenchError(f"region {path} is inside region {outer}: regions cannot nest")
        if hasattr(model.get_submodule(path), WRAPPED_MARKER):
            raise WorkbenchError(
                f"{path} is already wrapped in eager SAC: apply it to a fresh model "
                "(copy.deepcopy before the first apply)"
            )
    exported = namespace if namespace is not None else load_policy_fn(policy, graph)
    if not exported["WRAP_LAYERS"]:
        return model
    for path in paths:
        region = model.get_submodule(path)
        for sub_path, sub in region.named_modules(prefix=path):
            if sub is not region:
                sub.register_forward_pre_hook(functools.partial(exported["_enter"], sub_path))
                sub.register_forward_hook(exported["_leave"], always_call=True)
        region.forward = exported["_checkpointed"](region.forward, path)  # type: ignore[method-assign]
        setattr(region, WRAPPED_MARKER, True)
    return model


def eager_decisions(
    workload: Workload,
    policy: Policy,
    layers_attr: str = "layers",
    *,
    regions: Sequence[str] | None = None,
    graph: JointGraph | None = None,
) -> dict[str, CheckpointPolicy]:
    """Run one eager SAC step on a copy of the model and return what the exported `policy_fn`
    chose in the original forward, keyed `MODULE::OP#k` like `workbench.decide.policy.layer_key`
    (k counted here, independently of `policy_fn`'s own counters). Ops outside the layers (or
    outside `regions`, when given: see `apply_eager_sac_to`) are never checkpointed, so never
    asked; empty when the policy wraps nothing. `graph`: as for `load_policy_fn`."""
    namespace = load_policy_fn(policy, graph)
    decided = namespace["policy_fn"]
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    choices: dict[str, CheckpointPolicy] = {}

    @functools.wraps(decided)
    def recording(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        choice: CheckpointPolicy = decided(ctx, func, *args, **kwargs)
        if not ctx.is_recompute:
            module, op = namespace["current_module"](), namespace["op_name"](func)
            choices[NodeKey(module, op, seen[(module, op)]).text] = choice
            seen[(module, op)] += 1
        return choice

    namespace["policy_fn"] = recording  # the exported context_fn looks it up at call time
    model = copy.deepcopy(workload.model)
    if regions is None:
        apply_eager_sac(model, policy, layers_attr, namespace=namespace)
    else:
        apply_eager_sac_to(model, policy, regions, namespace=namespace)
    eager_step(Workload(model, workload.inputs, workload.target, workload.loss_fn, workload.name))
    return choices


def policy_from_eager(
    graph: JointGraph, choices: dict[str, CheckpointPolicy], preset: str = "eager"
) -> Policy:
    """A graph policy making eager SAC's `choices` (from `eager_decisions`) for every layer op:
    one layer-specific override per node. A layer op eager SAC was not asked about ran outside
    every region, under plain autograd, and is saved (the remat pass then keeps it only where
    backward reads it, as autograd does); ops eager never dispatches keep the preset's tag."""
    overrides: dict[str, Action] = {}
    for name, key in node_keys(graph).items():
        info = graph.nodes[name]
        if info.layer is None:
            continue
        own = layer_key(info, key)
        choice = choices.get(own)
        if choice is None and info.op in NEVER_DISPATCHED:
            continue
        overrides[own] = "recompute" if choice in RECOMPUTE else "save"
    return Policy(preset=preset, overrides=overrides)
