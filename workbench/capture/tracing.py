"""How a train step becomes one FX graph: make_fx under fake tensors with backward nodes
marked, module paths annotated, and the checks on what the user's step returns.

Entry point: `trace_step(workload, step, inputs, kinds, mode, kernels) -> JointGraph`, which
`workbench.capture.trace` (one device) and `workbench.capture.parallel` (one rank) call.
"""

from __future__ import annotations

import contextlib
import gc
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.fx.traceback import annotate, preserve_node_meta

from workbench.capture.constant_reads import (
    DATA_DEPENDENT_ADVICE,
    drop_constant_reads,
    user_frame,
)
from workbench.capture.fake_kernels import traceable_kernels
from workbench.capture.gpu_norm import restore_fused_rms_norm
from workbench.capture.graph import LOSS_MODULE, InputKind, InputSpec, JointGraph, describe_nodes
from workbench.capture.kernels import (
    AttentionRecord,
    ModelKernels,
    gpu_arch,
    gpu_kernels,
    kernels_note,
)
from workbench.capture.ops import op_name
from workbench.capture.workload import Workload
from workbench.errors import WorkbenchError, describe

Mode = Literal["real", "fake"]


@contextlib.contextmanager
def annotate_modules(model: nn.Module) -> Iterator[None]:
    """Tag every op with the path of the innermost module whose forward ran it."""
    patched: list[tuple[nn.Module, Any]] = []
    for path, module in model.named_modules():
        if "parametrizations" in path.split("."):
            continue  # a parameter's getter (FSDP's gather) belongs to the module using it
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


