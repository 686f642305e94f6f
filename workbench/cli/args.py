"""The flags every command group shares, read into the library's objects and checked before a
command's slow part (tracing, spawning ranks), so that a bad flag fails in a second with one
line naming it.

Entry points: `workload_from_args`, `degrees_from_args` (the degree flags, read once),
`parallel_from_args`, `kernels_from_args`,
`trace_from_args` (every trace a command makes goes through `trace_workload`),
`prepared_from_args`, `passes_json`, `profiles_from_args`, `cost_options_from_args`,
`solve_options_from_args`, `budget_from_args`, `parallel_flags`; the checks
`check_common_args`, `flag`, `check_positive`, `check_passes`, `check_budget`,
`check_host_budget`, `refuse_graph_flags_without_model`, `refuse_unused_flags` (with its
tables `WITH_PP`, `WITHOUT_PP`); the bounds `MAX_*` and `FSDP_CHOICES`.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from workbench.capture.degrees import DEGREES, Degrees
from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, is_user_factory, load_workload
from workbench.capture.parallel import Parallel
from workbench.capture.trace import timed_trace
from workbench.capture.tracing import Mode
from workbench.decide.policy import Policy
from workbench.errors import INT64_MAX, WorkbenchError, check_int

if TYPE_CHECKING:
    from workbench.cost.estimate import Estimator
    from workbench.search.solve import SolveOptions

__all__ = [
    "FSDP_CHOICES",
    "MAX_FLIPS",
    "MAX_FULL_PATH",
    "MAX_RANDOM",
    "MAX_RUNS",
    "SEED_MAX",
    "budget_from_args",
    "check_budget",
    "check_common_args",
    "check_host_budget",
    "check_passes",
    "check_positive",
    "cost_options_from_args",
    "degree_flags",
    "degrees_from_args",
    "flag",
    "kernels_from_args",
    "parallel_flags",
    "parallel_from_args",
    "passes_json",
    "prepared_from_args",
    "profiles_from_args",
    "refuse_graph_flags_without_model",
    "refuse_unused_flags",
    "shape_from_args",
    "solve_options_from_args",
    "trace_from_args",
    "trace_workload",
    "workload_from_args",
]

# Bounds on counts of work a flag asks for, each far above what a study needs and low enough
# that a typo cannot ask for days of work (the reason is said in the error).
MAX_RUNS = 1000  # --repeat, --warmup: each is a whole train step
MAX_FLIPS = 100_000  # bench whatif --flips: each flip is one what-if
MAX_FULL_PATH = 1000  # each runs torch's remat pass and a full estimate
MAX_RANDOM = 10_000  # verify --random: each policy is a remat and a real run
SEED_MAX = 2**64 - 1  # what torch.manual_seed takes

# --fsdp-choice -> the solver's `fsdp_reshard` (None: a decision the search makes)
FSDP_CHOICES: dict[str, bool | None] = {"search": None, "reshard": True, "keep": False}


# --- the model and its trace -------------------------------------------------------------


def workload_from_args(args: argparse.Namespace, mode: str, device: str = "cpu") -> Workload:
    """Built-in and torchtitan models in fake mode are built on meta: no memory at all."""
    device = "meta" if mode == "fake" and not is_user_factory(args.model) else device
    return load_workload(
        args.model,
        layers=args.layers,
        seq=args.seq,
        batch=args.batch,
        dtype=args.dtype,
        device=device,
    )


def shape_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The shape flags as `load_workload` keywords (for what loads the model again: ranks)."""
    return {"layers": args.layers, "seq": args.seq, "batch": args.batch, "dtype": args.dtype}


def kernels_from_args(args: argparse.Namespace, mode: str) -> str | None:
    """The kernels a `mode` trace carries: `--kernels`, else in fake mode the GPU of the first
    `--profile` (the CPU's for `cpu`), else the default (`workbench.capture.kernels`)."""
    from workbench.capture.kernels import CPU, KERNEL_TARGETS, check_kernels

    kernels = getattr(args, "kernels", None)
    if kernels is not None:
        return check_kernels(kernels) if mode == "fake" else kernels
    profile = str(getattr(args, "profile", None) or "").split(",")[0]
    if mode == "fake" and (profile in KERNEL_TARGETS or profile == CPU):
        return profile
    return None


