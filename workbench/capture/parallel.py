"""One rank of a sharded train step: FSDP x TP on a 2-D device mesh (and EP of the reference
MoE's routed experts on torchtitan's ("efsdp", "ep") mesh), traced in one process.

Entry points: `Parallel(fsdp=F, tp=T, ep=E)`, `trace_rank(workload, mode, parallel, mesh=None)`
(what `trace(..., parallel=)` calls), and for callers that run ranks: `fake_process_group`,
`device_mesh`, `shard_workload` -> `RankWorkload`, `trace_sharded`, `eager_rank_step`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from workbench.capture.degrees import EXPERT_MESH_DIMS, MESH_DIMS, Parallel
from workbench.capture.expert_parallel import (
    apply_expert_parallel,
    check_expert_parallel,
    expert_mesh,
    routing_note,
)
from workbench.capture.fits import available_bytes
from workbench.capture.graph import InputKind, JointGraph
from workbench.capture.kernels import resolve_kernels
from workbench.capture.models import DTYPES, Workload
from workbench.capture.models.deepseek_v3 import GroupedExperts, MoE
from workbench.capture.models.llama3 import Llama3
from workbench.capture.param_shards import (
    ParamShard,
    retie,
    shard_parameters,
    tied_parameters,
)
from workbench.capture.tp_plan import check_tp_plan
from workbench.capture.tracing import (
    Mode,
    last_input,
    last_input_kind,
    step_outputs,
    trace_step,
    workload_device,
)
from workbench.errors import WorkbenchError, describe

__all__ = [
    "REFERENCE_MESH_DIMS",
    "Parallel",
    "RankWorkload",
    "TpPlan",
    "check_fsdp_shapes",
    "device_mesh",
    "eager_rank_step",
    "fake_process_group",
    "fake_world",
    "reference_tp_plan",
    "shard_workload",
    "trace_rank",
    "trace_sharded",
]

# The reference models' mesh: the workbench's less cp, which they refuse (`trace_rank`).
REFERENCE_MESH_DIMS = tuple(dim for dim in MESH_DIMS if dim != "cp")
# A TP plan: {module path: ParallelStyle} for `parallelize_module`, or a callable that
# parallelizes the model on the "tp" mesh itself.
TpPlan = dict[str, ParallelStyle] | Callable[[nn.Module, DeviceMesh], Any]


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """torch's built-in `fake` process group (rank 0 of `world_size`, collectives do
    nothing), destroyed on exit with DTensor's plans for it. The group is process-global, so
    one that someone else initialised is refused rather than replaced."""
    if dist.is_initialized():
        raise WorkbenchError(
            f"a torch.distributed process group is already initialised (backend "
            f"{dist.get_backend()}, world size {dist.get_world_size()}): destroy it first, or "
            "pass its mesh to workbench.capture.parallel.trace_rank(workload, mode, parallel, mesh)"
        )
    _forget_dtensor_plans()
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_dtensor_plans()


def _forget_dtensor_plans() -> None:
    """DTensor caches redistribution plans and sharding decisions by spec, and device
    meshes compare equal by shape and dimension names, not by process group: a later
    world's mesh would reuse plans naming this world's groups (a flattened mesh's, for one),
    which no longer exist or are other groups."""
    from torch.distributed.tensor import _redistribute

    _redistribute._gen_transform_infos.cache_clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's


@contextlib.contextmanager
def fake_process_group(parallel: Parallel, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """`fake_world` with the workbench's ("fsdp", "tp") mesh over it."""
    with fake_world(parallel.world_size):
        yield device_mesh(parallel, device_type)


def device_mesh(parallel: Parallel, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D ("fsdp", "tp") mesh over the initialised process group."""
    sizes = parallel.mesh_sizes()
    shape = tuple(sizes[dim] for dim in REFERENCE_MESH_DIMS)
    return init_device_mesh(device_type, shape, mesh_dim_names=REFERENCE_MESH_DIMS)


def reference_tp_plan(model: nn.Module, ep: int = 1) -> dict[str, ParallelStyle] | None:
    """Megatron-style TP with sequence-parallel norms for the reference Llama3/DeepSeek-V3:
    q/k/v and w1/w3 column-wise, wo and w2 row-wise into sequence shards, the output
    projection column-wise over the vocabulary (for `loss_parallel`). MoE blocks stay
    replicated over TP: they get the whole sequence and hand back their sequence shard;
    under EP (`ep` > 1) they route their sequence shard, as torchtitan's EP with SP does."""
    if not isinstance(model, Llama3):
        return None
    ends: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    # a pipeline stage holds some of them (`workbench.capture.stages`)
    plan = {name: style for name, style in ends.items() if getattr(model, name) is not None}
    for key, layer in model.layers.items():
        p = f"layers.{key}"
        plan[f"{p}.attention_norm"] = SequenceParallel()
        plan[f"{p}.attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        for name in ("wq", "wk", "wv"):
            plan[f"{p}.attention.{name}"] = ColwiseParallel()
        plan[f"{p}.attention.wo"] = RowwiseParallel(output_layouts=Shard(1))
        plan[f"{p}.ffn_norm"] = SequenceParallel()
        if isinstance(layer.feed_forward, MoE):
            seen: Placement = Shard(1) if ep > 1 else Replicate()
            plan[f"{p}.feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(seen,),
                use_local_input=True,
                output_layouts=(seen,),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            )
            continue
        plan[f"{p}.feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        plan[f"{p}.feed_forward.w1"] = ColwiseParallel()
        plan[f"{p}.feed_forward.w3"] = ColwiseParallel()
        plan[f"{p}.feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def check_tp_shapes(workload: Workload, parallel: Parallel) -> None:
    """TP splits heads, kv heads, the FFN and the vocabulary; sequence parallelism the
    sequence. (FSDP's row split is checked per parameter while sharding.)"""
    model, tp = workload.model, parallel.tp
    if tp == 1 or not isinstance(model, Llama3):
        return
    config = model.config
    seq = workload.stage.seq if workload.stage else int(workload.inputs[0].shape[1])
    sizes = {
        "heads": config.n_heads,
        "kv heads": config.n_kv_heads,
        "ffn hidden size": config.ffn_hidden,
        "vocabulary": config.vocab_size,
        "sequence": seq,
    }
    for what, size in sizes.items():
        if size % tp:
            raise WorkbenchError(
                f"--tp {tp} does not divide the {what} of {workload.name!r} ({size}); "
                f"choose a tp that divides {size}"
            )


def check_fsdp_shapes(workload: Workload, parallel: Parallel) -> None:
    """FSDP splits each parameter's rows (of its TP shard, under the reference TP plan) over
    the fsdp ranks: refused before tracing, in the words sharding would use (routed experts
    under EP are split by `check_expert_parallel`'s rule instead)."""
    fsdp, tp = parallel.fsdp, parallel.tp
    if fsdp == 1:
        return
    plan = (reference_tp_plan(workload.model, parallel.ep) if tp > 1 else None) or {}
    seen: set[int] = set()
    for path, module in workload.model.named_modules():
        if parallel.ep > 1 and isinstance(module, GroupedExperts):
            continue
        style = plan.get(path)
        split = isinstance(style, ColwiseParallel) or (
            isinstance(style, RowwiseParallel) and isinstance(module, nn.Embedding)
        )
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            rows = param.shape[0] // (tp if split else 1) if param.dim() else 0
            if rows % fsdp or not rows:
                fqn = f"{path}.{name}" if path else name
                raise WorkbenchError(
                    f"fsdp {fsdp} does not divide parameter {fqn} of {workload.name!r} "
                    f"({rows} rows per tp rank); choose an fsdp that divides {rows}"
                )


@dataclass
class RankWorkload:
    """A workload sharded for one rank: its model holds 2-D DTensor parameters (routed
    experts' on `experts_mesh`, under EP)."""

    workload: Workload
    parallel: Parallel
    mesh: DeviceMesh
    shards: list[ParamShard] = field(default_factory=list)
    experts_mesh: DeviceMesh | None = None

    def local_params(self) -> list[torch.Tensor]:
        """This rank's parameter shards, detached leaves in `shards` order."""
        named = dict(self.workload.model.named_parameters())
        return [
            _local(named[s.key]).detach().requires_grad_(named[s.key].requires_grad)
            for s in self.shards
        ]


def shard_workload(
    workload: Workload,
    parallel: Parallel,
    mesh: DeviceMesh,
    tp_plan: TpPlan | None = None,
) -> RankWorkload:
    """A copy of `workload` whose model is TP-parallelized on `mesh["tp"]` and whose every
    parameter is an fsdp-sharded DTensor gathered by `GatherParameter`. `tp_plan` (or the
    workload's `tp_plan` attribute) is needed for TP on models other than the references.
    Under EP the routed experts are split over an ("efsdp", "ep") mesh made here."""
    check_tp_shapes(workload, parallel)
    check_expert_parallel(workload, parallel)
    model = copy.deepcopy(workload.model)
    experts_mesh = expert_mesh(parallel, mesh.device_type) if parallel.ep > 1 else None
    if experts_mesh is not None:
        apply_expert_parallel(model, experts_mesh, parallel)
    if parallel.tp > 1:
        plan = tp_plan or workload.tp_plan or reference_tp_plan(model, parallel.ep)
        if plan is None:
            raise WorkbenchError(
                f"--tp {parallel.tp}: model {workload.name!r} has no tensor-parallel plan; give "
                "one as workload.tp_plan (or shard_workload's tp_plan): a dict {module path: "
                "ParallelStyle} for parallelize_module or a callable(model, tp_mesh); or use --tp 1"
            )
        tied = tied_parameters(model)
        check_tp_plan(plan, model, workload.name)
        try:
            if callable(plan):
                plan(model, mesh["tp"])
            else:
                parallelize_module(model, mesh["tp"], plan)
        except (WorkbenchError, KeyboardInterrupt):
            raise
        except Exception as err:
            raise WorkbenchError(
                f"the tensor-parallel plan of {workload.name!r} failed: {describe(err)}"
            ) from None
        retie(tied, workload.name)
    shards = shard_parameters(model, workload.name, parallel, mesh, experts_mesh)
    sharded = copy.copy(workload)
    sharded.model = model
    sharded.config = {**workload.config, **parallel.to_json()}
    return RankWorkload(sharded, parallel, mesh, shards, experts_mesh)


def _loss_context(rank: RankWorkload) -> contextlib.AbstractContextManager[None]:
    """Vocabulary-sharded logits need torch's parallel cross entropy, forward and backward."""
    return loss_parallel() if rank.parallel.tp > 1 else contextlib.nullcontext()


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def eager_rank_step(rank: RankWorkload) -> list[torch.Tensor]:
    """This rank's plain autograd step of the sharded model: `[loss, *local grads]` in
    `shards` order, the reference a traced per-rank graph must equal bitwise."""
    workload = rank.workload
    assert workload.loss_fn is not None
    named = dict(workload.model.named_parameters())
    params = [named[s.key] for s in rank.shards]
    with _loss_context(rank):
        loss = workload.loss_fn(workload.model(*workload.inputs), workload.target)
        grads = torch.autograd.grad(loss, params)
    return [_local(loss).detach(), *(_local(g) for g in grads)]


def trace_sharded(rank: RankWorkload, mode: Mode, kernels: str) -> JointGraph:
    """Trace one rank's step: placeholders are the mesh (opaque), the local parameter
    shards (re-wrapped as DTensors inside the step), buffers, inputs and target. `kernels`:
    as `workbench.capture.tracing.trace_step` takes them."""
    workload, shards, parallel = rank.workload, rank.shards, rank.parallel
    buffers = dict(workload.model.named_buffers())
    n_params, n_buffers, n_inputs = len(shards), len(buffers), len(workload.inputs)
    meshes = [rank.mesh] if rank.experts_mesh is None else [rank.mesh, rank.experts_mesh]

    def step(*given: Any) -> list[torch.Tensor]:
        mesh, experts_mesh = given[0], given[len(meshes) - 1]
        flat = given[len(meshes) :]
        local = flat[:n_params]
        state: dict[str, Any] = {
            s.key: DTensor.from_local(
                t,
                experts_mesh if s.expert else mesh,
                s.placements,
                run_check=False,
                shape=s.shape,
                stride=s.stride,
            )
            for s, t in zip(shards, local, strict=True)
        }
        state.update(zip(buffers, flat[n_params : n_params + n_buffers], strict=True))
        inputs = flat[n_params + n_buffers : n_params + n_buffers + n_inputs]
        with _loss_context(rank):
            output = torch.func.functional_call(workload.model, state, inputs)
            first, *grads = step_outputs(
                workload, output, flat[-1], local, [s.fqn for s in shards], inputs[0]
            )
        return [_local(first), *grads]

    args = [
        *meshes,
        *rank.local_params(),
        *buffers.values(),
        *workload.inputs,
        last_input(workload),
    ]
    mesh_kinds: list[tuple[InputKind, str]] = [("mesh", "mesh"), ("mesh", "experts_mesh")]
    kinds: list[tuple[InputKind, str]] = [
        *mesh_kinds[: len(meshes)],
        *(("param", s.fqn) for s in shards),
        *(("buffer", name) for name in buffers),
        *(("input", f"inputs[{i}]") for i in range(n_inputs)),
        last_input_kind(workload),
    ]
    graph = trace_step(workload, step, args, kinds, mode, kernels)
    graph.mesh_dims = {rank.mesh.get_group(dim).group_name: dim for dim in REFERENCE_MESH_DIMS}
    if rank.experts_mesh is not None:
        for dim in EXPERT_MESH_DIMS:  # a dimension spanning the world is WORLD in both
            graph.mesh_dims.setdefault(rank.experts_mesh.get_group(dim).group_name, dim)
        if any(isinstance(m, MoE) for m in workload.model.modules()):
            graph.notes.append(
                routing_note("one per MoE layer", parallel.ep_imbalance, parallel.ep)
            )
    graph.config.update(parallel.to_json())
    return graph


def check_fits_rank(workload: Workload, parallel: Parallel) -> None:
    """Refuse a real per-rank trace whose shard, gradient and gathered low-precision copy
    of every parameter exceed free memory (the whole model is built in this process too)."""
    params = list(workload.model.parameters())
    if any(p.is_meta for p in params):
        return
    device = params[0].device if params else torch.device("cpu")
    total = sum(p.numel() * p.element_size() for p in params)
    elements = sum(p.numel() for p in params)
    low = torch.empty((), dtype=DTYPES[parallel.param_dtype]).element_size()
    needed = total + 2 * total // parallel.world_size + elements * low // parallel.tp
    free = available_bytes(device)
    if needed > free:
        raise WorkbenchError(
            f"one rank of {workload.name!r} at fsdp {parallel.fsdp} x tp {parallel.tp} needs "
            f"about {needed / 2**30:.1f} GiB on {device} (model, shards, gradients, gathered "
            f"weights) but {free / 2**30:.1f} GiB is free: trace it with --mode fake"
        )


def trace_rank(
    workload: Workload,
    mode: Mode,
    parallel: Parallel,
    mesh: DeviceMesh | None = None,
    kernels: str | None = None,
) -> JointGraph:
    """Shard a copy of `workload` for rank 0 of `parallel` and trace its step. Without
    `mesh`, a fake process group lives for the duration of the trace: a real-mode graph
    traced that way can run only inside such a group (trace and run inside
    `fake_process_group`, or a real one, and pass its mesh). `trace` shards torchtitan
    models with graph trainer's own `parallelize` instead (`workbench.capture.titan_rank`).
    `kernels`: as `trace` takes them (`workbench.capture.kernels.resolve_kernels`)."""
    kernels = resolve_kernels(kernels, mode, workload_device(workload))
    if parallel.cp > 1:
        raise WorkbenchError(
            f"--cp on {workload.name!r}: context parallelism runs through graph trainer's "
            "parallelize, for torchtitan models (e.g. --model torchtitan:deepseek_v3/"
            "debugmodel); use --fsdp/--tp/--ep here"
        )
    check_expert_parallel(workload, parallel)  # before a process group exists
    if mode == "real":
        check_fits_rank(workload, parallel)
    if mesh is not None:
        return trace_sharded(shard_workload(workload, parallel, mesh), mode, kernels)
    with fake_process_group(parallel) as fake_mesh:
        return trace_sharded(shard_workload(workload, parallel, fake_mesh), mode, kernels)
