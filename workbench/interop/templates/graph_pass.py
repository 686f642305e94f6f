"""Graph selective activation checkpointing for one SAC Workbench policy.

Entry point: `tag_graph(gm)`, which writes node.meta["recompute"] for torch's
remat pass (remat_using_tags_for_fwd_loss_bwd_graph).
"""

# The template of the `graph_pass` export (`workbench.interop.templates` says how it is used).

from __future__ import annotations

import re
import warnings

import torch
import torch.fx

from workbench.decide.engine import Request, decide_ops, selector_matches
from workbench.decide.facts import fx_rows, op_facts
from workbench.decide.offloadable import OffloadOptions
from workbench.interop.templates.constants import (
    FSDP_RESHARD,
    OFFLOAD_OPTIONS,
    OVERRIDES,
    PRESET,
    SELECTORS,
)


def module_paths(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """The module that ran each node: meta["custom"]["module"] (SAC Workbench tracing) or
    ["module_fqn"] (torchtitan), else the innermost nn_module_stack entry, else none ("",
    as for the loss gradient's seed `ones_like`, made outside every module)."""
    paths: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        path = next((str(custom[k]) for k in ("module", "module_fqn") if k in custom), None)
        stack = node.meta.get("nn_module_stack")
        if path is None and stack:
            last = list(stack.values())[-1]
            last = last[0] if isinstance(last, tuple) else str(last)
            last = re.sub(r"\[(\d+)\]", r".\1", last)  # dynamo: L['self'].layers[0]
            path = last.removeprefix("L['self']").lstrip(".")
        paths[node] = path if path is not None else ""
    return paths


def tag_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Write node.meta["recompute"] on every forward and loss node of a joint graph, in place.

    Reads meta["autograd_backward"] (backward nodes get no tag) and the module path (see
    `module_paths`); tags by `decide_ops`, offloaded nodes MUST_CPU_OFFLOAD. Warns about
    selectors and overrides that match nothing. Returns `gm`.
    """
    facts = op_facts(fx_rows(gm, module_paths(gm).__getitem__))
    request = Request(
        preset=PRESET,
        selectors=SELECTORS,
        overrides=OVERRIDES,
        fsdp_reshard=FSDP_RESHARD,
        offload=OffloadOptions(*OFFLOAD_OPTIONS),
    )
    tags = decide_ops(facts, request)
    for node in gm.graph.nodes:
        node.meta.pop("recompute", None)
        if node.name in tags:
            node.meta["recompute"] = tags[node.name].policy
    for module_pattern, op_pattern, _ in SELECTORS:
        if not any(selector_matches(module_pattern, op_pattern, f.module, f.op) for f in facts):
            warnings.warn(f"selector {module_pattern}::{op_pattern} matches no node", stacklevel=2)
    used_keys = {key for f in facts for key in (f.key, f.layer_key)}
    for key in sorted(set(OVERRIDES) - used_keys):
        warnings.warn(f"override {key} names no forward node", stacklevel=2)
    return gm
