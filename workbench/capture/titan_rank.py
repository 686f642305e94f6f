"""One rank of a torchtitan model sharded as graph trainer shards it: its own `parallelize`
(SimpleFSDP, TP plans, expert parallelism) on torch's fake process group, traced by its own
`minimal_fx_tracer` with its module annotations.

Entry points: `trace_titan_rank(workload, mode, parallel, kernels) -> JointGraph` (what
`workbench.capture.trace.trace` calls for `torchtitan:` workloads with a `Parallel`),
`GRAPH_TRAINER_FAMILIES`, `check_titan_parallel`, `check_titan_pipeline`, and
`bind_token_counts` (the expert token counts fake tensors cannot route).

A pipeline stage (`Workload.stage`) is graph trainer's `graph_pp` stage: the model split by
torchtitan's own `_split_module`, parallelized, and its stage step traced as graph_pp's
`_build_stage_graphs` traces it (hidden states in after the first stage, the output's gradient
in before the last).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from workbench.capture.degrees import EXPERT_MESH_DIMS, MESH_DIMS
from workbench.capture.expert_parallel import ep_token_splits, routing_note
from workbench.capture.graph import InputKind, InputSpec, JointGraph, describe_nodes
from workbench.capture.kernels import gpu_arch
from workbench.capture.models.torchtitan import adapt_config, parse_spec, titan_kernels
from workbench.capture.tracing import (
    Mode,
    apply_model_kernels,
    kernel_dispatch,
    kernel_notes,
    record_absent_outputs,
)
from workbench.capture.workload import Workload
from workbench.errors import WorkbenchError, check_int, describe

if TYPE_CHECKING:
    from workbench.capture.parallel import Parallel

__all__ = [
    "GRAPH_TRAINER_FAMILIES",
    "bind_token_counts",
    "check_titan_parallel",
    "check_titan_pipeline",
    "TitanRank",
    "graph_trainer_imports",
    "is_titan_workload",
    "titan_experts",
    "titan_loss",
    "titan_rank_model",
    "trace_titan_rank",
]

# The families torchtitan 0.3.0's graph trainer ships a `parallelize` (and model class) for.
GRAPH_TRAINER_FAMILIES = ("llama3", "qwen3", "deepseek_v3", "muse_glimmer")
MAX_TITAN_WORLD = 4096  # ranks of one traced torchtitan job (see check_titan_parallel)
_GRAPH_TRAINER = "torchtitan.experiments.graph_trainer"
CP_NOTE = (
    "context parallelism: torchtitan's cp_shard (head-tail balancer) gives this rank 1/{cp} of "
    "each sequence's tokens and its rows of the block mask; every layer all-gathers keys and "
    "values over the cp group (cplib.flex_cp_allgather, its backward a reduce-scatter), which "
    "the step time counts as an op at memory bandwidth, not on NCCL's model"
)
# graph trainer's annotation of the EP token exchange (`common_utils._EP_TOKEN_EXCHANGE`)
_EP_TOKEN_EXCHANGE = "EP_token_exchange"
_A2A = "_c10d_functional.all_to_all_single.default"


def is_titan_workload(workload: Workload) -> bool:
    return workload.name.startswith("torchtitan:")


def titan_experts(workload: Workload) -> int:
    """Routed experts of a torchtitan model's MoE layers; 0 on a dense model or another one."""
    if not is_titan_workload(workload):
        return 0
    return _experts(workload.model.config)


def _experts(config: Any) -> int:
    for block in config.layers:
        moe = getattr(block, "moe", None)
        if moe is not None:
            return int(moe.num_experts)
    return 0


