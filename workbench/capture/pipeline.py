"""What a pipeline schedule runs: torch's own schedules, read rather than re-derived.

Entry points: `schedule_class(name)`, `stages_per_rank`, `stage_style`, `rank_stages`,
`action_order(name, pp, microbatches)` (every rank's compute actions in torch's order),
`check_microbatches` and `check_order`. torch's schedules compute the order of every rank in
`__init__` (`schedule.pipeline_order`); they are built here from stand-in stage objects.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal, cast

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from workbench.errors import WorkbenchError, check_int, describe, logger_level

__all__ = [
    "KINDS",
    "MAX_MICROBATCHES",
    "MAX_PP",
    "SCHEDULES",
    "Action",
    "action_order",
    "check_microbatches",
    "check_order",
    "rank_stages",
    "schedule_class",
    "stage_ranks",
    "stage_style",
    "stages_per_rank",
]

Kind = Literal["F", "B", "I", "W"]
KINDS: tuple[Kind, ...] = ("F", "B", "I", "W")  # forward, full backward, input/weight halves
# Bounds on what a user may ask for: torch computes every rank's order in Python.
MAX_PP = 256
MAX_MICROBATCHES = 1024
# Stage-microbatches (pp x microbatches x stages per rank) of one schedule: torch builds its
# order in time growing a little faster than their count, about 20 s at this many on one
# CPU (ZBVZeroBubble); each bound alone would allow minutes.
MAX_STAGE_MICROBATCHES = 2**17

# torch's concrete schedules by the short names `get_schedule_class` takes (its abstract
# PipelineScheduleSingle / PipelineScheduleMulti left out).
SCHEDULES: dict[str, type] = {
    name: torch_schedules.get_schedule_class(name)
    for name in (
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    )
}


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of a schedule: `kind` of microbatch `microbatch` on `stage`.

    >>> str(Action(4, "F", 3)), Action.from_str("2I0")
    ('4F3', Action(stage=2, kind='I', microbatch=0))
    """

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def from_str(text: str) -> Action:
        """Parsed by torch's `_Action.from_str` ("4F3": stage 4, forward, microbatch 3)."""
        try:
            parsed = torch_schedules._Action.from_str(text)
        except (RuntimeError, ValueError) as err:
            raise WorkbenchError(
                f"action {text!r} is not STAGE KIND MICROBATCH like '4F3' ({describe(err)})"
            ) from None
        kind = parsed.computation_type.value
        if kind not in KINDS or parsed.microbatch_index is None:
            raise WorkbenchError(
                f"action {text!r} is not a compute action; kinds are {', '.join(KINDS)}"
            )
        return Action(parsed.stage_index, cast(Kind, kind), parsed.microbatch_index)


def schedule_class(name: str) -> type:
    """torch's schedule class for `name` ("1F1B" or "Schedule1F1B", any case).

    >>> schedule_class("schedule1f1b").__name__
    'Schedule1F1B'
    """
    return SCHEDULES[_short(name)]


def _short(name: str) -> str:
    """The `SCHEDULES` key of a schedule name (the cache key of every order)."""
    if not isinstance(name, str):
        raise WorkbenchError(
            f"pipeline schedule must be a name, one of {', '.join(SCHEDULES)}; got "
            f"{type(name).__name__}"
        )
    short = name.lower().removeprefix("schedule")
    lowered = {key.lower(): key for key in SCHEDULES}
    if short in lowered:
        return lowered[short]
    close = difflib.get_close_matches(short, lowered, n=1, cutoff=0.5)
    hint = f" (did you mean {lowered[close[0]]!r}?)" if close else ""
    raise WorkbenchError(
        f"unknown pipeline schedule {name!r}{hint}; torch's schedules are {', '.join(SCHEDULES)}"
    )


def stages_per_rank(name: str) -> int:
    """1 for torch's single-stage schedules (`PipelineScheduleSingle`), 2 for multi-stage ones
    (torchtitan's default of two virtual stages per rank).

    >>> stages_per_rank("GPipe"), stages_per_rank("Interleaved1F1B")
    (1, 2)
    """
    return 1 if issubclass(schedule_class(name), torch_schedules.PipelineScheduleSingle) else 2


