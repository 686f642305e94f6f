"""`trace`, `estimate`, `solve`, `bench trace` and `bench click` of a pipelined job (`--pp`):
one graph per stage, figures per stage over torch's schedule.

Entry points: `pipelined(cmd, cmd_stages)`, which runs `cmd_stages` when `--pp` is given (the
one-graph command otherwise); the `cmd_*_stages` commands; `stage_policies` (`--policy` for
a pipeline).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.capture.stages import Pipeline, StageLayout, n_layers, trace_stages
from workbench.cli.args import (
    check_budget,
    check_positive,
    degrees_from_args,
    kernels_from_args,
    parallel_from_args,
    profiles_from_args,
    solve_options_from_args,
)
from workbench.cli.report import Command, Report, Result
from workbench.cost.calibrate import time_basis
from workbench.cost.profiles import get_profile
from workbench.decide.policy import Policy, parse_policy, read_policy_json
from workbench.errors import WorkbenchError

__all__ = [
    "cmd_bench_click_stages",
    "cmd_bench_trace_stages",
    "cmd_estimate_stages",
    "cmd_solve_stages",
    "cmd_trace_stages",
    "pipelined",
    "stage_policies",
]


def pipelined(cmd: Command, cmd_stages: Command) -> Command:
    def run(args: argparse.Namespace) -> Result:
        return cmd(args) if degrees_from_args(args).pp == 1 else cmd_stages(args)

    run.__doc__ = cmd.__doc__
    return run


def _pipeline(args: argparse.Namespace) -> Pipeline:
    return Pipeline(
        pp=degrees_from_args(args).pp,
        schedule=args.pp_schedule,
        microbatches=args.microbatches,
        layers_per_stage=args.layers_per_stage,
    )


def _stages_from_args(
    args: argparse.Namespace,
    before: Callable[[StageLayout], None] | None = None,
    every_stage: bool = False,
) -> tuple[list[JointGraph], StageLayout, float]:
    """The stage graphs (one with --stage, unless `every_stage`); without --batch one
    sequence per microbatch. `before` sees the layout before anything is traced (to check
    what depends on it)."""
    from workbench.capture.models import is_user_factory, load_workload

    pipeline = _pipeline(args)
    parallel = parallel_from_args(args)
    device = "meta" if args.mode == "fake" and not is_user_factory(args.model) else "cpu"

    def load(batch: int | None) -> Any:
        return load_workload(
            args.model,
            layers=args.layers,
            seq=args.seq,
            batch=batch,
            dtype=args.dtype,
            device=device,
        )

    layers = n_layers(load(1 if args.batch is None else args.batch))
    layout = pipeline.layout(layers)
    if args.stage is not None:
        layout.check_stage(args.stage)
    if before is not None:
        before(layout)
    workload = load(layout.microbatches if args.batch is None else args.batch)
    start = time.perf_counter()
    stages = None if args.stage is None or every_stage else [args.stage]
    kernels = kernels_from_args(args, args.mode)
    graphs = trace_stages(workload, args.mode, parallel, pipeline, stages, kernels=kernels)
    return graphs, layout, time.perf_counter() - start


def cmd_trace_stages(args: argparse.Namespace) -> Report:
    graphs, layout, seconds = _stages_from_args(args)
    return Report(
        {
            "pipeline": layout.to_json(),
            "stages": [g.summary() for g in graphs],
            "seconds": round(seconds, 3),
        }
    )


def cmd_bench_trace_stages(args: argparse.Namespace) -> Report:
    from workbench.cli.benchmarks import bench_trace

    check_positive("--repeat", args.repeat)
    shapes: dict[str, Any] = {}

    def run() -> tuple[Any, float]:
        graphs, layout, seconds = _stages_from_args(args)
        collectives: Counter[str] = Counter()
        for graph in graphs:
            collectives.update(graph.summary()["collectives"])
        shapes.update(
            stages=len(graphs),
            nodes=sum(len(g.nodes) for g in graphs),
            collectives=dict(collectives),
            stamped=sum(int(g.config.get("stamped", 0)) for g in graphs),
            pipeline=layout.to_json(),
        )
        return graphs[0], seconds

    result = bench_trace(run, args.repeat)
    return Report({**result, **shapes})


def cmd_bench_click_stages(args: argparse.Namespace) -> Report:
    """Random clicks through the per-stage explorer of a pipelined job, on stage --stage
    (default 0) with every stage traced (`workbench.cli.benchmarks.bench_click`)."""
    from workbench.cli.bench import check_click_args, scratch_autosaves
    from workbench.cli.benchmarks import bench_click
    from workbench.show.widgets.explorer import PolicyExplorer

    check_click_args(args)
    graphs, layout, seconds = _stages_from_args(args, every_stage=True)
    stage = 0 if args.stage is None else args.stage
    with scratch_autosaves():
        policies = stage_policies(args.policy, layout.n_stages)
        explorer = PolicyExplorer.pipeline(graphs, layout, policies, stage=stage)
        result = bench_click(explorer, args.flips, args.seed)
    return Report({**result, "pipeline": layout.to_json(), "trace_seconds": round(seconds, 3)})


def stage_policies(spec: str, stages: int) -> list[Policy]:
    """`--policy` for a pipeline: a preset or policy file for every stage, or a JSON file
    {"stages": [policy, ...]} (one per stage) or {"stages": {"3": policy, "default": policy}}."""
    if not spec.endswith(".json"):
        return [parse_policy(spec)] * stages
    data = read_policy_json(spec)
    if not isinstance(data, dict) or "stages" not in data:
        return [Policy.from_json(data, spec)] * stages
    given = data["stages"]
    if isinstance(given, list):
        if len(given) != stages:
            raise WorkbenchError(
                f"{spec} holds {len(given)} stage policies; this pipeline has {stages} stages"
            )
        return [Policy.from_json(p, f"{spec} stage {i}") for i, p in enumerate(given)]
    if not isinstance(given, dict):
        raise WorkbenchError(f"{spec}: 'stages' must be a list or an object keyed by stage")
    unknown = [k for k in given if k != "default" and k not in {str(s) for s in range(stages)}]
    if unknown:
        raise WorkbenchError(
            f"{spec} names stage {unknown[0]!r}; stages are 0-{stages - 1} (or 'default')"
        )
    default = Policy.from_json(given["default"], spec) if "default" in given else Policy()
    return [
        Policy.from_json(given[str(s)], f"{spec} stage {s}") if str(s) in given else default
        for s in range(stages)
    ]


def _model(
    args: argparse.Namespace, profile: str, before: Callable[[StageLayout], None] | None = None
) -> tuple[Any, list[JointGraph], float]:
    from workbench.cost.stages import PipelineModel

    if args.stage is not None:
        raise WorkbenchError("--stage picks one stage's graph for trace; estimate all stages")
    graphs, layout, seconds = _stages_from_args(args, before)
    return PipelineModel(graphs, layout, profile, args.optimizer), graphs, seconds


def _one_profile(args: argparse.Namespace) -> str:
    """`estimate --pp`'s profile: the schedule is simulated on one device's figures, so a
    --profile naming several is refused (the default list's first is taken)."""
    names = profiles_from_args(args)
    given = args.profile != getattr(args, "flag_defaults", {}).get("profile")
    if given and len(names) > 1:
        raise WorkbenchError(
            f"--profile {args.profile} names {len(names)} profiles; --pp estimates one profile "
            "(the schedule is simulated on one device's figures): give one, or run once per "
            "profile"
        )
    return names[0]


def cmd_estimate_stages(args: argparse.Namespace) -> Report:
    """Per stage: the peak of its rank over the schedule and the microbatches in flight
    then; the top-level peak is the largest."""
    if args.snapshot is not None:
        raise WorkbenchError("--snapshot writes one graph's estimate: drop --pp")
    if args.backward_inputs == "held":
        raise WorkbenchError(
            "--backward-inputs held models one graph's backward, not a pipeline schedule's "
            "stages: drop --pp (or --backward-inputs)"
        )
    profile = _one_profile(args)
    policies: list[Policy] = []  # read before the trace, once the stages are known

    def read_policies(layout: StageLayout) -> None:
        policies.extend(stage_policies(args.policy, layout.n_stages))

    model, graphs, seconds = _model(args, profile, read_policies)
    est = model.estimate(policies)
    return Report(
        {
            "model": graphs[0].model_name,
            "trace_seconds": round(seconds, 3),
            **est.to_json(),
            "time_basis": time_basis([get_profile(profile)]),
        }
    )


def cmd_solve_stages(args: argparse.Namespace) -> Report:
    """One policy per stage under the per-GPU budget, beside the best single policy."""
    from workbench.search.stages import solve_stages, stage_ladders

    options = solve_options_from_args(args)
    check_budget(args)
    model, graphs, seconds = _model(args, args.profile)
    ladders = stage_ladders(model, options=options)
    if args.budget_bytes is not None:
        budget = args.budget_bytes
    else:
        top = model.estimate([ladder[0] for ladder in ladders]).peak_bytes
        budget = max(1, int(top * args.budget_frac))
    plan = solve_stages(model, budget, ladders=ladders)
    one = solve_stages(model, budget, per_stage=False, ladders=ladders)
    return Report(
        {
            "model": graphs[0].model_name,
            "trace_seconds": round(seconds, 3),
            **plan.to_json(),
            "time_basis": time_basis([get_profile(args.profile)]),
            "one_policy": {
                "feasible": one.feasible,
                "peak_bytes": one.estimate.peak_bytes,
                "est_step_seconds": one.estimate.schedule.step_seconds,
                "est_tokens_per_second_per_gpu": one.estimate.tokens_per_second_per_gpu,
                "policy": one.policies[0].to_json(),
            },
        }
    )