def check_titan_parallel(workload: Workload, parallel: Parallel, kernels: str) -> None:
    """Refuse, in one line each, what graph trainer's `parallelize` cannot shard: a family
    without one, `--cp` with the CPU's kernels, `--ep` on a dense model, degrees that do not
    divide experts, heads or the sequence."""
    family, _ = parse_spec(workload.name)
    check_int(
        "the world size (fsdp x cp x tp ranks)",
        parallel.world_size,
        1,
        MAX_TITAN_WORLD,
        "tracing one torchtitan rank builds a fake group of every rank: about 10 ms each, "
        "45 s at the limit",
    )
    if family not in GRAPH_TRAINER_FAMILIES:
        raise WorkbenchError(
            f"torchtitan {family} has no graph trainer parallelize in torchtitan 0.3.0 "
            f"(families with one: {', '.join(GRAPH_TRAINER_FAMILIES)}); trace "
            f"{workload.name} without --fsdp/--tp/--ep/--cp"
        )
    if parallel.cp > 1 and gpu_arch(kernels) is None:
        raise WorkbenchError(
            f"--cp {parallel.cp} with the CPU's kernels: context parallelism shards flex "
            "attention (all-gathered keys and values) or SDPA's GPU kernels (DTensor's ring "
            "attention), and the CPU's flash op has neither; trace with a GPU's kernels "
            "(--mode fake, --kernels h100) or use --cp 1"
        )
    config: Any = workload.model.config
    experts = _experts(config)
    if parallel.ep > 1 and not experts:
        raise WorkbenchError(
            f"--ep {parallel.ep}: {workload.name} is a dense model (no MoE layers); expert "
            "parallelism needs an MoE flavor such as torchtitan:deepseek_v3/16B or "
            "torchtitan:qwen3/debugmodel_moe"
        )
    if parallel.ep > 1 and experts % parallel.ep:
        raise WorkbenchError(
            f"--ep {parallel.ep} does not divide the {experts} experts of {workload.name}; "
            f"choose an ep that divides {experts}"
        )
    attention = next((b.attention for b in config.layers if hasattr(b, "attention")), None)
    heads = {
        "heads": getattr(attention, "n_heads", None),
        "kv heads": getattr(attention, "n_kv_heads", None),
    }
    for what, count in heads.items():
        if parallel.tp > 1 and count and count % parallel.tp:
            raise WorkbenchError(
                f"--tp {parallel.tp} does not divide the {count} {what} of {workload.name}; "
                f"choose a tp that divides {count}"
            )
    seq = int(workload.config["seq"])
    divisor = parallel.tp * (2 * parallel.cp if parallel.cp > 1 else 1)
    if seq % divisor:
        raise WorkbenchError(
            f"--seq {seq} is not a multiple of tp x 2cp = {divisor} (sequence parallelism "
            f"and context parallelism split it); choose a seq divisible by {divisor}"
        )


def check_titan_pipeline(name: str, schedule: str) -> None:
    """Refuse, in one line, a pipeline graph trainer's `graph_pp` does not build: a family
    whose graph trainer spec has no `graph_pipeline_llm` as its `pipelining_fn`, or a schedule
    its `_validate_graph_pp_config` refuses (it runs torch's runtime schedules only)."""
    from torchtitan.config import ParallelismConfig

    family, flavor = parse_spec(name)
    with graph_trainer_imports():
        from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig
        from torchtitan.experiments.graph_trainer.graph_pp import pipeline

        module = (
            importlib.import_module(f"{_GRAPH_TRAINER}.{family}")
            if family in GRAPH_TRAINER_FAMILIES
            else None
        )
        spec = module.model_registry(flavor) if module is not None else None
        if spec is None or spec.pipelining_fn is not pipeline.graph_pipeline_llm:
            raise WorkbenchError(
                f"--pp on {name}: graph trainer 0.3.0 pipelines {family} through no "
                "graph_pp (its model spec's pipelining_fn is not graph_pipeline_llm); "
                "families it pipelines: llama3, qwen3, deepseek_v3"
            )
        try:
            pipeline._validate_graph_pp_config(
                compile_config=GraphTrainerCompileConfig(mode="aot_fx_trace"),
                parallelism=ParallelismConfig(pipeline_parallel_schedule=schedule),
            )
        except ValueError as err:
            raise WorkbenchError(
                f"--pp-schedule {schedule} on {name}: graph trainer's graph_pp "
                f"refuses it (_validate_graph_pp_config: {describe(err)}); choose "
                "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV"
            ) from None


@contextlib.contextmanager
def graph_trainer_imports() -> Iterator[None]:
    """Graph trainer's model packages import `torchtitan.trainer` (the training loop), which
    imports training-only packages (torchdata, tensorboard, tokenizers) that the workbench
    does not install; tracing never calls it. Without them, a placeholder `Trainer` stands in
    while graph trainer is imported and its configs are updated, and is removed after."""
    placeholder = None
    try:
        importlib.import_module("torchtitan.trainer")
    except ImportError:
        placeholder = types.ModuleType("torchtitan.trainer")

        class Trainer:  # what graph trainer reads at import: `Trainer.Config` as a base
            class Config:
                pass

        placeholder.Trainer = Trainer  # type: ignore[attr-defined]
        sys.modules["torchtitan.trainer"] = placeholder
    try:
        yield
    finally:
        if placeholder is not None and sys.modules.get("torchtitan.trainer") is placeholder:
            del sys.modules["torchtitan.trainer"]


