"""`Workload`: what one training step needs (model, example batch, loss), apart from the zoo.

Entry points: `Workload(model, inputs, target, loss_fn)` (tracing, measuring and the explorer
take one) and `eager_step(workload)` (one plain autograd step: the numbers to match).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.errors import WorkbenchError

__all__ = [
    "LossFn",
    "StageRole",
    "Workload",
    "eager_step",
    "token_cross_entropy",
    "token_workload",
]

LossFn = Callable[[Any, Any], torch.Tensor]


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in float32 like torchtitan."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


# Far above any real model (Llama3-405B has 126); also bounds layer counts in offload options.
MAX_LAYERS = 1024


@dataclass(frozen=True)
class StageRole:
    """A pipeline stage's place in the model (`workbench.capture.stages`). A stage after the
    first receives hidden states (their gradient is one of its outputs); one before the last
    receives its output's gradient instead of computing a loss."""

    stage: int
    stages: int
    layers: tuple[int, ...]
    tokens: int  # of one microbatch
    seq: int

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "stages": self.stages,
            "layers": list(self.layers),
            "first": self.first,
            "last": self.last,
        }


@dataclass
class Workload:
    """What one training step needs: `loss_fn(model(*inputs), target)`; for a pipeline
    stage before the last, `grad_output` stands in for the loss (`stage`)."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: Any = None
    loss_fn: LossFn | None = None
    name: str = "model"
    config: dict[str, Any] = field(default_factory=dict)
    # Tensor-parallel plan for `trace(..., parallel=Parallel(tp=N))` on a model that is not
    # a reference one: {module path: ParallelStyle} or a callable(model, tp_mesh).
    tp_plan: Any = None
    notes: list[str] = field(default_factory=list)  # what differs from the model as shipped
    stage: StageRole | None = None
    grad_output: torch.Tensor | None = None
    # The model's own kernel switch while traced for a kernel target (`"h100"`, `"cpu"`, ...):
    # a context manager yielding `workbench.capture.kernels.ModelKernels` (torchtitan's
    # FlexAttention as the GPU op, or SDPA for CPU kernels); None: nothing to switch.
    kernel_context: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise WorkbenchError(f"workload name must be a non-empty string, got {self.name!r}")
        if isinstance(self.inputs, torch.Tensor):
            self.inputs = (self.inputs,)
        if not isinstance(self.inputs, tuple | list) or not self.inputs:
            raise WorkbenchError(
                f"workload {self.name!r}: inputs must be the model's input tensors (a tensor or "
                f"a non-empty tuple of them), got {self.inputs!r:.60}"
            )
        if not isinstance(self.inputs[0], torch.Tensor):
            raise WorkbenchError(
                f"workload {self.name!r}: the first input must be a tensor, got "
                f"{type(self.inputs[0]).__name__}"
            )
        self.inputs = tuple(self.inputs)
        if not isinstance(self.model, nn.Module):
            raise WorkbenchError(
                f"workload {self.name!r}: model must be a torch.nn.Module, "
                f"got {type(self.model).__name__}"
            )
        if self.stage is not None and not self.stage.last:
            if not isinstance(self.grad_output, torch.Tensor):
                raise WorkbenchError(
                    f"workload {self.name!r}: pipeline stage {self.stage.stage} is not the last, "
                    "so it needs grad_output (its output's gradient) in place of a loss"
                )
        elif self.loss_fn is None:
            self.loss_fn = _default_loss(self.name, self.target)

    @property
    def tokens(self) -> int:
        """Tokens (or samples) per step: the first input's leading two dims for token ids
        (a pipeline stage's: its microbatch's)."""
        if self.stage is not None:
            return self.stage.tokens
        first = self.inputs[0]
        if first.dtype in (torch.int32, torch.int64) and first.dim() >= 2:
            return int(first.shape[0] * first.shape[1])
        return int(first.shape[0]) if first.dim() else 1


def _default_loss(name: str, target: Any) -> LossFn:
    if isinstance(target, torch.Tensor) and target.dtype in (torch.int32, torch.int64):
        return token_cross_entropy
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        return lambda out, tgt: F.mse_loss(out.float(), tgt.float())
    raise WorkbenchError(
        f"workload {name!r} has no loss function and its target ({type(target).__name__}) "
        "is neither integer class labels nor a float tensor: return (model, batch, loss_fn)"
    )


def token_workload(
    model: nn.Module,
    vocab_size: int,
    *,
    batch: int,
    seq: int,
    device: str | torch.device,
    seed: int,
    name: str,
    config: dict[str, Any],
) -> Workload:
    """A language model's step on `batch` random sequences of `seq` token ids (next-token
    targets, mean cross entropy); on meta, ids without values for fake tracing."""
    with torch.device(device):
        generator = None if str(device) == "meta" else torch.Generator(device).manual_seed(seed)
        ids = torch.randint(0, vocab_size, (batch, seq + 1), generator=generator)
    return Workload(
        model=model,
        inputs=(ids[:, :-1],),
        target=ids[:, 1:],
        loss_fn=token_cross_entropy,
        name=name,
        config=config,
    )


def eager_step(workload: Workload) -> list[torch.Tensor]:
    """One plain autograd train step: `[loss, *grads]`, grads in `model.parameters()` order
    (the order of `JointGraph.param_names`), so it lines up with a traced graph's outputs."""
    assert workload.loss_fn is not None
    params = list(workload.model.parameters())
    loss = workload.loss_fn(workload.model(*workload.inputs), workload.target)
    grads = torch.autograd.grad(loss, params)
    return [loss.detach(), *grads]
