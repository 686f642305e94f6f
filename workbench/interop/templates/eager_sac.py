"""Eager selective activation checkpointing for one SAC Workbench policy.

Entry points: `apply_ac(model)` and `policy_fn(ctx, func, *args, **kwargs)`.
"""

# The template of the `policy_fn` export (`workbench.interop.templates` says how it is used).

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from workbench.capture.ops import is_random, mutates, op_name
from workbench.decide.engine import Request, eager_tag
from workbench.decide.facts import OpCounter
from workbench.decide.presets import preset_rule
from workbench.interop.templates.constants import (
    LAYERS_ATTR,
    OVERRIDES,
    PRESET,
    SELECTORS,
    WRAP_LAYERS,
    WRAPPED_MARKER,
    WRITTEN_LATER,
)

_RULE = preset_rule(PRESET)
_REQUEST = Request(preset=PRESET, selectors=SELECTORS, overrides=OVERRIDES)
# The module stack kept by apply_ac's hooks, and one op counter each for the original forward
# and the recompute (`ctx.is_recompute`). Reset at the start of every layer forward.
_STACK: list[str] = []
_COUNTERS: dict[bool, OpCounter] = {False: OpCounter(), True: OpCounter()}


def current_module() -> str:
    """Path of the innermost module running now, e.g. `layers.0.attention.wq`."""
    return _STACK[-1] if _STACK else ""


def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save or recompute `func`'s output by the rules above (see `eager_tag`)."""
    row = (
        str(func),
        current_module(),
        op_name(func),
        is_random(func),
        mutates(func),
        None,
        (),
        None,
    )
    facts = _COUNTERS[bool(ctx.is_recompute)].facts(row)
    return eager_tag(facts, _RULE, _REQUEST, WRITTEN_LATER).policy


def context_fn() -> Any:
    """Fresh SAC contexts for each checkpoint call; `policy_fn` is looked up at call time."""
    return create_selective_checkpoint_contexts(policy_fn)


def apply_ac(model: torch.nn.Module, layers_attr: str = LAYERS_ATTR) -> torch.nn.Module:
    """Checkpoint every block of `model.<layers_attr>` with `policy_fn`, in place.

    `layers_attr` defaults to the block container of the traced graph (`LAYERS_ATTR`: for
    Hugging Face models `model.layers`, `transformer.h`, `bert.encoder.layer`, ...). Each
    block's forward is replaced by a non-reentrant `checkpoint` of the original (module
    names and state_dict keys stay), and the block's submodules get forward hooks that keep
    the module stack `policy_fn` reads. Nothing outside the blocks is checkpointed. Returns
    `model`; deep-copy it first to keep an unwrapped one.
    """
    if not WRAP_LAYERS:
        return model
    blocks = _blocks(model, layers_attr)
    for name, block in blocks.named_children():
        path = f"{layers_attr}.{name}"
        if getattr(block, WRAPPED_MARKER, False):
            raise RuntimeError(f"{path} is already checkpointed by apply_ac")
        for sub_path, sub in block.named_modules(prefix=path):
            if sub is not block:
                sub.register_forward_pre_hook(functools.partial(_enter, sub_path))
                sub.register_forward_hook(_leave, always_call=True)
        block.forward = _checkpointed(block.forward, path)
        setattr(block, WRAPPED_MARKER, True)
    return model


def _blocks(model: torch.nn.Module, layers_attr: str) -> torch.nn.Module:
    """`model.<layers_attr>`, or a ValueError naming the module lists the model has."""
    try:
        return functools.reduce(getattr, layers_attr.split("."), model)  # type: ignore[no-any-return]
    except AttributeError:
        lists = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
        raise ValueError(
            f"apply_ac: {type(model).__name__} has no {layers_attr!r}; pass layers_attr= the "
            f"module holding its blocks (its module lists: {', '.join(lists) or 'none'})"
        ) from None


def _enter(path: str, module: torch.nn.Module, args: Any) -> None:
    _STACK.append(path)


def _leave(module: torch.nn.Module, args: Any, output: Any) -> None:
    if _STACK:
        _STACK.pop()


def _checkpointed(forward: Callable[..., Any], path: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        # Runs for the forward and again for the recompute, which may stop early (an
        # exception): every run starts from a clean stack and fresh counts.
        _STACK[:] = [path]
        _COUNTERS.update({False: OpCounter(), True: OpCounter()})
        try:
            return forward(*args, **kwargs)
        finally:
            _STACK.clear()

    @functools.wraps(forward)
    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return checkpointed_forward