@contextlib.contextmanager
def _cpu_parallel_dims() -> Iterator[None]:
    """torchtitan's `ParallelDims` builds its meshes on its module's `device_type`, which
    falls back to "cuda" without an accelerator: the fake group's meshes live on the CPU."""
    from torchtitan.distributed import parallel_dims

    previous = parallel_dims.device_type
    parallel_dims.device_type = "cpu"
    try:
        yield
    finally:
        parallel_dims.device_type = previous


@contextlib.contextmanager
def _spmd_backend(name: str) -> Iterator[None]:
    """Graph trainer runs torchtitan's `partial_dtensor` backend (its `to_graph_trainer_config`)."""
    from torchtitan.distributed import utils as dist_utils

    previous = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend(name)
    try:
        yield
    finally:
        dist_utils.set_spmd_backend(previous)


def _configs(workload: Workload, parallel: Parallel) -> tuple[Any, Any, Any]:
    """(training, parallelism, compile) as graph trainer's `parallelize` reads them: compile
    off (the workbench traces the step itself), mixed precision as `parallel` says."""
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.experiments.graph_trainer.configs import GraphTrainerCompileConfig

    training = TrainingConfig(
        seq_len=int(workload.config["seq"]),
        local_batch_size=int(workload.config["batch"]),
        mixed_precision_param=parallel.param_dtype,
        mixed_precision_reduce=parallel.reduce_dtype,
    )
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=parallel.fsdp,
        tensor_parallel_degree=parallel.tp,
        context_parallel_degree=parallel.cp,
        expert_parallel_degree=parallel.ep,
        spmd_backend="partial_dtensor",
    )
    return training, parallelism, GraphTrainerCompileConfig(enable=False)


def _build_rank_model(
    workload: Workload, parallel: Parallel, mode: Mode, kernels: str
) -> tuple[Any, Any, list[str]]:
    """Graph trainer's model for the workload's family and flavor (same layers and RoPE
    length; FlexAttention for a GPU's kernels, else SDPA), its config updated for `parallel`
    as the trainer does; real mode copies the workload's weights, fake mode builds on fake CPU
    tensors. Returns (spec, model, the notes of what differs from the model as shipped)."""
    family, flavor = parse_spec(workload.name)
    spec = importlib.import_module(f"{_GRAPH_TRAINER}.{family}").model_registry(flavor)
    config = spec.model
    layers, seq = _layer_count(workload), int(workload.config["seq"])
    notes = adapt_config(config, workload.name, layers, seq, flex=gpu_arch(kernels) is not None)
    _, parallelism, _ = _configs(workload, parallel)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    dtype = next(workload.model.parameters()).dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if mode == "fake":
            with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"):
                model = config.build()
        else:
            with torch.device("cpu"):
                model = config.build()
            model.init_states()
            model.load_state_dict(workload.model.state_dict())
    finally:
        torch.set_default_dtype(previous)
    if workload.stage is not None:
        model = _split_stage(model, workload)
    return spec, model, notes


def _layer_ids(workload: Workload) -> list[int]:
    """The blocks the rank's model holds, by id: the workload model's (a template for
    stamping keeps three, `workbench.capture.stamp.keep_layers`; a stage its own), else the
    config's first ones."""
    layers = getattr(workload.model, "layers", None)
    if isinstance(layers, torch.nn.ModuleDict):
        return [int(key) for key in layers]
    return list(range(int(workload.config["layers"])))


def _layer_count(workload: Workload) -> int:
    """Blocks to build: up to the highest id held, so that a stage's keep their names."""
    return max(_layer_ids(workload), default=-1) + 1


def _split_stage(model: Any, workload: Workload) -> Any:
    """The stage's part of graph trainer's model, cut by torchtitan's own `_split_module`
    from the module names `_generate_llm_fqn_per_model_part` gives a stage: the embedding on
    the first, its layers, the norm and `lm_head` on the last (here only the layers the
    workload holds, three for a stamping template)."""
    from torchtitan.distributed.pipeline_parallel import _split_module

    role = workload.stage
    assert role is not None
    names = [
        *(["tok_embeddings"] if role.first else []),
        *(f"layers.{i}" for i in _layer_ids(workload)),
        *(["norm", "lm_head"] if role.last else []),
    ]
    with warnings.catch_warnings():  # its deepcopy reads fake tensors' data pointers
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return _split_module(model, names)