def degree_flags(args: argparse.Namespace) -> dict[str, int]:
    """The degree flags a command has (`--fsdp`, `--tp`, `--pp`, ...: each `Degrees` field
    that is a flag of its), as given."""
    return {name: getattr(args, name) for name in DEGREES if hasattr(args, name)}


def degrees_from_args(args: argparse.Namespace) -> Degrees:
    """The degree flags read once into the job's `Degrees` (1 for those a command lacks)."""
    return Degrees(**degree_flags(args))


def parallel_from_args(args: argparse.Namespace) -> Parallel | None:
    """The `Degrees` with --ep-imbalance; None unless a degree that shards a rank's graph
    (every one but --pp) asks for more than one rank."""
    degrees = degrees_from_args(args)
    if not degrees.sharded:
        return None
    return Parallel.of(degrees, ep_imbalance=getattr(args, "ep_imbalance", 1.0))


def parallel_flags(args: argparse.Namespace) -> str:
    """The parallel degrees given, as flags (`--cp 2`), for an error naming them.

    >>> parallel_flags(argparse.Namespace(fsdp=1, tp=2, ep=1, cp=2, pp=4))
    '--cp 2 --tp 2'
    """
    given = degree_flags(args)
    return " ".join(f"--{k} {v}" for k, v in given.items() if k != "pp" and v != 1)


# Flags a command path does not use, and why: given with a value other than the parser's
# default on that path, each is refused in one line rather than dropped.
WITHOUT_PP = {
    dest: "it shapes a pipelined job"
    for dest in ("pp_schedule", "microbatches", "stage", "layers_per_stage")
}
_NO_ALLOCATOR = (
    "per-stage estimates sum allocated bytes over the schedule, with no allocator to replay "
    "the interleaved microbatches' blocks"
)
_NO_STREAMS = "per-stage estimates have no stream model"
_OWN_PASSES = (
    "per-stage estimates run the workbench's own passes on each stage graph, split for "
    "zero-bubble schedules into input and weight gradients, which graph trainer's cleanup "
    "does not keep; graph trainer's pass stack is estimated on one whole-step graph: drop "
    "--pp for it"
)
WITH_PP = {
    "passes": _OWN_PASSES,
    "ep_overlap": _OWN_PASSES,
    "calibrate": "per-stage estimates time ops by the profile's roofline",
    "expandable_segments": _NO_ALLOCATOR,
    "max_split_size_mb": _NO_ALLOCATOR,
    "prefetch": _NO_STREAMS,
    "bucket_layers": _NO_STREAMS,
    "sink_waits": _NO_STREAMS,
    "max_copies_in_flight": _NO_STREAMS,
    "timeline": "per-stage estimates have no memory timeline",
    "budget_kind": (
        "per-stage budgets hold allocated bytes: the schedule's simulation sums them, with no "
        "allocator to make reserved bytes of them"
    ),
    "host_budget_bytes": "per-stage policies do not offload",
}


def refuse_unused_flags(args: argparse.Namespace) -> None:
    """A flag given (a value other than its default, `CommandParser`'s `flag_defaults`) on
    a path that does not use it is refused, naming it and why: with or without --pp
    (`WITH_PP`, `WITHOUT_PP`), --ep-imbalance without expert parallelism."""
    defaults: dict[str, Any] = getattr(args, "flag_defaults", {})

    def given(dest: str) -> bool:
        return dest in defaults and getattr(args, dest) != defaults[dest]

    if given("ep_imbalance") and getattr(args, "ep", 1) == 1:
        raise WorkbenchError(
            "--ep-imbalance scales the tokens an expert-parallel rank's experts receive; "
            "without --ep 2 or more it is not used: leave it out"
        )
    if "pp" not in defaults:
        return
    pipelined = args.pp > 1
    for dest, why in (WITH_PP if pipelined else WITHOUT_PP).items():
        if given(dest):
            name = "--" + dest.replace("_", "-")
            where = "with --pp" if pipelined else "without --pp 2 or more"
            raise WorkbenchError(f"{name} is not used {where} ({why}); leave it out")


