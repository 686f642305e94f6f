"""Trace one training step (forward + loss + backward) into a single FX graph.

Entry point: `trace(workload, mode="real"|"fake", parallel=None, kernels=None) -> JointGraph`.
Parameters and buffers are lifted as graph inputs; the graph returns `[loss, *grads]`. Fake
mode traces the kernels a GPU runs (`workbench.capture.kernels`); reference models traced in
fake mode trace three layers and stamp the rest (`workbench.capture.stamp`).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch

from workbench.capture.graph import InputKind, JointGraph
from workbench.capture.kernels import resolve_kernels
from workbench.capture.stamp import TEMPLATE_LAYERS, keep_layers, trace_layers
from workbench.capture.tracing import (
    Mode,
    last_input,
    last_input_kind,
    step_outputs,
    trace_step,
    workload_device,
)
from workbench.capture.workload import Workload
from workbench.errors import WorkbenchError

if TYPE_CHECKING:
    from workbench.capture.parallel import Parallel


def trace(
    workload: Workload,
    mode: Mode = "real",
    parallel: Parallel | None = None,
    stamp: bool = True,
    templates: dict[Hashable, Any] | None = None,
    kernels: str | None = None,
) -> JointGraph:
    """Trace `workload`'s train step.

    Tracing always runs on fake tensors, so data-dependent control flow fails the same
    way in both modes. `real` keeps the workload's tensors on the graph so it can run;
    `fake` keeps none (a model built on the meta device is traced as if on the CPU).
    With `parallel`, the graph is one rank's step of the sharded model
    (`workbench.capture.parallel.trace_rank`; for torchtitan models graph trainer's own
    `parallelize`, `workbench.capture.titan_rank.trace_titan_rank`); with its pp above one,
    of one pipeline stage (`workbench.capture.stages.trace_stages`). A reference model
    (Llama3, DeepSeek-V3) in fake mode with more than three layers traces three and stamps
    the others, node for node the full trace (`workbench.capture.stamp.trace_layers`;
    `config["stamped"]` counts them); `stamp=False` traces every layer. `templates` (a dict
    kept across calls, e.g. over pipeline stages) lets a later call stamp from an earlier
    template whose layers differ only in their ids. `kernels`: what the graph's ops are
    traced for in fake mode, a GPU (`"h100"`, the default; `"h200"`, `"b200"`: attention as
    torch's CUDA selection picks it there) or `"cpu"`; real mode keeps its device's own
    (`workbench.capture.kernels.resolve_kernels`); `config["kernels"]` and the notes say which.
    """
    if not isinstance(workload, Workload):
        raise TypeError(
            f"trace: workload must be a Workload (workbench.capture.models.load_workload "
            f"makes one from a model name), got {type(workload).__name__}"
        )
    if mode not in ("real", "fake"):
        raise WorkbenchError(f"unknown trace mode {mode!r}; choose 'real' or 'fake'")
    if parallel is not None and getattr(parallel, "pp", 1) > 1 and workload.stage is None:
        raise WorkbenchError(
            f"trace: parallel pp {parallel.pp} splits the model into pipeline stages; trace "
            f"them with workbench.capture.stages.trace_stages(workload, mode, parallel, "
            f"Pipeline(pp={parallel.pp}))"
        )
    kernels = resolve_kernels(kernels, mode, workload_device(workload))
    layers = _reference_layers(workload)
    if stamp and mode == "fake" and len(layers) > TEMPLATE_LAYERS:
        return trace_layers(
            functools.partial(keep_layers, workload),
            layers,
            mode,
            parallel,
            trace_fn=functools.partial(trace, stamp=False, kernels=kernels),
            templates=templates,
            kernels=kernels,
        )
    if parallel is not None:  # imported here: plain traces load no model zoo (TP plans)
        from workbench.capture.parallel import Parallel, trace_rank
        from workbench.capture.titan_rank import is_titan_workload, trace_titan_rank

        if not isinstance(parallel, Parallel):
            raise TypeError(
                f"trace: parallel must be None or a Parallel (e.g. Parallel(fsdp=2, tp=2)), "
                f"got {parallel!r}"
            )
        if is_titan_workload(workload):  # sharded by graph trainer's own parallelize
            return trace_titan_rank(workload, mode, parallel, kernels)
        return trace_rank(workload, mode, parallel, kernels=kernels)
    step, real, kinds = functional_step(workload)
    return trace_step(workload, step, real, kinds, mode, kernels)


def functional_step(
    workload: Workload,
) -> tuple[Callable[..., list[torch.Tensor]], list[Any], list[tuple[InputKind, str]]]:
    """The train step `trace` traces on one device, as a function of its flat inputs
    (parameters, buffers, the batch, the target), with those inputs and what each stands
    for: the step run eagerly is the traced graph's reference."""
    model = workload.model
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    real = [*params.values(), *buffers.values(), *workload.inputs, last_input(workload)]
    n_params, n_buffers, n_inputs = len(params), len(buffers), len(workload.inputs)

    def step(*flat: Any) -> list[torch.Tensor]:
        p = flat[:n_params]
        state = dict(zip(params, p, strict=True))
        state.update(zip(buffers, flat[n_params : n_params + n_buffers], strict=True))
        inputs = flat[n_params + n_buffers : n_params + n_buffers + n_inputs]
        output = torch.func.functional_call(model, state, inputs)
        return step_outputs(workload, output, flat[-1], p, list(params), inputs[0])

    kinds: list[tuple[InputKind, str]] = [
        *(("param", name) for name in params),
        *(("buffer", name) for name in buffers),
        *(("input", f"inputs[{i}]") for i in range(n_inputs)),
        last_input_kind(workload),
    ]
    return step, real, kinds


def _reference_layers(workload: Workload) -> list[int]:
    """The layer ids of a model whose identical blocks are stamped: a reference model
    (Llama3, DeepSeek-V3) or a torchtitan decoder (its `layers` ModuleDict, one device or
    one rank of graph trainer's `parallelize`); none for other models. Without the zoo
    imported, no model is one of them."""
    llama3 = sys.modules.get("workbench.capture.models.llama3")
    layers = getattr(workload.model, "layers", None)
    reference = llama3 is not None and isinstance(workload.model, llama3.Llama3)
    titan = workload.name.startswith("torchtitan:") and isinstance(layers, torch.nn.ModuleDict)
    if not (reference or titan) or not isinstance(layers, torch.nn.ModuleDict):
        return []
    if not all(str(k).isdigit() for k in layers):
        return []
    return [int(key) for key in layers]


def timed_trace(
    workload: Workload, mode: Mode, parallel: Parallel | None = None, kernels: str | None = None
) -> tuple[JointGraph, float]:
    """`trace` plus its wall time in seconds (for the CLI and benchmarks)."""
    start = time.perf_counter()
    graph = trace(workload, mode, parallel, kernels=kernels)
    return graph, time.perf_counter() - start