def _parallel_dims(parallel: Parallel) -> Any:
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(
        dp_replicate=parallel.dp,
        dp_shard=parallel.fsdp,
        cp=parallel.cp,
        tp=parallel.tp,
        pp=1,
        ep=parallel.ep,
        world_size=parallel.world_size,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def _forget_simple_fsdp_classes() -> None:
    """Graph trainer's SimpleFSDP caches one wrapper class per module class, whose parameter
    properties call the parametrization of the first module it wrapped, mesh included: a
    later trace (another world, its own groups) would gather on the first one's mesh."""
    from torchtitan.experiments.graph_trainer import simple_fsdp

    simple_fsdp._wrap_class_cache.clear()


def _mesh_dims(dims: Any) -> dict[str, str]:
    """Process-group name -> mesh dimension, for the dimensions with more than one rank.
    Dimensions spanning the whole world share its group: `fsdp+ep` names both."""
    named: dict[str, str] = {}
    for name in (*MESH_DIMS, *EXPERT_MESH_DIMS):
        mesh = dims.get_all_one_dimensional_meshes().get(name)
        if mesh is not None and mesh.size() > 1:
            group = mesh.get_group().group_name
            named[group] = f"{named[group]}+{name}" if group in named else name
    return named


def _inputs(workload: Workload, mode: Mode) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (a stage after the first: the hidden states it receives) and labels (a
    stage before the last: its output's gradient) on the CPU; in fake mode uninitialised
    tensors of the workload's shapes (the tracer makes them fake)."""
    first, last = workload.inputs[0], workload.target
    if workload.stage is not None and not workload.stage.last:
        last = workload.grad_output
    if mode == "fake":
        return tuple(torch.empty(t.shape, dtype=t.dtype) for t in (first, last))  # type: ignore[return-value]
    return first, last


class TitanRank(NamedTuple):
    """Graph trainer's parallelized model for one rank, as `titan_rank_model` yields it: the
    model, its `ParallelDims`, its inputs (ids or received hidden states; labels or the output's
    gradient), the attention kernels chosen while tracing (`record`), the model's kernel
    switch (`switched`) and the notes of what differs from the model as shipped."""

    model: Any
    dims: Any
    first: torch.Tensor
    last: torch.Tensor
    record: Any
    switched: Any
    notes: list[str]


@contextlib.contextmanager
def titan_rank_model(
    workload: Workload, mode: Mode, parallel: Parallel, kernels: str
) -> Iterator[TitanRank]:
    """Rank 0 of `parallel` for the torchtitan workload, ready to trace or run: graph
    trainer's model, its `parallelize` on a fake process group, inside the contexts it needs
    (its imports, its SPMD backend, the fake world, CPU meshes) and `kernels`' dispatch (a
    GPU's attention, FlexAttention's block mask), which last until the context ends. A
    failure inside names the job in one line (torchtitan raises many types)."""
    from workbench.capture.parallel import check_fits_rank, fake_world

    check_titan_parallel(workload, parallel, kernels)
    if workload.stage is not None and mode == "real":
        raise WorkbenchError(
            f"--pp on {workload.name} traces graph trainer's stages in --mode fake only (a "
            "stage's weights are not loaded from the workload's model); use --mode fake"
        )
    if mode == "real":
        check_fits_rank(workload, parallel)
    with (
        graph_trainer_imports(),
        _spmd_backend("partial_dtensor"),
        fake_world(parallel.world_size),
        _cpu_parallel_dims(),
    ):
        try:
            with contextlib.ExitStack() as stack:
                spec, model, notes = _build_rank_model(workload, parallel, mode, kernels)
                dims = _parallel_dims(parallel)
                _forget_simple_fsdp_classes()
                training, parallelism, compile_config = _configs(workload, parallel)
                model = spec.parallelize_fn(
                    model,
                    parallel_dims=dims,
                    training=training,
                    parallelism=parallelism,
                    compile_config=compile_config,
                    ac_config=None,
                    dump_folder="",
                )
                batch, seq = int(workload.config["batch"]), int(workload.config["seq"])
                shard = _cp_shard(dims) if parallel.cp > 1 else None
                first, last = _sharded_inputs(workload, mode, shard)
                record = stack.enter_context(kernel_dispatch(kernels))
                switched = stack.enter_context(titan_kernels(model, batch, seq, kernels, shard))
                yield TitanRank(model, dims, first, last, record, switched, notes)
        except WorkbenchError:
            raise
        except Exception as err:
            raise WorkbenchError(
                f"graph trainer's parallelize/trace of {workload.name} at "
                f"{parallel.describe()} failed: {describe(err)}"
            ) from None


def titan_loss(model: Any) -> Any:
    """Graph trainer's loss for `model`: torchtitan's `CrossEntropyLoss` over its vocabulary
    (sum over tokens, divided by the global token count it is given)."""
    from torchtitan.components.loss import CrossEntropyLoss

    vocab = int(model.config.vocab_size)
    return CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=vocab))


