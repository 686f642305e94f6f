"""The layouts a planner tries: every fsdp x tp x pp x ep x schedule x microbatches dividing
the model and the GPUs, and the analytic memory bound that prunes before anything is traced.

Entry points: `PlanOptions` (what to plan), `Candidate`, `Pruned`, `ParamCounts.of(model)`,
`lower_bound_bytes(counts, candidate, layout)`, `ep_degrees(workload, ranks)` and
`layouts(options, workload) -> (candidates, pruned)` (what `workbench.search.planner.plan`
enumerates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from workbench.capture.degrees import Degrees, divisors
from workbench.capture.expert_parallel import check_expert_parallel
from workbench.capture.models import DTYPES, Workload, model_names
from workbench.capture.parallel import Parallel, check_fsdp_shapes, check_tp_shapes
from workbench.capture.pipeline import (
    SCHEDULES,
    check_microbatches,
    schedule_class,
    stages_per_rank,
)
from workbench.capture.stages import Pipeline, StageLayout, split_layers
from workbench.capture.titan_rank import (
    check_titan_parallel,
    check_titan_pipeline,
    is_titan_workload,
    titan_experts,
)
from workbench.capture.workload import MAX_LAYERS
from workbench.cost.estimate import OPTIMIZER_STATE_BYTES, OptimizerName
from workbench.cost.profiles import get_profile
from workbench.errors import WorkbenchError, check_int, check_type

__all__ = [
    "MICROBATCH_MULTIPLES",
    "OPTIMIZER",
    "PLAN_DEGREES",
    "PLAN_SCHEDULES",
    "Candidate",
    "ParamCounts",
    "PlanOptions",
    "Pruned",
    "ep_degrees",
    "layouts",
    "lower_bound_bytes",
]

OPTIMIZER: OptimizerName = "adamw"
MAX_GPUS = 2**20
MAX_JOBS = 256  # worker processes; each holds one group's stage graphs
# The schedules tried by default: one stage per rank, looped virtual stages, and a V
# zero-bubble schedule (input and weight gradients apart).
PLAN_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
# Microbatches tried per layout: these multiples of the stage count (those dividing the
# local batch).
MICROBATCH_MULTIPLES = (1, 2, 4)
# torchtitan's Llama3 70B benchmark: 256 H100s, FSDP 32 x TP 8, local batch 16 -> 512
# sequences a step, two per GPU.
SEQUENCES_PER_GPU = 2
# The degrees a plan enumerates, named in every layout's JSON (others only when used).
PLAN_DEGREES = ("fsdp", "tp", "pp", "ep")


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What to plan: a reference model on `gpus` GPUs of profile `gpu`."""

    model: str
    gpus: int
    gpu: str = "h100"
    memory_bytes: int | None = None
    """Per-GPU memory the peak must fit (None: the profile's `memory_bytes`)."""
    seq: int = 8192
    global_batch: int | None = None
    """Sequences per step over all data-parallel ranks (None: 2 per GPU)."""
    layers: int | None = None
    """Override the model's layer count (small plans, tests)."""
    schedules: tuple[str, ...] = PLAN_SCHEDULES
    microbatch_multiples: tuple[int, ...] = MICROBATCH_MULTIPLES
    """Microbatches tried: these multiples of the stage count (each a stage graph to trace)."""
    jobs: int = 1
    """Worker processes evaluating groups of layouts side by side (1: all in this process;
    `plan --jobs` defaults to one per CPU). The plan is the same for any count."""

    def __post_init__(self) -> None:
        check_type("model", self.model, str, "a reference model's or torchtitan:FAMILY/FLAVOR")
        check_type("gpu", self.gpu, str, "a device profile's name (h100, h200)")
        for name in ("schedules", "microbatch_multiples"):
            check_type(name, getattr(self, name), (tuple, list), "a tuple")
        if self.layers is not None:
            check_int("--layers", self.layers, 1, MAX_LAYERS, "transformer blocks")
        if self.model not in model_names() and not self.model.startswith("torchtitan:"):
            raise WorkbenchError(
                f"plan splits reference models and torchtitan's (torchtitan:FAMILY/FLAVOR); "
                f"{self.model!r} is neither: choose one of {', '.join(model_names())}"
            )
        check_int("--gpus", self.gpus, 1, MAX_GPUS, "GPUs in one job")
        profile = get_profile(self.gpu)  # one line listing the profiles if unknown
        if self.memory_bytes is None and profile.memory_bytes is None:
            raise WorkbenchError(
                f"--gpu {self.gpu} has no fixed memory size; give --memory-gib, or use h100, h200"
            )
        if self.memory_bytes is not None and (
            isinstance(self.memory_bytes, bool)
            or not isinstance(self.memory_bytes, int)
            or self.memory_bytes <= 0
        ):
            raise WorkbenchError(
                f"--memory-gib must be a positive number of GiB, got {self.memory_bytes!r} bytes"
            )
        if not self.schedules:
            raise WorkbenchError(f"--schedules names none; choose from {', '.join(SCHEDULES)}")
        names = (schedule_class(s).__name__.removeprefix("Schedule") for s in self.schedules)
        # a schedule or multiple named twice (also by another spelling) is planned once
        object.__setattr__(self, "schedules", tuple(dict.fromkeys(names)))
        if not self.microbatch_multiples:
            raise WorkbenchError("--microbatch-multiples names none; e.g. 1,2,4")
        for multiple in self.microbatch_multiples:
            check_int("--microbatch-multiples", multiple, 1, 1024, "multiples of the stages")
        object.__setattr__(
            self, "microbatch_multiples", tuple(dict.fromkeys(self.microbatch_multiples))
        )
        check_int("--seq", self.seq, 1, 2**31 - 1, "tokens")
        if self.global_batch is not None:
            check_int("--global-batch", self.global_batch, 1, 2**31 - 1, "sequences")
        check_int("--jobs", self.jobs, 1, MAX_JOBS, "worker processes")

    @property
    def budget_bytes(self) -> int:
        profile_bytes = get_profile(self.gpu).memory_bytes
        chosen = self.memory_bytes if self.memory_bytes is not None else profile_bytes
        assert chosen is not None
        return chosen

    @property
    def batch(self) -> int:
        return self.global_batch or SEQUENCES_PER_GPU * self.gpus