@contextlib.contextmanager
def backward_without_stack_traces() -> Iterator[None]:
    """Around the step's `autograd.grad` while make_fx traces it: backward ops are recorded
    without capturing a Python stack each. Their stacks lie inside torch's autograd (a
    backward node's source comes from its forward op by `seq_nr`, which this leaves alone),
    so only the time goes (stack capture was a sixth of a profiled sharded 8B trace)."""
    mode = get_proxy_mode()
    tracer = getattr(mode, "tracer", None)
    if tracer is None or not getattr(tracer, "record_stack_traces", False):
        yield
        return
    tracer.record_stack_traces = False
    try:
        yield
    finally:
        tracer.record_stack_traces = True


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while make_fx builds the graph: every full collection
    walks the growing graph and its fake tensors again (a tenth of a large trace); the
    collector runs as usual afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _to_fake(fake_mode: FakeTensorMode, value: Any, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_meta:
        converter = fake_mode.fake_tensor_converter
        return converter.from_meta_and_device(fake_mode, value, device)
    return fake_mode.from_tensor(value)


def workload_device(workload: Workload) -> torch.device:
    """The device of the workload's first non-meta tensor (the CPU for a meta model)."""
    for tensor in [*workload.model.parameters(), *workload.inputs]:
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def check_loss(workload: Workload, loss: Any) -> torch.Tensor:
    """The loss must be one number: the step differentiates it."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise WorkbenchError(
            f"loss function of {workload.name!r} must return a scalar tensor, "
            f"got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
        )
    return loss


def traced_loss(workload: Workload, output: Any, target: Any) -> torch.Tensor:
    """The step's loss, checked (`check_loss`), called from a frame named `forward`: FX
    records a node's stack only from the first `forward` frame on
    (`Tracer._filter_traceback_frames`), so without one the loss nodes carry no source line
    (the Source column of the activation table, and of graph trainer's log, was empty)."""
    loss_fn = workload.loss_fn
    assert loss_fn is not None

    def forward() -> Any:
        return loss_fn(output, target)

    return check_loss(workload, forward())


def step_outputs(
    workload: Workload,
    output: Any,
    last: Any,
    params: Sequence[torch.Tensor],
    names: list[str],
    received: torch.Tensor | None = None,
) -> list[Any]:
    """The traced step's outputs: `[loss, *param grads]`. A pipeline stage's
    (`workload.stage`) are `[loss or its output, *param grads, its input's grad]`: it
    differentiates its output against `last` (the received gradient, `grad_output`) unless it
    is the last stage, and `received` (its `inputs[0]`) unless it is the first."""
    stage = workload.stage
    wrt = list(params)
    if stage is not None and not stage.first:
        assert received is not None
        wrt.append(received)
    if stage is None or stage.last:
        with annotate({"module": LOSS_MODULE, "phase_hint": LOSS_MODULE}):
            first = traced_loss(workload, output, last)
        with backward_without_stack_traces():
            grads = torch.autograd.grad(first, wrt, allow_unused=True)
    else:
        first = output
        with backward_without_stack_traces():
            grads = torch.autograd.grad(output, wrt, grad_outputs=last, allow_unused=True)
    check_grads(workload, names, grads[: len(params)])
    return [first, *grads]


def last_input(workload: Workload) -> Any:
    """The step's last argument: the target, or a pipeline stage's received output gradient
    when it has no loss."""
    stage = workload.stage
    return workload.grad_output if stage is not None and not stage.last else workload.target


def last_input_kind(workload: Workload) -> tuple[InputKind, str]:
    stage = workload.stage
    return (
        ("input", "grad_output") if stage is not None and not stage.last else ("target", "target")
    )


def check_grads(workload: Workload, names: list[str], grads: Sequence[Any]) -> None:
    """Every lifted parameter must get a gradient, or the graph's outputs misalign."""
    unused = [name for name, g in zip(names, grads, strict=True) if g is None]
    if unused:
        raise WorkbenchError(
            f"parameters of {workload.name!r} get no gradient from the loss: "
            f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}; "
            "freeze them (requires_grad=False) or use them"
        )


@contextlib.contextmanager
def kernel_dispatch(kernels: str) -> Iterator[AttentionRecord | None]:
    """While tracing for a GPU (`workbench.capture.kernels`), its attention kernels; yields
    the record of what it chose (None for a device's own kernels)."""
    arch = gpu_arch(kernels)
    if arch is None:
        yield None
        return
    with gpu_kernels(arch) as record:
        yield record


@contextlib.contextmanager
def model_kernels(workload: Workload, kernels: str) -> Iterator[ModelKernels]:
    """The workload's own kernel switch for `kernels` (`Workload.kernel_context`), if any."""
    if workload.kernel_context is None:
        yield ModelKernels()
        return
    with workload.kernel_context(kernels) as switched:
        yield switched


def kernel_notes(
    kernels: str, mode: Mode, record: AttentionRecord | None, switched: ModelKernels
) -> list[str]:
    return [
        kernels_note(kernels, mode),
        *switched.notes,
        *(record.notes() if record is not None else []),
    ]


def trace_step(
    workload: Workload,
    step: Callable[..., list[torch.Tensor]],
    args: list[Any],
    kinds: list[tuple[InputKind, str]],
    mode: Mode,
    kernels: str,
) -> JointGraph:
    """make_fx `step(*args)` on fake copies of `args`; `kinds` names each placeholder.
    Non-tensor arguments (a device mesh) pass through as opaque inputs. `kernels`: a GPU's
    name traces its attention kernels (`workbench.capture.kernels.resolve_kernels`)."""
    if mode == "real" and any(isinstance(t, torch.Tensor) and t.is_meta for t in args):
        raise WorkbenchError(
            f"model {workload.name!r} lives on the meta device: trace it with mode='fake' "
            "or build it on cpu/cuda"
        )
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True, shape_env=ShapeEnv())
    device = workload_device(workload)
    with fake_mode:
        fake_args = [_to_fake(fake_mode, t, device) for t in args]
    try:
        with (  # the model's kernels switched before its forwards are annotated
            model_kernels(workload, kernels) as switched,
            _backward_marking(fake_mode),
            annotate_modules(workload.model),
            collector_paused(),
            kernel_dispatch(kernels) as record,
            traceable_kernels(),
        ):
            # every input is fake: a real tensor is a constant the step built, whose value
            # it may read (`workbench.capture.constant_reads`)
            gm = make_fx(step, record_stack_traces=True, _error_on_data_dependent_ops=False)(
                *fake_args
            )
    except WorkbenchError:
        raise
    except (GuardOnDataDependentSymNode, DataDependentOutputException) as err:
        raise WorkbenchError(
            f"model {workload.name!r} cannot be traced: Python control flow depends on "
            f"tensor values ({user_frame(err) or _where(err)}); {DATA_DEPENDENT_ADVICE}"
        ) from None
    except Exception as err:  # torch raises many types; the user needs one clear line
        raise WorkbenchError(f"model {workload.name!r} cannot be traced: {describe(err)}") from err
    restore_fused_rms_norm(gm)
    _refuse_data_dependent_shapes(gm, workload.name)
    drop_constant_reads(gm, workload.name)
    record_absent_outputs(gm)
    inputs = _input_specs(gm, kinds)
    lifted = apply_model_kernels(gm, switched)
    inputs += [spec for spec, _ in lifted]
    return JointGraph(
        gm=gm,
        nodes=describe_nodes(gm),
        inputs=inputs,
        model_name=workload.name,
        mode=mode,
        tokens=workload.tokens,
        config={**workload.config, "kernels": kernels},
        example_inputs=[*args, *(value for _, value in lifted)] if mode == "real" else None,
        notes=[*workload.notes, *kernel_notes(kernels, mode, record, switched)],
    )