def trace_titan_rank(
    workload: Workload, mode: Mode, parallel: Parallel, kernels: str
) -> JointGraph:
    """Rank 0 of `parallel` for the torchtitan workload (`titan_rank_model`): its
    `make_fwd_bwd_step` traced by graph trainer's `minimal_fx_tracer` with its loss
    (`titan_loss`), for `kernels` (`workbench.capture.kernels.resolve_kernels`). Expert token
    counts are bound by `bind_token_counts`."""
    from torchtitan.experiments.graph_trainer.make_fx_tracer import extract_module_state

    with titan_rank_model(workload, mode, parallel, kernels) as rank:
        model, dims, record, switched = rank.model, rank.dims, rank.record, rank.switched
        traced = _trace(model, dims, workload, rank.first, rank.last)
        n_params = sum(1 for _ in model.named_parameters(remove_duplicate=False))
        model_state = list(extract_module_state(model).values())
        mesh_dims = _mesh_dims(dims)
    record_absent_outputs(traced.gm)
    notes = [
        *rank.notes,
        *kernel_notes(kernels, mode, record, switched),
        *([CP_NOTE.format(cp=parallel.cp)] if parallel.cp > 1 else []),
        *bind_token_counts(traced.gm, parallel),
    ]
    graph = _joint_graph(traced, n_params, model_state, workload, mode, parallel, mesh_dims, notes)
    lifted = apply_model_kernels(graph.gm, switched)
    graph.inputs += [spec for spec, _ in lifted]
    if graph.example_inputs is not None:
        graph.example_inputs += [value for _, value in lifted]
    graph.nodes = describe_nodes(graph.gm)
    graph.config["kernels"] = kernels
    return graph


def _cp_shard(dims: Any) -> Any:
    """torchtitan's own `cp_shard` on this rank's CP mesh, with its default load balancer
    (head-tail): what its trainer does to a batch's ids, labels and block mask."""
    from torchtitan.distributed.context_parallel.api import cp_shard

    mesh = dims.get_mesh("cp")
    return functools.partial(cp_shard, mesh, load_balancer_type="headtail")


