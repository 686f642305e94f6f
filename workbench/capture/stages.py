"""Pipeline stages: the model split as torchtitan splits it, one stage's joint graph per rank.

Entry points: `Pipeline(pp=, schedule=, microbatches=)`, `split_layers(n_layers, n_stages)`,
`Pipeline.layout(n_layers) -> StageLayout`, `stage_workload(workload, layout, stage)` and
`trace_stages(workload, mode, parallel, pipeline, stages=None) -> list[JointGraph]`.

A stage's graph is one microbatch's forward and backward of its layers, as torch's
`PipelineStage` runs them: a stage after the first receives hidden states (their gradient is
its last output), one before the last receives its output's gradient instead of a loss.
A torchtitan model's stage on a rank is graph trainer's `graph_pp` stage
(`workbench.capture.titan_rank`).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from workbench.capture.graph import JointGraph
from workbench.capture.models import DTYPES, Workload
from workbench.capture.models.llama3 import Llama3
from workbench.capture.pipeline import (
    check_microbatches,
    rank_stages,
    schedule_class,
    stages_per_rank,
)
from workbench.capture.tracing import Mode
from workbench.capture.workload import MAX_LAYERS, StageRole
from workbench.errors import WorkbenchError, check_int, check_type

if TYPE_CHECKING:
    from workbench.capture.parallel import Parallel

__all__ = [
    "Pipeline",
    "StageLayout",
    "n_layers",
    "split_layers",
    "stage_workload",
    "trace_stages",
]

# torchtitan's `pipeline_parallel_first_stage_less_layers` / `..._last_stage_less_layers`
# defaults: the embedding and the norm + output each count as one layer when splitting.
INPUT_WEIGHT = 1
OUTPUT_WEIGHT = 1
MAX_PP = 4096  # far above any job's pipeline depth; bounds the schedule torch builds
MAX_MICROBATCHES = 4096


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """How a job pipelines its layers: `pp` ranks (the job's `Degrees.pp`), torch's schedule
    by name (`1F1B`, `Interleaved1F1B`, `ZBVZeroBubble`, ...), microbatches per step (None:
    one per stage, what a schedule needs to fill the pipeline), and optionally torchtitan's
    `pipeline_parallel_layers_per_stage`, which sets the number of stages."""

    pp: int
    schedule: str = "1F1B"
    microbatches: int | None = None
    layers_per_stage: int | None = None

    def __post_init__(self) -> None:
        check_int("--pp", self.pp, 1, MAX_PP, "pipeline ranks")
        cls = schedule_class(self.schedule)  # one line listing torch's schedules if unknown
        object.__setattr__(self, "schedule", cls.__name__.removeprefix("Schedule"))
        if self.microbatches is not None:
            check_int("--microbatches", self.microbatches, 1, MAX_MICROBATCHES, "microbatches")
        if self.layers_per_stage is not None:
            check_int("--layers-per-stage", self.layers_per_stage, 1, 2**20, "layers")

    def layout(self, n_layers: int) -> StageLayout:
        """The stages and the layers each holds, as torchtitan derives them."""
        check_int("n_layers", n_layers, 1, MAX_LAYERS, "a model's transformer blocks")
        per_rank = stages_per_rank(self.schedule)
        if self.layers_per_stage is None:
            n_stages = self.pp * per_rank
        else:
            n_stages = math.ceil((n_layers + INPUT_WEIGHT + OUTPUT_WEIGHT) / self.layers_per_stage)
            if n_stages % self.pp:
                raise WorkbenchError(
                    f"--layers-per-stage {self.layers_per_stage} makes {n_stages} virtual stages "
                    f"of {n_layers} layers (+1 embedding, +1 output), which --pp {self.pp} does "
                    f"not divide; choose a --layers-per-stage giving a multiple of {self.pp} stages"
                )
            if n_stages != self.pp * per_rank:
                raise WorkbenchError(
                    f"--layers-per-stage {self.layers_per_stage} gives {n_stages // self.pp} "
                    f"stages per rank; --pp-schedule {self.schedule} runs {per_rank} (torch's "
                    f"schedules here run 1 or 2): choose a --layers-per-stage near "
                    f"{math.ceil((n_layers + INPUT_WEIGHT + OUTPUT_WEIGHT) / (self.pp * per_rank))}"
                )
        microbatches = self.microbatches or n_stages
        check_microbatches(self.schedule, self.pp, microbatches)
        return StageLayout(self, tuple(split_layers(n_layers, n_stages)), microbatches)

    def to_json(self) -> dict[str, Any]:
        return {
            "pp": self.pp,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "layers_per_stage": self.layers_per_stage,
        }


@dataclass(frozen=True)
class StageLayout:
    """A pipeline's stages over one model: the layers of each and the rank running it."""

    pipeline: Pipeline
    layers: tuple[tuple[int, ...], ...]
    microbatches: int
    ranks: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        rank_of = {}
        for rank in range(self.pipeline.pp):
            for stage in rank_stages(self.pipeline.schedule, self.pipeline.pp, rank):
                rank_of[stage] = rank
        object.__setattr__(self, "ranks", tuple(rank_of[s] for s in range(self.n_stages)))

    @property
    def n_stages(self) -> int:
        return len(self.layers)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.ranks) if r == rank]

    def check_stage(self, stage: int) -> int:
        return check_int("--stage", stage, 0, self.n_stages - 1, "stages of this pipeline")

    def to_json(self) -> dict[str, Any]:
        return {
            **self.pipeline.to_json(),
            "microbatches": self.microbatches,
            "stages": self.n_stages,
            "stages_per_rank": self.n_stages // self.pipeline.pp,
            "stage_layers": [list(layers) for layers in self.layers],
            "stage_ranks": list(self.ranks),
        }