def check_common_args(args: argparse.Namespace) -> None:
    """Before any command starts its work: the parallel degrees (`Parallel`'s checks) and
    flags the command's path would not use (`refuse_unused_flags`)."""
    if degree_flags(args):
        parallel_from_args(args)
    refuse_unused_flags(args)


def trace_workload(
    workload: Workload, mode: Mode, parallel: Parallel | None = None, kernels: str | None = None
) -> tuple[JointGraph, float]:
    """The one place a command traces a step (`timed_trace`): the graph and its seconds."""
    return timed_trace(workload, mode, parallel, kernels)


def trace_from_args(args: argparse.Namespace) -> tuple[JointGraph, float]:
    """The step the model flags describe, in their `--mode`, one rank under --fsdp/--tp."""
    return trace_workload(
        workload_from_args(args, args.mode),
        args.mode,
        parallel_from_args(args),
        kernels_from_args(args, args.mode),
    )


def prepared_from_args(args: argparse.Namespace) -> tuple[JointGraph, float]:
    """The traced graph as the chosen pass stack analyses it (`rewrite.graph_trainer.prepare`)."""
    from workbench.rewrite.graph_trainer import prepare

    check_passes(args)
    graph, seconds = trace_from_args(args)
    return prepare(graph, args.passes, args.ep_overlap), seconds


def passes_json(
    args: argparse.Namespace,
    graph: JointGraph,
    policy: Policy,
    estimator: Estimator | None = None,
) -> dict[str, Any]:
    """What the chosen pass stack did for `policy`: for graph-trainer each of its passes, run,
    replaced or skipped (and why), and with the `estimator` that estimated it how its
    what-if made the node order (`PassStackEstimator.whatif_note`); `graph` is the prepared
    graph (`prepare`)."""
    if args.passes == "workbench":
        return {"passes": {"pipeline": "workbench"}}  # the key --json has always had
    from workbench.cost.pass_stacks import PassStackEstimator
    from workbench.rewrite.graph_trainer import run_passes

    report = run_passes(graph, policy, ep_overlap=args.ep_overlap).to_json()
    if isinstance(estimator, PassStackEstimator):
        report["whatif"] = estimator.whatif_note()
    return {"passes": report}


# --- what the estimate and the solver are told ----------------------------------------------


def profiles_from_args(args: argparse.Namespace) -> list[str]:
    """`--profile a,b,...`: each a known device profile (the error lists them)."""
    from workbench.cost.profiles import get_profile

    names = [p.strip() for p in args.profile.split(",") if p.strip()]
    if not names:
        raise WorkbenchError(f"--profile {args.profile!r} names no device profile, e.g. h100,cpu")
    for name in names:
        get_profile(name)  # raises with the list of profiles
    return names