@dataclass(frozen=True)
class Candidate:
    """One layout: its `degrees` (fsdp x tp x pp ranks; EP, routed experts over `ep` of the
    fsdp x tp ranks, 1 on dense models), the schedule (None without PP) and microbatches per
    step of one data-parallel rank (`local_batch` sequences)."""

    degrees: Degrees
    schedule: str | None
    microbatches: int
    local_batch: int

    @property
    def microbatch_size(self) -> int:
        return self.local_batch // self.microbatches

    def pipeline(self) -> Pipeline:
        assert self.schedule is not None
        return Pipeline(pp=self.degrees.pp, schedule=self.schedule, microbatches=self.microbatches)

    def parallel(self) -> Parallel:
        """Always a `Parallel`, one rank included: every layout computes in the same mixed
        precision (bf16 parameters gathered from fp32 shards), as torchtitan trains. EP
        routes balanced (`ep_imbalance` 1)."""
        return Parallel.of(self.degrees)

    def describe(self) -> str:
        """`fsdp 4 x tp 2 x pp 1`, `... x ep 8` when EP is used."""
        return self.degrees.describe(PLAN_DEGREES[:3])

    def to_json(self) -> dict[str, Any]:
        return {
            **self.degrees.used(PLAN_DEGREES),
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "microbatch_size": self.microbatch_size,
            "local_batch": self.local_batch,
        }


@dataclass(frozen=True)
class Pruned:
    """A layout dropped before tracing, and why."""

    degrees: Degrees
    schedule: str | None
    reason: str
    lower_bound_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.degrees.used(PLAN_DEGREES),
            "schedule": self.schedule,
            "reason": self.reason,
            "lower_bound_bytes": self.lower_bound_bytes,
        }


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of each layer, of the embedding and of the norm and output: what a stage
    holds, counted once per model (tied weights once, as `parameters()` yields them); and
    of each layer, its routed experts' (sharded apart from the rest under EP)."""

    layers: tuple[int, ...]
    embedding: int
    head: int
    itemsize: int  # of the master weights
    experts: tuple[int, ...] = ()
    """Routed-expert parameters of each layer (a part of `layers`; empty: none)."""

    @classmethod
    def of(cls, model: nn.Module) -> ParamCounts:
        def count(*modules: nn.Module | None) -> int:
            seen = {id(p): p.numel() for m in modules if m is not None for p in m.parameters()}
            return sum(seen.values())

        blocks: Any = model.layers  # a ModuleDict keyed by index (`capture.stages.n_layers`)
        ids = [str(i) for i in range(len(blocks))]
        experts = [
            count(*(m for m in blocks[i].modules() if type(m).__name__ == "GroupedExperts"))
            for i in ids
        ]
        # the output projection: `output` on the reference models, `lm_head` on torchtitan's
        head = getattr(model, "output", None) or getattr(model, "lm_head", None)
        return cls(
            layers=tuple(count(blocks[i]) for i in ids),
            embedding=count(model.tok_embeddings),  # type: ignore[arg-type]
            head=count(model.norm, head),  # type: ignore[arg-type]
            itemsize=next(model.parameters()).dtype.itemsize,
            experts=tuple(experts) if any(experts) else (),
        )

    def stage(self, layers: tuple[int, ...], first: bool, last: bool) -> int:
        held = sum(self.layers[i] for i in layers)
        return held + (self.embedding if first else 0) + (self.head if last else 0)

    def stage_experts(self, layers: tuple[int, ...]) -> int:
        """The routed-expert part of `stage(layers, ...)`."""
        return sum(self.experts[i] for i in layers) if self.experts else 0


