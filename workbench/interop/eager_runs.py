"""Eager baselines as eager runs them: no AC, eager SAC and eager full AC in module wrappers,
with FSDP2 and TP where the job is sharded, run once under torch's memory trackers (on fake
tensors and the fake process group, or for real on this machine).

Entry points: `estimate_baselines(workload, BaselineOptions(...)) -> [EagerBaseline]`,
`eager_run(workload, kind, options)` (the step ready to run, for a tracker or a measurement)
and `measure_baseline(workload, kind)` (a real run's measured peak, to check the tracker).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from workbench.capture.kernels import AttentionRecord, ModelKernels, resolve_kernels
from workbench.capture.models import DTYPES
from workbench.capture.parallel import (
    Parallel,
    check_tp_shapes,
    fake_process_group,
    reference_tp_plan,
)
from workbench.capture.param_shards import retie, tied_parameters
from workbench.capture.tp_plan import check_tp_plan
from workbench.capture.tracing import Mode, kernel_dispatch, kernel_notes, workload_device
from workbench.capture.workload import Workload
from workbench.cost.allocator import AllocatorConfig, AllocatorReplay
from workbench.cost.estimate import OPTIMIZER_STATE_BYTES, OptimizerName
from workbench.cost.measure import Measurement, measure_run
from workbench.cost.workspaces import gpu_workspaces
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError, describe
from workbench.interop.eager import apply_eager_sac
from workbench.interop.trackers import TrackedStep, replay_events, track_step

__all__ = [
    "BASELINE_KINDS",
    "AcKind",
    "BaselineOptions",
    "EagerBaseline",
    "EagerRun",
    "apply_baseline_ac",
    "eager_run",
    "estimate_baselines",
    "measure_baseline",
    "sac_rule",
]

AcKind = Literal["none", "sac", "full"]
# What each baseline is called wherever it is shown.
BASELINE_KINDS: dict[str, str] = {"none": "no AC", "sac": "eager SAC", "full": "eager full AC"}
# The rule each baseline runs, as its JSON names it (`docs/cli.md` says more).
NO_AC = "none"
TITAN_SAC = "torchtitan SelectiveAC"  # its save list, every second mm recomputed
WORKBENCH_SAC = "workbench eager preset as policy_fn"  # the same rule, without torchtitan
FULL_AC = "checkpoint_wrapper per block"  # torchtitan's FullAC


@dataclass(frozen=True, kw_only=True, slots=True)
class BaselineOptions:
    """How the baselines run."""

    mode: Mode = "fake"
    """`fake`: on fake tensors, for a GPU's kernels (nothing is allocated); `real`: for real on
    the workload's device, with its own kernels."""

    parallel: Parallel | None = None
    """One rank of an FSDP x TP job (fake process group, FSDP2 `fully_shard` and TP's
    `parallelize_module`, with `parallel`'s mixed precision); None: one device."""

    kernels: str | None = None
    """Fake mode: the GPU whose attention kernels run (`workbench.capture.kernels`); default
    h100."""

    optimizer: OptimizerName = "adamw"
    """Optimizer state held through the step, as the estimate holds it (fp32 per element)."""

    allocator: AllocatorConfig | None = None
    """The caching allocator's settings the reserved figure is replayed in."""

    layers_attr: str = "layers"
    """The model's container of blocks: each block is one checkpoint region and FSDP unit."""

    kinds: tuple[AcKind, ...] = ("none", "sac", "full")
    """Which baselines to run."""


