"""Trace one training step (forward + loss + backward) into a single FX graph.

Entry point: `trace(workload, mode="real"|"fake") -> JointGraph`. Parameters and buffers
are lifted as graph inputs; the graph returns `[loss, *grads]`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.fx.traceback import annotate, preserve_node_meta

from workbench.errors import WorkbenchError, describe
from workbench.graph import LOSS_MODULE, InputSpec, JointGraph, describe_nodes
from workbench.models import Workload

Mode = Literal["real", "fake"]


@contextlib.contextmanager
def annotate_modules(model: nn.Module) -> Iterator[None]:
    """Tag every op with the path of the innermost module whose forward ran it."""
    patched: list[tuple[nn.Module, Any]] = []
    for path, module in model.named_modules():
        forward = module.forward
        patched.append((module, module.__dict__.get("forward")))

        def annotated(*args: Any, _forward: Any = forward, _path: str = path, **kw: Any) -> Any:
            with annotate({"module": _path}):
                return _forward(*args, **kw)

        module.forward = annotated  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module, own_forward in patched:
            if own_forward is None:
                del module.forward
            else:
                module.forward = own_forward


@contextlib.contextmanager
def _backward_marking(fake_mode: FakeTensorMode) -> Iterator[None]:
    """All of these are needed for backward nodes to carry autograd_backward and seq_nr."""
    multithreading = torch.autograd.is_multithreading_enabled()
    torch.autograd.set_multithreading_enabled(False)
    try:
        with (
            tracing(TracingContext(fake_mode)),
            preserve_node_meta(),
            torch.compiler._non_strict_tracing_context(),
            torch.compiler._patch_engine_backward(),
        ):
            yield
    finally:
        torch.autograd.set_multithreading_enabled(multithreading)


def _to_fake(fake_mode: FakeTensorMode, value: Any, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_meta:
        converter = fake_mode.fake_tensor_converter
        return converter.from_meta_and_device(fake_mode, value, device)
    return fake_mode.from_tensor(value)


def _device_of(workload: Workload) -> torch.device:
    for tensor in [*workload.model.parameters(), *workload.inputs]:
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def trace(workload: Workload, mode: Mode = "real") -> JointGraph:
    """Trace `workload`'s train step.

    Tracing always runs on fake tensors, so data-dependent control flow fails the same
    way in both modes. `real` keeps the workload's tensors on the graph so it can run;
    `fake` keeps none (a model built on the meta device is traced as if on the CPU).
    """
    if mode not in ("real", "fake"):
        raise WorkbenchError(f"unknown trace mode {mode!r}; choose 'real' or 'fake'")
    model = workload.model
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    real = [*params.values(), *buffers.values(), *workload.inputs, workload.target]
    if mode == "real" and any(isinstance(t, torch.Tensor) and t.is_meta for t in real):
        raise WorkbenchError(
            f"model {workload.name!r} lives on the meta device: trace it with mode='fake' "
            "or build it on cpu/cuda"
        )
    n_params, n_buffers, n_inputs = len(params), len(buffers), len(workload.inputs)
    loss_fn = workload.loss_fn
    assert loss_fn is not None

    def step(*flat: Any) -> list[torch.Tensor]:
        p = flat[:n_params]
        state = dict(zip(params, p, strict=True))
        state.update(zip(buffers, flat[n_params : n_params + n_buffers], strict=True))
        inputs = flat[n_params + n_buffers : n_params + n_buffers + n_inputs]
        output = torch.func.functional_call(model, state, inputs)
        with annotate({"module": LOSS_MODULE, "phase_hint": LOSS_MODULE}):
            loss = loss_fn(output, flat[-1])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise WorkbenchError(
                f"loss function of {workload.name!r} must return a scalar tensor, "
                f"got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
            )
        grads = torch.autograd.grad(loss, p, allow_unused=True)
        unused = [name for name, g in zip(params, grads, strict=True) if g is None]
        if unused:
            raise WorkbenchError(
                f"parameters of {workload.name!r} get no gradient from the loss: "
                f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}; "
                "freeze them (requires_grad=False) or use them"
            )
        return [loss, *grads]

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True, shape_env=ShapeEnv())
    device = _device_of(workload)
    with fake_mode:
        fake_args = [_to_fake(fake_mode, t, device) for t in real]
    try:
        with _backward_marking(fake_mode), annotate_modules(model):
            gm = make_fx(step, record_stack_traces=True)(*fake_args)
    except WorkbenchError:
        raise
    except GuardOnDataDependentSymNode as err:
        raise WorkbenchError(
            f"model {workload.name!r} cannot be traced: Python control flow depends on "
            f"tensor values ({_where(err)}); use torch.where/torch.cond or fix the shapes"
        ) from None
    except Exception as err:  # torch raises many types; the user needs one clear line
        raise WorkbenchError(f"model {workload.name!r} cannot be traced: {describe(err)}") from err
    _refuse_data_dependent_shapes(gm, workload.name)
    return JointGraph(
        gm=gm,
        nodes=describe_nodes(gm),
        inputs=_input_specs(gm, params, buffers, n_inputs),
        model_name=workload.name,
        mode=mode,
        tokens=workload.tokens,
        config=dict(workload.config),
        example_inputs=real if mode == "real" else None,
    )


def _refuse_data_dependent_shapes(gm: fx.GraphModule, name: str) -> None:
    """Sizes that depend on tensor values (boolean masks, nonzero) have no byte count to
    estimate or save: name the first op that makes one, and the user's line if known."""
    for node in gm.graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor) and not all(isinstance(d, int) for d in value.shape):
                line = _user_line(node.meta.get("stack_trace") or "")
                raise WorkbenchError(
                    f"model {name!r} has data-dependent shapes: {node.target} "
                    f"({node.name}{', ' + line if line else ''}) makes a tensor whose size "
                    "depends on tensor values; use fixed-size ops (torch.where, masking by "
                    "multiplication) instead"
                )


def _user_line(stack_trace: str) -> str:
    """The last `File ...` line of a stack trace outside torch itself."""
    lines = [
        line.strip()
        for line in stack_trace.splitlines()
        if line.strip().startswith("File ") and "/torch/" not in line
    ]
    return lines[-1] if lines else ""


def _input_specs(
    gm: fx.GraphModule, params: dict[str, Any], buffers: dict[str, Any], n_inputs: int
) -> list[InputSpec]:
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    kinds: list[tuple[str, str]] = [
        *(("param", name) for name in params),
        *(("buffer", name) for name in buffers),
        *(("input", f"inputs[{i}]") for i in range(n_inputs)),
        ("target", "target"),
    ]
    return [
        InputSpec(placeholder=p, kind=kind, fqn=fqn)  # type: ignore[arg-type]
        for p, (kind, fqn) in zip(placeholders, kinds, strict=True)
    ]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def _where(err: BaseException) -> str:
    """The user's source line that asked for a tensor value, when torch reports it."""
    return _user_line(str(err)) or _first_line(err)


def timed_trace(workload: Workload, mode: Mode) -> tuple[JointGraph, float]:
    """`trace` plus its wall time in seconds (for the CLI and benchmarks)."""
    start = time.perf_counter()
    graph = trace(workload, mode)
    return graph, time.perf_counter() - start