def _sharded_inputs(
    workload: Workload, mode: Mode, shard: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_inputs`, the token-position ones (ids on the first stage, labels on the last) cut
    by `cp_shard` on a context-parallel rank; received hidden states and output gradients
    are the rank's shard already."""
    first, last = _inputs(workload, mode)
    if shard is None:
        return first, last
    stage = workload.stage
    cut = [stage is None or stage.first, stage is None or stage.last]
    held = [t for t, c in zip((first, last), cut, strict=True) if c]
    sharded = iter(shard(tuple(held), None)[0])
    return tuple(next(sharded) if c else t for t, c in zip((first, last), cut, strict=True))  # type: ignore[return-value]


def _trace(
    model: Any, dims: Any, workload: Workload, first: torch.Tensor, last: torch.Tensor
) -> Any:
    """Graph trainer's step traced by its `minimal_fx_tracer`: its `make_fwd_bwd_step`, or
    for a pipeline stage graph_pp's stage step (`_stage_step`)."""
    from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer
    from torchtitan.experiments.graph_trainer.trainer import make_fwd_bwd_step

    loss_fn = titan_loss(model)
    tokens = torch.tensor(float(workload.tokens))
    with warnings.catch_warnings():  # its MoE asks for fp32 autocast, which the CPU ignores
        warnings.filterwarnings("ignore", message="In CPU autocast")
        stage = workload.stage
        if stage is None:
            step = make_fwd_bwd_step(model, loss_fn)
            return minimal_fx_tracer(step, module=model)(first, last, tokens, {})
        received = _received(model, dims, first) if first.is_floating_point() else first
        tracer = minimal_fx_tracer(_stage_step(model, loss_fn, stage.last), module=model)
        if stage.last:
            return tracer((received,), {}, last, {"global_valid_tokens": tokens})
        return tracer((received,), {}, (last,))


def _stage_step(model: Any, loss_fn: Any, last: bool) -> Any:
    """graph_pp's stage step (`graph_builder._build_stage_graphs`), called as it calls it:
    the last stage differentiates the annotated loss, the others their output against the
    next stage's gradient; both with respect to the parameters and the received input, and
    return (loss or output, parameter gradients, input gradients)."""
    from torchtitan.experiments.graph_trainer.common_utils import compute_annotated_loss

    def gradients(args: tuple[Any, ...], outputs: Any, grad_outputs: Any) -> tuple[Any, Any]:
        params = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
        received = [a for a in pytree.tree_leaves(args) if getattr(a, "requires_grad", False)]
        grads = torch.autograd.grad(
            outputs, [*params, *received], grad_outputs=grad_outputs, allow_unused=True
        )
        return tuple(grads[: len(params)]), tuple(grads[len(params) :])

    def last_step(args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_kwargs: Any):  # noqa: ANN202
        loss = compute_annotated_loss(loss_fn, model(*args, **kwargs), target, loss_kwargs)
        return (loss, *gradients(args, loss, None))

    def middle_step(args: tuple[Any, ...], kwargs: dict[str, Any], grads_from_next: Any):  # noqa: ANN202
        output = model(*args, **kwargs)
        flat = pytree.tree_leaves(output)
        grads = [
            _like(g, o) for g, o in zip(pytree.tree_leaves(grads_from_next), flat, strict=True)
        ]
        return (output, *gradients(args, flat, grads))

    return last_step if last else middle_step


def _joint_graph(
    traced: Any,
    n_params: int,
    model_state: list[torch.Tensor],
    workload: Workload,
    mode: Mode,
    parallel: Parallel,
    mesh_dims: dict[str, str],
    notes: list[str],
) -> JointGraph:
    """The workbench's view of graph trainer's traced step: placeholders named by its state
    FQNs (parameters, then buffers), meshes, then ids, labels and the token count."""
    gm: fx.GraphModule = traced.gm
    names: Iterator[tuple[InputKind, str]] = iter(
        [
            *(("param", fqn) for fqn in traced.state_fqns[:n_params]),
            *(("buffer", fqn) for fqn in traced.state_fqns[n_params:]),
            ("input", "inputs[0]"),
            *_last_inputs(workload),
        ]
    )
    specs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        mesh: tuple[InputKind, str] = ("mesh", "mesh")
        kind, fqn = mesh if isinstance(node.meta.get("val"), DeviceMesh) else next(names)
        specs.append(InputSpec(placeholder=node.name, kind=kind, fqn=fqn))
    config = {**workload.config, **parallel.to_json(), "parallelize": "graph trainer"}
    return JointGraph(
        gm=gm,
        nodes=describe_nodes(gm),
        inputs=specs,
        model_name=workload.name,
        mode=mode,
        tokens=workload.tokens,
        config=config,
        example_inputs=_real_inputs(traced, model_state, workload) if mode == "real" else None,
        mesh_dims=mesh_dims,
        notes=notes,
    )


def _received(model: Any, dims: Any, local: torch.Tensor) -> Any:
    """The hidden states a stage after the first receives, as graph_pp hands them over: a
    leaf requiring grad, a DTensor where the embedding's output is one (its sharding config's
    `out_dst_shardings` on the mesh torchtitan resolves for it: sequence-sharded under TP),
    else the local tensor."""
    from torchtitan.protocols.sharding import resolve_placements

    sharding = getattr(model.config.tok_embeddings, "sharding_config", None)
    layout = getattr(sharding, "out_dst_shardings", None)
    mesh = dims.resolve_shared_mesh([layout]) if layout is not None else None
    if mesh is None:
        return local.requires_grad_()
    placements = resolve_placements(layout, mesh)
    return DTensor.from_local(local, mesh, placements, run_check=False).detach().requires_grad_()


def _like(grad: torch.Tensor, output: Any) -> Any:
    """The next stage's gradient as graph_pp hands it over: a DTensor of the output's mesh and
    placements when the output is one (its PP metadata rebuilds it so); `grad` is the local
    tensor, the graph's input either way (the tracer unwraps DTensors)."""
    if not isinstance(output, DTensor):
        return grad
    return DTensor.from_local(
        grad,
        output.device_mesh,
        output.placements,
        run_check=False,
        shape=output.shape,
        stride=output.stride(),
    )


def _last_inputs(workload: Workload) -> list[tuple[InputKind, str]]:
    """What follows the ids (or received hidden states): labels and the token count, or for a
    stage before the last its output's gradient."""
    if workload.stage is not None and not workload.stage.last:
        return [("input", "grad_output")]
    return [("target", "target"), ("input", "global_valid_tokens")]


def _real_inputs(traced: Any, state: list[torch.Tensor], workload: Workload) -> list[Any]:
    """The graph's inputs in real mode: the state's local shards and meshes, as graph
    trainer's `run_traced` unwraps them, then ids, labels and the token count."""
    from torchtitan.experiments.graph_trainer.make_fx_tracer import _unwrap_subclasses

    ids, labels = workload.inputs[0], workload.target
    flat, _ = _unwrap_subclasses([*state, ids, labels, torch.tensor(float(ids.numel()))])
    return flat


# --- expert token counts ------------------------------------------------------------------


def bind_token_counts(gm: fx.GraphModule, parallel: Parallel) -> list[str]:
    """Give every size that expert routing decides a number, in the nodes' metadata only.

    The EP all-to-alls send and receive as many tokens as the router picks, sizes a fake
    tensor cannot know (unbacked symbols read by `.tolist()`). Each dispatch sends its
    `T` routed token copies evenly to the `ep` ranks (`T / ep` each, as a balanced router
    would) and receives `ep_imbalance x T / ep` from each (1: balanced; more: this rank's
    experts are the hottest). The ops themselves are unchanged. Returns the note stating it."""
    hints: dict[sympy.Symbol, int] = {}
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        if node.target is None or str(node.target) != _A2A:
            continue
        if custom.get(_EP_TOKEN_EXCHANGE) != "dispatch" or node.meta.get("autograd_backward"):
            continue
        sent = int(node.args[0].meta["val"].shape[0])
        receive, send = node.args[1], node.args[2]
        balanced, hottest = ep_token_splits(sent, len(send), parallel.ep_imbalance)
        for sizes, values in ((send, balanced), (receive, hottest)):
            for size, value in zip(sizes, values, strict=True):
                symbol = _symbol(size)
                if symbol is not None:
                    hints.setdefault(symbol, value)
    if not hints:
        return []
    _concretize(gm, hints)
    return [routing_note("one per MoE layer", parallel.ep_imbalance, parallel.ep)]


def _symbol(size: Any) -> sympy.Symbol | None:
    value = size.meta.get("val") if isinstance(size, fx.Node) else size
    if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
        return value.node.expr
    return None


def _concretize(gm: fx.GraphModule, hints: dict[sympy.Symbol, int]) -> None:
    """Every node's `meta["val"]` with the bound sizes; a size still unknown is refused."""

    def concrete(value: Any) -> Any:
        if isinstance(value, torch.SymInt):
            return _evaluate(value.node.expr, hints)
        if not isinstance(value, torch.Tensor):
            return value
        if all(isinstance(d, int) for d in (*value.shape, *value.stride())):
            return value
        shape = [_evaluate(d, hints) for d in value.shape]
        stride = [_evaluate(d, hints) for d in value.stride()]
        with value.fake_mode:  # type: ignore[attr-defined]
            return value.new_empty_strided(shape, stride)

    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = pytree.tree_map(concrete, node.meta["val"])


def _evaluate(size: Any, hints: dict[sympy.Symbol, int]) -> int:
    if isinstance(size, int):
        return size
    expr = size.node.expr if isinstance(size, torch.SymInt) else size
    value = expr.xreplace(hints) if isinstance(expr, sympy.Basic) else expr
    if not isinstance(value, int) and not getattr(value, "is_number", False):
        raise WorkbenchError(
            f"a size of the expert-parallel graph depends on routing the workbench does not "
            f"model ({value}); only the EP dispatch/combine token counts are bound"
        )
    return int(value)