@dataclass
class EagerBaseline:
    """One baseline as torch's tracker saw it, and the caching allocator's replay of its
    allocations (on a GPU's allocator; None for a real run on the CPU, which has none)."""

    kind: AcKind
    rule: str
    mode: Mode
    kernels: str
    tracked: TrackedStep
    allocator: AllocatorReplay | None
    notes: list[str] = field(default_factory=list)
    # cuBLAS's workspaces a GPU run holds beside the tensors (`workbench.cost.workspaces`)
    workspaces: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return BASELINE_KINDS[self.kind]

    @property
    def peak_bytes(self) -> int:
        """The tracker's peak (what the step's tensors held at most at once) and, on a GPU,
        cuBLAS's workspaces, which no tensor holds."""
        return self.tracked.peak_bytes + sum(self.workspaces)

    @property
    def reserved_peak_bytes(self) -> int | None:
        return self.allocator.reserved_peak_bytes if self.allocator is not None else None

    @property
    def reserved_by_stream(self) -> dict[str, int]:
        """What each stream's pools reserved, by the stream's name (FSDP2's all-gather and
        reduce-scatter streams keep pools the default stream cannot reuse); empty without an
        allocator."""
        return {} if self.allocator is None else self.tracked.named_streams(self.allocator)

    def to_json(self) -> dict[str, Any]:
        """Flat figures first (the printed table's columns), then the tracker's breakdown at
        the peak, per-module peaks and the allocator's figures; `notes` apart (what kernels
        ran: the same for every baseline of a job)."""
        allocator = (
            {
                "allocated_peak_bytes": self.allocator.allocated_peak_bytes,
                "segments": self.allocator.segments,
                "reserved_by_stream": self.reserved_by_stream,
            }
            if self.allocator is not None
            else None
        )
        return {
            "name": self.name,
            "peak_bytes": self.peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "peak_module": self.tracked.peak_module,
            "peak_phase": self.tracked.peak_phase,
            "peak_breakdown": self.tracked.peak_breakdown,
            "workspace_bytes": sum(self.workspaces),
            "kind": self.kind,
            "rule": self.rule,
            "tracker": self.tracked.tracker,
            "kernels": self.kernels,
            "module_peaks": self.tracked.module_peaks,
            "allocator": allocator,
        }


def sac_rule() -> str:
    """Which eager SAC rule the `sac` baseline runs: torchtitan's own `SelectiveAC` where
    torchtitan is installed, else the workbench's `eager` preset exported as `policy_fn`
    (the same rule, written from it)."""
    try:
        import torchtitan.distributed.activation_checkpoint  # noqa: F401
    except Exception:  # torchtitan is optional, and its import pulls in much
        return WORKBENCH_SAC
    return TITAN_SAC


def apply_baseline_ac(model: nn.Module, kind: AcKind, layers_attr: str = "layers") -> str:
    """Wrap every block of `model.<layers_attr>` for the baseline `kind`, in place, as
    torchtitan's `ActivationCheckpointing.apply` does (its `_wrap_block` per block; the dynamo
    cache switch of `apply` is left alone): `sac` its `SelectiveAC` (or the workbench's
    `eager` preset without torchtitan, `sac_rule`), `full` torch's `checkpoint_wrapper`, `none`
    nothing. Returns the rule in words."""
    if kind == "none":
        return NO_AC
    blocks = getattr(model, layers_attr, None)
    if not isinstance(blocks, nn.ModuleList | nn.Sequential | nn.ModuleDict):
        raise WorkbenchError(
            f"{type(model).__name__} has no container of blocks at {layers_attr!r}: eager "
            f"{BASELINE_KINDS[kind]} wraps each block; pass layers_attr naming its nn.ModuleList"
        )
    rule = FULL_AC if kind == "full" else sac_rule()
    if rule == WORKBENCH_SAC:
        apply_eager_sac(model, Policy("eager"), layers_attr)
        return rule
    wrap = _titan_wrap() if kind == "sac" else _full_wrap
    for name, block in list(blocks.named_children()):
        blocks.register_module(name, wrap(block, f"{layers_attr}.{name}"))
    return rule


def _full_wrap(block: nn.Module, fqn: str) -> nn.Module:
    """torchtitan's `FullAC._wrap_block` with its defaults: non-reentrant `checkpoint`."""
    return checkpoint_wrapper(block, preserve_rng_state=True, early_stop=False)


def _titan_wrap() -> Callable[[nn.Module, str], nn.Module]:
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    policy = SelectiveAC(SelectiveAC.Config())
    return lambda block, fqn: policy._wrap_block(block, base_fqn=fqn)