@functools.cache
def _style(short: str) -> Literal["loop", "v"]:
    """How torch places stages on ranks for a multi-stage schedule, read from the stage map
    torch derives from its own order at pp 2 (loop puts stages 0, 2 on rank 0, V puts 0, 3;
    the stand-ins' indices play no part in the order)."""
    built = _build(short, 2, 4, [0, 2])
    mapping = dict(built.stage_index_to_group_rank)
    return "v" if mapping == generate_stage_to_rank_mapping(2, 4, style="v") else "loop"


def stage_style(name: str) -> Literal["loop", "v"]:
    """ "v" when rank r holds stages r and 2pp-1-r (ZBV, DualPipeV), else "loop" (rank r holds
    r, r+pp, ...).

    >>> stage_style("ZBVZeroBubble"), stage_style("Interleaved1F1B"), stage_style("1F1B")
    ('v', 'loop', 'loop')
    """
    short = _short(name)
    return "loop" if stages_per_rank(short) == 1 else _style(short)


def stage_ranks(name: str, pp: int) -> dict[int, int]:
    """The rank of every stage, by torch's `generate_stage_to_rank_mapping`.

    >>> stage_ranks("ZBVZeroBubble", 2)
    {0: 0, 1: 1, 2: 1, 3: 0}
    """
    check_int("pp", pp, 1, MAX_PP)
    stages = pp * stages_per_rank(name)
    return generate_stage_to_rank_mapping(pp, stages, style=stage_style(name))


def rank_stages(name: str, pp: int, rank: int) -> list[int]:
    """The stages rank `rank` of `pp` holds, in increasing order.

    >>> rank_stages("Interleaved1F1B", 4, 1), rank_stages("DualPipeV", 4, 1)
    ([1, 5], [1, 6])
    """
    check_int("pipeline rank", rank, 0, check_int("pp", pp, 1, MAX_PP) - 1, f"pp is {pp}")
    return sorted(s for s, r in stage_ranks(name, pp).items() if r == rank)


def _build(short: str, pp: int, microbatches: int, stages: list[int]) -> Any:
    """torch's schedule built for rank 0 from stand-in stages (torch reads only their indices
    and group; it computes every rank's order in `__init__`)."""
    count = pp * len(stages)
    stand_ins = [
        SimpleNamespace(
            stage_index=s,
            num_stages=count,
            group_size=pp,
            group_rank=0,
            is_first=s == 0,
            is_last=s == count - 1,
            submod=None,
        )
        for s in stages
    ]
    cls = SCHEDULES[short]
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    with logger_level("torch.distributed.pipelining"):
        return cls(
            stand_ins[0] if single else stand_ins,
            n_microbatches=microbatches,
            loss_fn=lambda *args: None,
        )


def _compute_actions(action: Any) -> Iterator[Action]:
    """A torch action as compute actions: OVERLAP_F_B as its sub-actions in order (as torch's
    runtime runs them when no custom function is registered for it); idle steps,
    communication, REDUCE_GRAD and (UN)SHARD dropped."""
    if action is None:
        return
    if action.sub_actions is not None:
        for sub in action.sub_actions:
            yield from _compute_actions(sub)
        return
    kind = action.computation_type.value
    if kind in KINDS:
        yield Action(action.stage_index, kind, action.microbatch_index)


def _forwards_from_one(actions: list[Action], microbatches: int) -> list[Action]:
    """torch 2.13's `Schedule1F1B._get_pipeline_order` numbers the last rank's forwards 1..M
    (it starts the counter at 0 and increments before use when a rank has no warm-up forward),
    while its runtime `_step_microbatches` runs them 0..M-1 in that order: renumbered here,
    only when a stage's forwards are exactly 1..M in order."""
    for stage in {a.stage for a in actions}:
        forwards = [a.microbatch for a in actions if a.stage == stage and a.kind == "F"]
        if forwards == list(range(1, microbatches + 1)):
            actions = [
                Action(a.stage, a.kind, a.microbatch - 1)
                if a.stage == stage and a.kind == "F"
                else a
                for a in actions
            ]
    return actions