def cost_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The allocator, stream and calibration flags as `Estimator` keywords, each checked
    before anything is traced, the error naming the flag."""
    from workbench.cost.allocator import AllocatorConfig
    from workbench.cost.calibrate import load_calibration
    from workbench.cost.overlap import OverlapOptions

    split = args.max_split_size_mb
    if split is not None:
        check_int("--max-split-size-mb", split, 21, 2**20, "above torch's 20 MiB; 1 TiB")
    with flag("--max-split-size-mb"):
        allocator = AllocatorConfig(
            expandable_segments=args.expandable_segments,
            max_split_size=None if split is None else split * 2**20,
        )
    with flag("--prefetch"):
        OverlapOptions(prefetch=args.prefetch)
    with flag("--max-copies-in-flight"):
        OverlapOptions(max_copies_in_flight=args.max_copies_in_flight)
    overlap = OverlapOptions(
        prefetch=args.prefetch,
        bucket_layers=args.bucket_layers,
        sink_waits=args.sink_waits,
        max_copies_in_flight=args.max_copies_in_flight,
    )
    path = getattr(args, "calibrate", None)
    calibration = None if path is None else load_calibration(path)
    return {
        "allocator": allocator,
        "overlap": overlap,
        "calibration": calibration,
        "backward_inputs": getattr(args, "backward_inputs", "freed"),
    }


def solve_options_from_args(args: argparse.Namespace) -> SolveOptions:
    """The solver's flags as `SolveOptions`, each checked before anything is traced by the
    library's own checks (`SolveOptions`, `get_profile`), the error naming the flag:
    --method, --objective, --profile, --host-budget-bytes, --fsdp-choice."""
    from workbench.cost.profiles import get_profile
    from workbench.search.solve import SolveOptions

    check_host_budget(args)
    with flag("--method"):
        SolveOptions(method=args.method)
    with flag("--objective"):
        SolveOptions(objective=args.objective)
    with flag("--profile"):
        get_profile(args.profile)
    return SolveOptions(
        method=args.method,
        objective=args.objective,
        profile=args.profile,
        fsdp_reshard=FSDP_CHOICES[args.fsdp_choice],
        host_budget_bytes=args.host_budget_bytes,
        budget_kind=args.budget_kind,
    )


def budget_from_args(args: argparse.Namespace, estimator: Estimator) -> int:
    """--budget-bytes, or --budget-frac of no AC's peak (of the --budget-kind)."""
    if args.budget_bytes is not None:
        return int(args.budget_bytes)
    peak = estimator.estimate(Policy("none")).budget_bytes(args.budget_kind)
    return max(1, int(args.budget_frac * peak))


# --- checks before the slow part -------------------------------------------------------------


@contextlib.contextmanager
def flag(name: str) -> Iterator[None]:
    """A WorkbenchError raised inside names the flag whose value caused it."""
    try:
        yield
    except WorkbenchError as err:
        raise WorkbenchError(f"{name}: {err}") from None


def check_positive(flag: str, value: int, high: int = MAX_RUNS, why: str = "") -> None:
    check_int(flag, value, 1, high, why or "each one is a timed run")


def check_passes(args: argparse.Namespace) -> None:
    """Before tracing: `--passes` names a pass stack (and graph trainer's is importable)."""
    from workbench.rewrite.graph_trainer import check_pass_stack

    with flag("--passes"):
        check_pass_stack(args.passes)
    if getattr(args, "ep_overlap", False) and args.passes != "graph-trainer":
        raise WorkbenchError(
            f"--ep-overlap runs graph trainer's EP-overlap passes, which --passes "
            f"{args.passes} does not run: add --passes graph-trainer"
        )


def check_host_budget(args: argparse.Namespace) -> None:
    """Before tracing: a bad host budget is refused at once, not after a whole front."""
    check_int("--host-budget-bytes", args.host_budget_bytes, 0, INT64_MAX, "0: no offload; int64")


def check_budget(args: argparse.Namespace) -> None:
    """Before tracing: --budget-bytes or --budget-frac in range."""
    if args.budget_bytes is not None:
        check_int("--budget-bytes", args.budget_bytes, 1, INT64_MAX, "int64")
    elif not 0 < args.budget_frac <= 1:
        raise WorkbenchError(f"--budget-frac must be in (0, 1], got {args.budget_frac}")


def refuse_graph_flags_without_model(args: argparse.Namespace) -> None:
    """`policy explain` without --model: flags that describe a model's graph mean nothing."""
    if args.model is not None:
        return
    given = [f"--{n}" for n in ("layers", "seq", "batch") if getattr(args, n) is not None]
    given += [f"--{n}" for n, v in degree_flags(args).items() if v != 1]
    given += ["--mode"] if args.mode != "real" else []
    given += ["--dtype"] if args.dtype != "float32" else []
    if given:
        raise WorkbenchError(
            f"policy explain: {', '.join(given)} describe a model's graph: give --model "
            "too, or leave them out for the policy's rules alone"
        )