@dataclass
class EagerRun:
    """One eager train step ready to run: the (wrapped, sharded) model and its batch, the
    optimizer holding its state. `step()` runs forward, the loss and `backward`, then hands
    the gradients back and leaves `.grad` empty, so that repeated runs start alike (a
    measurement's last run frees nothing made before it)."""

    name: str
    rule: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    optimizer: torch.optim.Optimizer | None
    kernels: str
    mode: Mode = "fake"
    tensor_parallel: bool = False
    switched: ModelKernels = field(default_factory=ModelKernels)
    records: list[AttentionRecord] = field(default_factory=list)

    def notes(self) -> list[str]:
        """Which kernels ran (`workbench.capture.kernels`), after a step has run."""
        record = None
        for other in self.records:
            record = record or AttentionRecord(other.arch)
            record.chosen.update(other.chosen)
        return kernel_notes(self.kernels, self.mode, record, self.switched)

    def held(self) -> list[torch.Tensor]:
        """What exists before the step: parameters, buffers, optimizer state, the batch."""
        state = [
            t
            for s in (self.optimizer.state.values() if self.optimizer else ())
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ]
        target = [self.target] if isinstance(self.target, torch.Tensor) else []
        return [*self.model.parameters(), *self.model.buffers(), *state, *self.inputs, *target]

    def step(self) -> list[torch.Tensor]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        loss_context = loss_parallel() if self.tensor_parallel else contextlib.nullcontext()
        with kernel_dispatch(self.kernels) as record, loss_context:
            if record is not None:
                self.records.append(record)
            loss = self.loss_fn(self.model(*self.inputs), self.target)
            loss.backward()
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return [loss.detach(), *(g for g in grads if g is not None)]