@functools.cache
def _order(short: str, pp: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    try:
        built = _build(short, pp, microbatches, rank_stages(short, pp, 0))
    except (ValueError, RuntimeError, AssertionError) as err:
        raise WorkbenchError(
            f"schedule {short} cannot run {microbatches} microbatches on pp {pp}: "
            f"torch says {describe(err).split(': ', 1)[-1]}"
        ) from None
    ranks = []
    for rank in range(pp):
        actions = [a for step in built.pipeline_order[rank] for a in _compute_actions(step)]
        ranks.append(tuple(_forwards_from_one(actions, microbatches)))
    order = {rank: list(actions) for rank, actions in enumerate(ranks)}
    check_order(order, microbatches, f"torch's {short} order (pp {pp})")
    return tuple(ranks)


def action_order(name: str, pp: int, microbatches: int) -> dict[int, list[Action]]:
    """Every rank's compute actions in torch's order (cached per schedule, pp and count).

    >>> " ".join(map(str, action_order("GPipe", 2, 2)[1]))
    '1F0 1F1 1B0 1B1'

    Raises `WorkbenchError` for an unknown schedule, a pp or count out of range, or a count
    torch refuses (its rule quoted).
    """
    short = _short(name)
    check_int("pp", pp, 1, MAX_PP)
    check_int("microbatches", microbatches, 1, MAX_MICROBATCHES)
    work = pp * microbatches * stages_per_rank(short)
    if work > MAX_STAGE_MICROBATCHES:
        raise WorkbenchError(
            f"--pp {pp} x --microbatches {microbatches} x {stages_per_rank(short)} stages per "
            f"rank ({short}) is {work:,} stage-microbatches; torch builds the schedule in time "
            f"growing with them: at most {MAX_STAGE_MICROBATCHES:,} (about 20 s): give fewer "
            "microbatches or ranks"
        )
    return {rank: list(actions) for rank, actions in enumerate(_order(short, pp, microbatches))}


def check_microbatches(name: str, pp: int, microbatches: int) -> None:
    """Raises a one-line `WorkbenchError` when torch's schedule refuses `microbatches` on `pp`
    ranks (1F1B needs at least pp, DualPipeV at least 2 pp, interleaved ones a multiple of
    their rounds), by building it.

    >>> check_microbatches("1F1B", 4, 2)
    Traceback (most recent call last):
    ...
    workbench.errors.WorkbenchError: schedule 1F1B cannot run 2 microbatches on pp 4: torch ...
    """
    action_order(name, pp, microbatches)


def check_order(
    order: Mapping[int, Sequence[Action]], microbatches: int | None = None, what: str = "order"
) -> None:
    """Raises `WorkbenchError` unless each stage lives on one rank, stages are 0..S-1, and each
    (stage, microbatch) runs one F and then either one B or one I followed by one W, for
    microbatches 0..M-1 (M given or read from the order).

    >>> check_order({0: [Action(0, "F", 0), Action(0, "W", 0)]})
    Traceback (most recent call last):
    ...
    workbench.errors.WorkbenchError: order: stage 0 microbatch 0 runs F, W; it must run F then ...
    """
    owner: dict[int, int] = {}
    runs: dict[tuple[int, int], list[str]] = {}
    for rank, actions in order.items():
        for action in actions:
            if not isinstance(action, Action):
                raise WorkbenchError(f"{what}: rank {rank} holds {action!r}, not an Action")
            if owner.setdefault(action.stage, rank) != rank:
                raise WorkbenchError(
                    f"{what}: stage {action.stage} runs on ranks {owner[action.stage]} and "
                    f"{rank}; a stage lives on one rank"
                )
            runs.setdefault((action.stage, action.microbatch), []).append(action.kind)
    stages = sorted(owner)
    if not stages:
        raise WorkbenchError(f"{what} holds no actions")
    if stages != list(range(len(stages))):
        raise WorkbenchError(f"{what}: stages must be 0..{len(stages) - 1}, got {stages}")
    count = microbatches if microbatches is not None else 1 + max(m for _, m in runs)
    wanted = {(s, m) for s in stages for m in range(count)}
    if set(runs) != wanted:
        odd = sorted(set(runs) ^ wanted)[0]
        state = "runs nothing" if odd not in runs else f"is not one of 0..{count - 1}"
        raise WorkbenchError(f"{what}: stage {odd[0]} microbatch {odd[1]} {state}")
    for (stage, mb), kinds in runs.items():
        if kinds not in (["F", "B"], ["F", "I", "W"]):
            raise WorkbenchError(
                f"{what}: stage {stage} microbatch {mb} runs {', '.join(kinds)}; it must run "
                "F then B, or F, I, W"
            )