def split_layers(
    n_layers: int,
    n_stages: int,
    input_weight: int = INPUT_WEIGHT,
    output_weight: int = OUTPUT_WEIGHT,
) -> list[tuple[int, ...]]:
    """torchtitan's split (`_generate_llm_fqn_per_model_part`): the embedding and the output
    count as `input_weight` and `output_weight` layers; stages share the effective layers
    evenly, the first ones taking one more each when they do not divide."""
    if n_stages == 1:
        return [tuple(range(n_layers))]
    effective = n_layers + input_weight + output_weight
    if n_stages > effective:
        raise WorkbenchError(
            f"{n_stages} pipeline stages cannot split {n_layers} layers (+{input_weight} for the "
            f"embedding, +{output_weight} for the output): choose --pp with at most {effective} "
            "stages in all"
        )
    base, extra = divmod(effective, n_stages)
    if max(input_weight, output_weight) > base:
        raise WorkbenchError(
            f"{n_stages} pipeline stages of {n_layers} layers give {base} per stage, fewer than "
            "the embedding and output count for; choose a smaller --pp"
        )
    stages, start = [], 0
    for s in range(n_stages):
        share = base + (1 if s < extra else 0)
        share -= input_weight if s == 0 else output_weight if s == n_stages - 1 else 0
        stages.append(tuple(range(start, min(start + share, n_layers))))
        start = min(start + share, n_layers)
    return stages


def n_layers(workload: Workload) -> int:
    """The layers a pipeline splits; refuses a model not laid out as torchtitan's."""
    from workbench.capture.titan_rank import is_titan_workload

    model = workload.model
    layers = getattr(model, "layers", None)
    if not (isinstance(model, Llama3) or is_titan_workload(workload)) or not isinstance(
        layers, nn.ModuleDict
    ):
        raise WorkbenchError(
            f"--pp splits models laid out as torchtitan's (tok_embeddings, layers keyed by "
            f"index, norm, output); {workload.name!r} is a {type(model).__name__}: use a "
            "reference model (llama3-*, dsv3-*) or a torchtitan model"
        )
    return len(layers)


def _stage_model(model: nn.Module, layers: tuple[int, ...], role: StageRole) -> nn.Module:
    """The modules stage `role` holds, sharing the model's parameters (torchtitan deletes the
    others from a copy; module paths stay, so `layers.40` is `layers.40` on its stage). The
    output projection is `output` on the reference models, `lm_head` on torchtitan's."""
    stage = copy.copy(model)
    stage._modules = dict(model._modules)
    held: Any = model.layers
    stage.layers = nn.ModuleDict({str(i): held[str(i)] for i in layers})
    dropped = [] if role.first else ["tok_embeddings"]
    dropped += [] if role.last else ["norm", "output", "lm_head"]
    for name in dropped:
        if name in stage._modules:
            setattr(stage, name, None)
    return stage