def _with_kernels(
    forward: Callable[..., Any], kernels: str, records: list[AttentionRecord]
) -> Callable[..., Any]:
    """`forward` with a GPU's attention kernels dispatched inside it: the kernels' function
    mode is not active in the recompute a checkpoint runs during backward, so each block
    enters it itself (the recompute then runs what the forward ran)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with kernel_dispatch(kernels) as record:
            if record is not None:
                records.append(record)
            return forward(*args, **kwargs)

    return run


def _own_kernels(workload: Workload, model: nn.Module, kernels: str) -> Any:
    """The workload's kernel switch (`Workload.kernel_context`) for the copy `model`: a switch
    made for the workload's own model (a partial naming it first, as torchtitan's) is bound
    to the copy instead."""
    switch = workload.kernel_context
    if switch is None:
        return contextlib.nullcontext(ModelKernels())
    if isinstance(switch, functools.partial) and switch.args and switch.args[0] is workload.model:
        return switch.func(model, *switch.args[1:], kernels, **switch.keywords)
    raise WorkbenchError(
        f"workload {workload.name!r} switches its kernels with a kernel_context not made for "
        "its model (a functools.partial naming it first): its eager baselines cannot switch a copy"
    )


def _refuse(workload: Workload, options: BaselineOptions) -> None:
    parallel = options.parallel
    if workload.stage is not None:
        raise WorkbenchError(
            f"{workload.name!r} is a pipeline stage: eager baselines run a whole model's step"
        )
    if parallel is not None and (parallel.ep > 1 or parallel.cp > 1):
        raise WorkbenchError(
            "eager baselines shard with FSDP2 and TP only: drop --ep/--cp (graph SAC "
            "estimates them)"
        )
    if parallel is not None and options.mode == "real":
        raise WorkbenchError(
            "eager baselines of a sharded job run on fake tensors: use --mode fake with --fsdp/--tp"
        )
    if parallel is not None and workload.name.startswith("torchtitan:"):
        raise WorkbenchError(
            f"{workload.name}'s rank is sharded by graph trainer's parallelize: its eager "
            "baselines run on one device only (drop --fsdp/--tp)"
        )


def _fake_copy(workload: Workload, fake_mode: FakeTensorMode) -> tuple[nn.Module, list[Any]]:
    """A copy of the model and batch on fake CPU tensors (values are not kept: fake tensors
    have none). Parameters tied in the model stay tied."""
    model = copy.deepcopy(workload.model)
    device = workload_device(workload)
    tied = tied_parameters(model)  # `to_empty` off the meta device gives each module its own
    with fake_mode:
        model.to_empty(device=device)
        batch = [
            torch.empty_like(t, device=device) if isinstance(t, torch.Tensor) else t
            for t in (*workload.inputs, workload.target)
        ]
    retie(tied, workload.name)
    return model, batch


def _tensor_parallel(model: nn.Module, workload: Workload, mesh: DeviceMesh) -> None:
    plan = workload.tp_plan or reference_tp_plan(model)
    if plan is None:
        raise WorkbenchError(
            f"--tp on {workload.name!r}: the model has no tensor-parallel plan; give one as "
            "workload.tp_plan, or use --tp 1"
        )
    check_tp_plan(plan, model, workload.name)
    tied = tied_parameters(model)
    if callable(plan):
        plan(model, mesh["tp"])
    else:
        parallelize_module(model, mesh["tp"], plan)
    retie(tied, workload.name)


def _fully_shard(model: nn.Module, parallel: Parallel, mesh: DeviceMesh, layers_attr: str) -> None:
    """FSDP2 as torchtitan's `apply_fsdp_to_decoder` wraps a dense decoder: the embedding its
    own unit, the final norm and output projection one unit not resharded after forward (one
    unit with the embedding when tied), each block a unit, then the root; bf16 (the job's
    `param_dtype`) compute and gathers, gradients reduced in `reduce_dtype`."""
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[parallel.param_dtype],
        reduce_dtype=DTYPES[parallel.reduce_dtype],
        cast_forward_inputs=False,
    )
    shard = functools.partial(fully_shard, mesh=mesh["fsdp"], mp_policy=mp)
    ends = [getattr(model, n, None) for n in ("tok_embeddings", "norm", "output")]
    embedding, norm, output = ends
    if tied_parameters(model) and all(m is not None for m in ends):
        shard([m for m in ends if m is not None], reshard_after_forward=False)
    else:
        if embedding is not None:
            shard(embedding, reshard_after_forward=True)
        if norm is not None and output is not None:
            shard([norm, output], reshard_after_forward=False)
    blocks = getattr(model, layers_attr, None)
    for block in blocks.children() if isinstance(blocks, nn.Module) else ():
        shard(block, reshard_after_forward=True)
    shard(model)


def _optimizer(model: nn.Module, name: OptimizerName, fake_mode: Any) -> Any:
    """The optimizer with its state made, as after its first step: fp32 moments per
    parameter element (`OPTIMIZER_STATE_BYTES`), as the estimate counts them."""
    moments = OPTIMIZER_STATE_BYTES[name] // 4
    if moments == 0:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(params) if name == "adamw" else torch.optim.SGD(params, momentum=0.9)
    )
    keys = ("exp_avg", "exp_avg_sq") if name == "adamw" else ("momentum_buffer",)
    with fake_mode or contextlib.nullcontext():
        for p in params:
            optimizer.state[p] = {k: torch.zeros_like(p, dtype=torch.float32) for k in keys}
    return optimizer


@contextlib.contextmanager
def eager_run(
    workload: Workload, kind: AcKind, options: BaselineOptions | None = None
) -> Iterator[EagerRun]:
    """The baseline `kind` of `workload` ready to run, as torchtitan builds a job: TP
    (`parallelize_module`), then activation checkpointing per block (`apply_baseline_ac`),
    then FSDP2 (`fully_shard`); inside the fake process group (sharded) and the fake mode
    (fake) it needs, which last until the context ends. The workload is not changed."""
    options = options or BaselineOptions()
    if kind not in BASELINE_KINDS:
        raise WorkbenchError(
            f"unknown baseline {kind!r}; choose one of {', '.join(BASELINE_KINDS)}"
        )
    _refuse(workload, options)
    device = workload_device(workload)
    kernels = resolve_kernels(options.kernels, options.mode, device)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if options.mode == "fake" else None
    parallel = options.parallel
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        # FSDP2 warns of an in-place op on a unit's view output; the step makes none
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
        mesh = stack.enter_context(fake_process_group(parallel)) if parallel else None
        if fake_mode is not None:
            model, batch = _fake_copy(workload, fake_mode)
        else:
            if any(t.is_meta for t in workload.model.parameters()):
                raise WorkbenchError(
                    f"model {workload.name!r} lives on the meta device: run its baselines "
                    "with mode='fake'"
                )
            model, batch = copy.deepcopy(workload.model), [*workload.inputs, workload.target]
        switched: ModelKernels = stack.enter_context(_own_kernels(workload, model, kernels))
        records: list[AttentionRecord] = []
        blocks = getattr(model, options.layers_attr, None)
        for block in blocks.children() if isinstance(blocks, nn.Module) else ():
            block.forward = _with_kernels(block.forward, kernels, records)  # type: ignore[method-assign]
        if parallel is not None and mesh is not None:
            check_tp_shapes(workload, parallel)
            if parallel.tp > 1:
                _tensor_parallel(model, workload, mesh)
        rule = apply_baseline_ac(model, kind, options.layers_attr)
        if parallel is not None and mesh is not None:
            _fully_shard(model, parallel, mesh, options.layers_attr)
        assert workload.loss_fn is not None
        optimizer = _optimizer(model, options.optimizer, fake_mode)
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        yield EagerRun(
            name=BASELINE_KINDS[kind],
            rule=rule,
            model=model,
            inputs=tuple(batch[:-1]),
            target=batch[-1],
            loss_fn=workload.loss_fn,
            optimizer=optimizer,
            kernels=kernels,
            mode=options.mode,
            tensor_parallel=parallel is not None and parallel.tp > 1,
            switched=switched,
            records=records,
        )


def _baseline(workload: Workload, kind: AcKind, options: BaselineOptions) -> EagerBaseline:
    try:
        with eager_run(workload, kind, options) as run:
            held = [*run.inputs, run.target]
            _, tracked = track_step(run.step, run.model, held=held, optimizer=run.optimizer)
    except WorkbenchError:
        raise
    except Exception as err:  # the user's model under torch's hooks and wrappers: one line
        raise WorkbenchError(
            f"the eager {BASELINE_KINDS[kind]} step of {workload.name!r} failed: {describe(err)}"
        ) from err
    workspaces = gpu_workspaces(run.kernels) if options.mode == "fake" else []
    replay = None
    if options.mode == "fake":  # the workspaces first: made at the first step's first matmul
        held = [(-1 - k, size, 0) for k, size in enumerate(workspaces)]
        replay = replay_events([*held, *tracked.events], options.allocator)
    return EagerBaseline(
        kind, run.rule, options.mode, run.kernels, tracked, replay, run.notes(), workspaces
    )


def estimate_baselines(
    workload: Workload, options: BaselineOptions | None = None
) -> list[EagerBaseline]:
    """Each baseline of `options.kinds` run once under torch's tracker (`eager_run`,
    `workbench.interop.trackers.track_step`); in fake mode its allocations are also replayed
    through the caching-allocator model for the reserved figure."""
    options = options or BaselineOptions()
    return [_baseline(workload, kind, options) for kind in options.kinds]


def measure_baseline(
    workload: Workload,
    kind: AcKind,
    options: BaselineOptions | None = None,
    *,
    warmup: int = 1,
    repeats: int = 1,
) -> Measurement:
    """The baseline's step run for real and measured as `workbench.cost.measure` measures any
    step (`measure_run`: the CPU allocator's profiler events, or CUDA's peak statistics): the
    figure its tracker estimate is checked against."""
    options = options or BaselineOptions(mode="real")
    if options.mode != "real":
        raise WorkbenchError("measure_baseline runs the step for real: give mode='real'")
    with eager_run(workload, kind, options) as run:
        return measure_run(run.name, run.step, run.held(), workload.tokens, warmup, repeats)