def record_absent_outputs(gm: fx.GraphModule) -> None:
    """A getitem of an op's output that is no tensor (the GPU attention ops' `cum_seq_q` None,
    `max_q` an int) carries no `meta["val"]` when traced through DTensor or graph trainer's
    tracer, where make_fx otherwise records the value: record it, so the getitem reads as
    holding no storage. Likewise a placeholder whose argument is no tensor (a target of None:
    the model computes its own loss)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "val" not in node.meta:
            node.meta["val"] = None
            continue
        if node.op != "call_function" or "val" in node.meta or node.target is not operator.getitem:
            continue
        source, index = node.args
        outputs = source.meta.get("val") if isinstance(source, fx.Node) else None
        if isinstance(outputs, (tuple, list)) and isinstance(index, int):
            if not isinstance(outputs[index], torch.Tensor):
                node.meta["val"] = outputs[index]


def apply_model_kernels(
    gm: fx.GraphModule, switched: ModelKernels
) -> list[tuple[InputSpec, torch.Tensor]]:
    """After tracing, what the model's kernel switch asked of the graph: its ops' custom
    metadata set, its constants lifted to inputs (`lift_constants`, whose result it returns)."""
    for node in gm.graph.nodes:
        entries = switched.custom.get(op_name(node.target)) if node.op == "call_function" else None
        if entries:
            node.meta["custom"] = {**(node.meta.get("custom") or {}), **entries}
    return lift_constants(gm, switched.names)


def lift_constants(
    gm: fx.GraphModule, names: dict[int, str]
) -> list[tuple[InputSpec, torch.Tensor]]:
    """The tensors a model's kernels close over (a flex attention's block mask: `names`,
    `id(tensor) -> fqn`) become graph inputs: make_fx reads each through a `get_attr` per use,
    which would count it once per layer. One placeholder per tensor replaces its reads.
    Subgraphs an op takes (a flex attention's score and mask functions) hold no tensor: their
    `get_attr` records `meta["val"] = None`. Returns the new inputs' specs and values (a
    real-mode graph's example inputs take them)."""
    lifted: dict[str, fx.Node] = {}
    specs: list[tuple[InputSpec, torch.Tensor]] = []
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        target = str(node.target)
        value = getattr(gm, target)
        if isinstance(value, fx.GraphModule):
            node.meta["val"] = None
            continue
        if not isinstance(value, torch.Tensor) or id(value) not in names:
            continue
        if target not in lifted:
            fqn = names[id(value)]
            with gm.graph.inserting_after(last):
                last = lifted[target] = gm.graph.placeholder(fqn.replace(".", "_"))
            last.meta["val"] = node.meta.get("val")
            specs.append((InputSpec(placeholder=last.name, kind="input", fqn=fqn), value))
        node.replace_all_uses_with(lifted[target])
        gm.graph.erase_node(node)
    for target in lifted:
        delattr(gm, target)
    if lifted:
        gm.recompile()
    return specs


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


def _input_specs(gm: fx.GraphModule, kinds: list[tuple[InputKind, str]]) -> list[InputSpec]:
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [
        InputSpec(placeholder=p, kind=kind, fqn=fqn)
        for p, (kind, fqn) in zip(placeholders, kinds, strict=True)
    ]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def _where(err: BaseException) -> str:
    """The user's source line that asked for a tensor value, when torch reports it."""
    return _user_line(str(err)) or _first_line(err)
