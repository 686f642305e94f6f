"""Misbehaving user factories for the bad-input suite (`--model tests.bad_models:NAME`)."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from workbench.capture.models import Workload

NOT_CALLABLE = 42


def raises():
    raise RuntimeError("weights not found")


def exits():
    sys.exit(3)


def exits_zero():
    sys.exit(0)


def prints():
    print("hello from the factory")
    os.write(1, b"native write\n")  # as a C library would, past sys.stdout
    torch.manual_seed(0)
    return nn.Linear(4, 2), (torch.randn(3, 4), torch.randint(0, 2, (3,)))


class Nonzero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y[y > 0].sum().expand(x.shape[0], 1) * torch.ones(x.shape[0], 2)


def data_dependent_shape():
    torch.manual_seed(0)
    return Nonzero(), (torch.randn(4, 8), torch.randint(0, 2, (4,)))


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(torch.relu(layer(x)))
        return self.head(x)


def dropout():
    torch.manual_seed(0)
    return WithDropout(), (torch.randn(8, 16), torch.randint(0, 4, (8,)))


def nan_weights():
    """A NaN loss: bitwise equal to itself, though never `==`."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    return model, (torch.randn(3, 4), torch.randn(3, 2))


def wrong_input_dtype():
    """Traces on fake tensors (their matmul skips the dtype check), fails on real ones."""
    torch.manual_seed(0)
    return nn.Linear(4, 2), (torch.randint(0, 5, (3, 4)), torch.randn(3, 2))


# --- factories for the second probe (issue 27): TP plans, inputs, interrupts -------------


def _mlp_parts() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return model, torch.randn(4, 8), torch.randint(0, 4, (4,))


def tp_plan_wrong_type() -> Workload:
    model, x, y = _mlp_parts()
    return Workload(model, (x,), y, name="tp_plan_wrong_type", tp_plan=42)


def _plan_raises(model: nn.Module, mesh: object) -> None:
    raise RuntimeError("plan exploded")


def tp_plan_raises() -> Workload:
    model, x, y = _mlp_parts()
    return Workload(model, (x,), y, name="tp_plan_raises", tp_plan=_plan_raises)


def tp_plan_missing_module() -> Workload:
    from torch.distributed.tensor.parallel import ColwiseParallel

    model, x, y = _mlp_parts()
    return Workload(model, (x,), y, name="tp_plan_missing", tp_plan={"nope": ColwiseParallel()})


def no_inputs() -> Workload:
    model, _, y = _mlp_parts()
    return Workload(model, (), y, name="no_inputs")


def interrupts():
    raise KeyboardInterrupt


def logs_then_fails():
    """Logs on torch's own logger (which writes to stderr itself), as fake tensors do before
    raising, then fails: the CLI must show only its one error line."""
    import logging

    logging.getLogger("torch._subclasses.fake_tensor").error("fake tensor said\nline 2\nline 3")
    raise RuntimeError("the model failed")


def mutates_parameter():
    """A forward that writes into a parameter: graph and eager steps see different weights."""

    class Mutating(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.lin.weight.mul_(1.5)
            return self.lin(x)

    model, x, y = _mlp_parts()
    return Mutating(), (x, y)


def fails_in_ranks():
    """Builds outside a process group (the checks before spawning), fails inside a rank."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "gloo":
        raise RuntimeError("only in a rank")
    model, x, y = _mlp_parts()
    return model, (x, y)