def lower_bound_bytes(counts: ParamCounts, candidate: Candidate, layout: StageLayout | None) -> int:
    """The most any rank holds before activations: fp32 parameter shards and the
    optimizer's state; under PP with FSDP the stage's unsharded parameters (compute dtype)
    and unsharded gradients (reduce dtype), as torch's `PipelineStage` keeps them; else the
    gradients (shards with FSDP). Dense parameters are counted as split by TP (norms, the
    router and shared experts are not, so this stays below); routed experts as the reference
    MoE shards them: replicated over TP and sharded over fsdp without EP; with EP, as
    torchtitan does, split over ep and the efsdp = fsdp x tp / ep ranks left, gathered to
    1/ep of them."""
    master, state = counts.itemsize, OPTIMIZER_STATE_BYTES[OPTIMIZER]
    parallel = candidate.parallel()
    low, reduce = DTYPES[parallel.param_dtype].itemsize, DTYPES[parallel.reduce_dtype].itemsize
    fsdp, tp, ep = parallel.fsdp, parallel.tp, parallel.ep
    efsdp = parallel.efsdp if ep > 1 else fsdp
    # (ranks a shard is split over, ranks the gathered whole is split over, FSDP degree)
    dense, experts = (fsdp * tp, tp, fsdp), (efsdp * ep, ep, efsdp)
    if layout is None:
        params = counts.stage(tuple(range(len(counts.layers))), True, True)
        routed = counts.stage_experts(tuple(range(len(counts.layers))))
        held = [(params - routed, dense), (routed, experts)]
        return sum(n * (master + state + master) // shards for n, (shards, _, _) in held)
    worst = 0
    for rank in range(parallel.pp):
        total = 0
        for stage in layout.stages_of(rank):
            layers = layout.layers[stage]
            params = counts.stage(layers, stage == 0, stage == layout.n_stages - 1)
            routed = counts.stage_experts(layers)
            for n, (shards, split, degree) in ((params - routed, dense), (routed, experts)):
                unsharded = (low + reduce) if degree > 1 else master
                total += n * (master + state) // shards + n * unsharded // split
        worst = max(worst, total)
    return worst


def _tp_refusal(workload: Workload, tp: int, max_tp: int) -> str | None:
    if tp > max_tp:
        return f"tp {tp} spans more than one node of {max_tp} GPUs"
    try:
        if is_titan_workload(workload):
            check_titan_parallel(workload, Parallel(tp=tp), "h100")
        else:
            check_tp_shapes(workload, Parallel(tp=tp))
    except WorkbenchError as err:
        return str(err).split(";")[0]
    return None


def _fsdp_refusal(workload: Workload, degrees: Degrees) -> str | None:
    """Why FSDP cannot split the parameters' rows so (`check_fsdp_shapes`), or None."""
    try:
        check_fsdp_shapes(workload, Parallel.of(degrees))
    except WorkbenchError as err:
        return str(err).split(";")[0]
    return None


def _microbatch_counts(
    multiples: tuple[int, ...], schedule: str, pp: int, n_stages: int, local: int
) -> list[int]:
    """Multiples of the stage count dividing the local batch that torch's schedule takes."""
    counts = []
    for multiple in multiples:
        count = n_stages * multiple
        if count > local or local % count:
            continue
        try:
            check_microbatches(schedule, pp, count)
        except WorkbenchError:  # torch's own rule on the count
            continue
        counts.append(count)
    return counts


def _pipeline_refusal(options: PlanOptions, schedule: str) -> str | None:
    """Why graph trainer's graph_pp does not pipeline a torchtitan model so (its schedules)."""
    if not options.model.startswith("torchtitan:"):
        return None
    try:
        check_titan_pipeline(options.model, schedule)
    except WorkbenchError as err:
        return str(err).split("; choose")[0]
    return None


def ep_degrees(workload: Workload, ranks: int) -> list[int]:
    """The EP degrees to try with `ranks` = fsdp x tp: those dividing both the routed
    experts and the ranks EP borrows from; [1] on a dense model.

    >>> from workbench.capture.models import load_workload
    >>> ep_degrees(load_workload("dsv3-debug", layers=2, device="meta"), 12)
    [1, 2, 4]
    >>> ep_degrees(load_workload("llama3-debug", layers=2, device="meta"), 8)
    [1]
    """
    config = getattr(workload.model, "moe_config", None)
    experts = config.n_experts if config is not None else titan_experts(workload)
    if not experts:
        return [1]
    return [ep for ep in divisors(ranks) if experts % ep == 0]


def _ep_refusal(workload: Workload, degrees: Degrees) -> str | None:
    """Why the MoE cannot shard its experts so: the reference MoE's efsdp divides none of
    their sizes; a torchtitan model's, graph trainer's `parallelize` refuses the degrees."""
    try:
        if is_titan_workload(workload):
            check_titan_parallel(workload, Parallel.of(degrees), "h100")
        else:
            check_expert_parallel(workload, Parallel.of(degrees))
    except WorkbenchError as err:
        return str(err).split(";")[0]
    return None


def layouts(options: PlanOptions, workload: Workload) -> tuple[list[Candidate], list[Pruned]]:
    """Every fsdp x tp x pp x ep x schedule x microbatches dividing the model and the GPUs,
    and those pruned before tracing (with the reason and, for memory, the lower bound)."""
    counts = ParamCounts.of(workload.model)
    max_tp = get_profile(options.gpu).ranks_per_node
    kept: list[Candidate] = []
    pruned: list[Pruned] = []
    for tp in divisors(options.gpus):
        refusal = _tp_refusal(workload, tp, max_tp)
        for pp in divisors(options.gpus // tp):
            fsdp = options.gpus // (tp * pp)
            for ep in [1] if refusal else ep_degrees(workload, fsdp * tp):
                degrees = Degrees(fsdp=fsdp, tp=tp, pp=pp, ep=ep)
                why = (
                    refusal
                    or (_ep_refusal(workload, degrees) if ep > 1 else None)
                    or _fsdp_refusal(workload, degrees)
                )
                for schedule in options.schedules if pp > 1 else (None,):
                    if why:
                        pruned.append(Pruned(degrees, schedule, why))
                        continue
                    found = _layout(options, counts, degrees, schedule)
                    if isinstance(found, Pruned):
                        pruned.append(found)
                    else:
                        kept += found
    return kept, pruned


def _layout(
    options: PlanOptions, counts: ParamCounts, degrees: Degrees, schedule: str | None
) -> list[Candidate] | Pruned:
    """One fsdp x tp x pp x ep x schedule: its microbatch choices, or why it is dropped (the
    memory bound first: building torch's schedule for large pp takes seconds)."""
    fsdp, pp = degrees.fsdp, degrees.pp
    if options.batch % fsdp:
        reason = f"fsdp {fsdp} does not divide the global batch of {options.batch}"
        return Pruned(degrees, schedule, reason)
    local = options.batch // fsdp
    layout = None
    if schedule is not None:
        total, n_stages = len(counts.layers), pp * stages_per_rank(schedule)
        try:
            split_layers(total, n_stages)
        except WorkbenchError:
            reason = f"{n_stages} stages cannot split {total} layers (+embedding, output)"
            return Pruned(degrees, schedule, reason)
        refused = _pipeline_refusal(options, schedule)
        if refused:
            return Pruned(degrees, schedule, refused)
        layout = Pipeline(pp=pp, schedule=schedule, microbatches=n_stages).layout(total)
    bound = lower_bound_bytes(counts, Candidate(degrees, schedule, 1, local), layout)
    if bound > options.budget_bytes:
        reason = "parameters, optimizer state and gradients exceed the memory"
        return Pruned(degrees, schedule, reason, bound)
    if schedule is None:
        return [Candidate(degrees, None, 1, local)]
    multiples = options.microbatch_multiples
    micro = _microbatch_counts(multiples, schedule, pp, pp * stages_per_rank(schedule), local)
    if not micro:
        reason = (
            f"no multiple ({', '.join(map(str, multiples))}) of the stages divides the local "
            f"batch of {local}"
        )
        return Pruned(degrees, schedule, reason)
    return [Candidate(degrees, schedule, m, local) for m in micro]