def stage_workload(
    workload: Workload, layout: StageLayout, stage: int, parallel: Parallel | None = None
) -> Workload:
    """One microbatch of stage `stage`: its modules; tokens or the hidden states it receives
    (this rank's sequence shard under TP, in the compute dtype); the target on the last stage,
    else its output's gradient."""
    layout.check_stage(stage)
    n_layers(workload)
    model: Any = workload.model
    tokens = workload.inputs[0]
    if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
        raise WorkbenchError(
            f"--pp needs token ids (batch, seq) as the model's input; {workload.name!r} takes "
            f"{tokens.dtype} {tuple(tokens.shape)}"
        )
    batch, seq = (int(d) for d in tokens.shape)
    microbatches = layout.microbatches
    if batch % microbatches:
        raise WorkbenchError(
            f"--microbatches {microbatches} does not divide the batch of {batch} sequences; "
            f"choose a --batch that is a multiple of {microbatches}"
        )
    micro = batch // microbatches
    role = StageRole(stage, layout.n_stages, layout.layers[stage], micro * seq, seq)
    stage_model = _stage_model(model, role.layers, role)
    shards = parallel.tp * parallel.cp if parallel is not None else 1
    dtype = DTYPES[parallel.param_dtype] if parallel is not None else _dtype_of(model)
    hidden = (micro, seq // shards if seq % shards == 0 else seq, model.config.dim)

    def received(seed: int) -> torch.Tensor:
        if tokens.is_meta:
            return torch.empty(hidden, dtype=dtype, device="meta")
        generator = torch.Generator(tokens.device).manual_seed(seed)
        return torch.randn(hidden, dtype=dtype, device=tokens.device, generator=generator)

    inputs = (tokens[:micro],) if role.first else (received(stage).requires_grad_(),)
    return Workload(
        model=stage_model,
        inputs=inputs,
        target=workload.target[:micro] if role.last else None,
        loss_fn=workload.loss_fn if role.last else None,
        name=workload.name,
        config={
            **workload.config,
            "batch": micro,
            "local_batch": batch,
            "layers": len(role.layers),
            "stage": role.to_json(),
            "pipeline": layout.to_json(),
        },
        tp_plan=workload.tp_plan,
        notes=list(workload.notes),
        stage=role,
        grad_output=None if role.last else received(10_000 + stage),
        kernel_context=_kernel_context(workload, stage_model, micro, seq),
    )


def _kernel_context(workload: Workload, stage_model: nn.Module, micro: int, seq: int) -> Any:
    """The stage's kernel switch: a torchtitan model's (`titan_kernels`: its flex attention's
    block mask) sized to the microbatch; a reference model has none."""
    from workbench.capture.titan_rank import is_titan_workload

    if not is_titan_workload(workload):
        return workload.kernel_context
    from workbench.capture.models.torchtitan import titan_kernels

    return functools.partial(titan_kernels, stage_model, micro, seq)


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


# Layers traced in full over a pipeline's stages: at about a fifth of a second each (fake
# mode, one CPU), a minute's tracing. A stage of more than TEMPLATE_LAYERS layers traces that
# many in fake mode and stamps the rest; a stage of fewer traces all its own.
MAX_TRACED_LAYERS = 256


def _check_traced_layers(layout: StageLayout, stages: list[int], mode: Mode) -> None:
    """Refuse a pipeline whose stages would trace more layers in full than MAX_TRACED_LAYERS
    (hundreds of stages of a layer or two each), naming the limit and the ways under it."""
    from workbench.capture.stamp import TEMPLATE_LAYERS

    def traced(layers: tuple[int, ...]) -> int:
        return min(len(layers), TEMPLATE_LAYERS) if mode == "fake" else len(layers)

    total = sum(traced(layout.layers[s]) for s in stages)
    if total > MAX_TRACED_LAYERS:
        whole = f"up to {TEMPLATE_LAYERS} layers" if mode == "fake" else "real mode traces all"
        raise WorkbenchError(
            f"{len(stages)} pipeline stages would trace {total} layers in full (a stage's "
            f"{whole}), past the {MAX_TRACED_LAYERS} that take about a minute: trace one "
            "stage (--stage), or give fewer stages (--pp, --layers-per-stage) of more "
            "layers each"
        )


def trace_stages(
    workload: Workload,
    mode: Mode,
    parallel: Parallel | None,
    pipeline: Pipeline,
    stages: list[int] | None = None,
    templates: dict[Any, Any] | None = None,
    kernels: str | None = None,
) -> list[JointGraph]:
    """The joint graph of each stage in `stages` (all by default), in stage order. Stages
    of one role stamp from one traced template (`templates`: kept by a caller tracing more
    pipelines of the same job, such as the planner). `kernels`: as `trace` takes them."""
    from workbench.capture.parallel import Parallel
    from workbench.capture.trace import trace

    check_type("workload", workload, Workload, "a Workload (load_workload)")
    check_type("pipeline", pipeline, Pipeline, "a Pipeline(pp=...)")
    check_type("parallel", parallel, (Parallel, type(None)), "a Parallel or None")
    if parallel is not None and parallel.pp not in (1, pipeline.pp):
        raise WorkbenchError(
            f"parallel pp {parallel.pp} is not the pipeline's pp {pipeline.pp}: build both "
            "from one Degrees (Pipeline(pp=degrees.pp, ...), Parallel.of(degrees))"
        )
    from workbench.capture.titan_rank import check_titan_pipeline, is_titan_workload

    if is_titan_workload(workload):
        check_titan_pipeline(workload.name, pipeline.schedule)
    layout = pipeline.layout(n_layers(workload))
    chosen = list(range(layout.n_stages)) if stages is None else stages
    _check_traced_layers(layout, chosen, mode)
    templates = {} if templates is None else templates
    return [
        trace(
            stage_workload(workload, layout, s, parallel),
            mode,
            parallel,
            templates=templates,
            kernels=kernels,
        )
        for s in chosen
    ]
