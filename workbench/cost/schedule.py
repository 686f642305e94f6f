"""Memory and time of a pipeline schedule, from per-stage costs over torch's action order.

Entry point: `simulate(order, costs, p2p_bytes_per_s, p2p_latency_s) -> ScheduleResult`, with
`order` from `workbench.capture.pipeline.action_order` and one `StageCost` per stage (plain
numbers: what one microbatch's F, B, I and W of that stage cost). Plain Python over the action
lists, so a planner can call it for hundreds of configurations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from workbench.capture.pipeline import Action, check_order
from workbench.errors import INT64_MAX, WorkbenchError, check_int

__all__ = [
    "PhaseCost",
    "RankTimeline",
    "ScheduleResult",
    "StageCost",
    "StagePeak",
    "simulate",
]


def _check_number(name: str, value: Any, unit: str = "seconds") -> float:
    """`value` as a float when it is a finite number >= 0, else a one-line error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise WorkbenchError(f"{name} must be a number of {unit} >= 0, got {value!r}")
    if not math.isfinite(value):
        raise WorkbenchError(f"{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class PhaseCost:
    """One microbatch's F, B, I or W on one stage."""

    seconds: float
    """Time on the compute stream, exposed communication included."""
    peak_bytes: int
    """Transient above the rank's bytes at the phase's start."""
    residue_bytes: int
    """What this microbatch still holds after the phase (F: its saved activations; I: what W
    still needs; B and W: 0)."""

    def __post_init__(self) -> None:
        _check_number("phase seconds", self.seconds)
        check_int("phase peak_bytes", self.peak_bytes, 0, INT64_MAX)
        check_int("phase residue_bytes", self.residue_bytes, 0, INT64_MAX)


@dataclass(frozen=True, slots=True)
class StageCost:
    """What one stage costs its rank: held bytes, and each phase per microbatch."""

    stage: int
    resident_bytes: int
    """Held the whole step: parameter shards, optimizer state, unsharded copies."""
    grad_bytes: int
    """Gradient buffers, held from the stage's first backward (B or W) on."""
    phases: dict[str, PhaseCost]
    """"F" and "B", and for zero-bubble schedules "I" and "W" (a B then runs as I, W)."""
    send_bytes: int = 0
    """The stage's output per microbatch (its gradient, sent back, has the same size)."""

    def __post_init__(self) -> None:
        check_int("stage", self.stage, 0, INT64_MAX)
        check_int(f"stage {self.stage} resident_bytes", self.resident_bytes, 0, INT64_MAX)
        check_int(f"stage {self.stage} grad_bytes", self.grad_bytes, 0, INT64_MAX)
        check_int(f"stage {self.stage} send_bytes", self.send_bytes, 0, INT64_MAX)
        kinds = set(self.phases)
        if (
            not kinds <= {"F", "B", "I", "W"}
            or "F" not in kinds
            or not ("B" in kinds or {"I", "W"} <= kinds)
        ):
            raise WorkbenchError(
                f"stage {self.stage} phases are {sorted(kinds)}; give F and B, or F, I and W "
                "(or all four)"
            )
        for kind, phase in self.phases.items():
            if not isinstance(phase, PhaseCost):
                raise WorkbenchError(f"stage {self.stage} phase {kind} is not a PhaseCost")
            if kind in "BW" and phase.residue_bytes:
                raise WorkbenchError(
                    f"stage {self.stage} phase {kind} leaves residue_bytes "
                    f"{phase.residue_bytes:,}; a microbatch holds nothing after its last "
                    "backward (gradients are grad_bytes)"
                )


@dataclass(frozen=True, slots=True)
class StagePeak:
    """A stage at its rank's peak."""

    stage: int
    rank: int
    peak_bytes: int
    """Its rank's peak (stages sharing a rank share it)."""
    inflight_microbatches: int
    """This stage's microbatches whose F ran and whose B (or W) had not, at that peak."""


@dataclass(frozen=True, slots=True)
class RankTimeline:
    """One rank over the step."""

    rank: int
    stages: list[int]
    peak_bytes: int
    peak_action: str
    """The action at whose run the peak falls ("4F3")."""
    inflight_microbatches: int
    """(stage, microbatch) pairs whose F ran and whose B (or W) had not, at the peak."""
    busy_seconds: float
    bubble_seconds: float
    bubble_fraction: float
    timeline: list[tuple[str, float, float, int]] = field(repr=False)
    """(action, start, end, live bytes after it) in run order."""

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**data, "timeline": [list(t) for t in self.timeline]}


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    """Per-rank and per-stage peaks, bubbles and the step's critical path."""

    ranks: list[RankTimeline]
    stages: list[StagePeak]
    step_seconds: float
    """Last action's end: an action starts when its rank is free and its dependency is done."""

    @property
    def peak_bytes(self) -> int:
        """The highest rank peak (the job's per-GPU memory)."""
        return max(r.peak_bytes for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "step_seconds": self.step_seconds,
            "stages": [{f.name: getattr(s, f.name) for f in fields(s)} for s in self.stages],
            "ranks": [r.to_json() for r in self.ranks],
        }


def _phases(action: Action, cost: StageCost) -> list[PhaseCost]:
    """The phases `action` runs: a B on a stage costed as I and W runs I then W."""
    phases = cost.phases
    if action.kind in phases:
        return [phases[action.kind]]
    if action.kind == "B":
        return [phases["I"], phases["W"]]
    raise WorkbenchError(
        f"the schedule runs {action} but stage {action.stage} has only "
        f"{', '.join(sorted(phases))} phases; a zero-bubble schedule needs the backward split "
        "into I and W (graph trainer's split_di_dw)"
    )


@dataclass(slots=True)
class _Memory:
    """One rank's live bytes over its own action order (time plays no part)."""

    live: int
    peak: int
    peak_action: str = ""
    peak_inflight: dict[int, int] = field(default_factory=dict)
    grads_held: set[int] = field(default_factory=set)
    residue: dict[tuple[int, int], int] = field(default_factory=dict)
    inflight: dict[int, int] = field(default_factory=dict)

    def run(self, action: Action, cost: StageCost, phases: list[PhaseCost]) -> int:
        """Live bytes after `action`; records the rank's peak at its run."""
        key = (action.stage, action.microbatch)
        kind = action.kind
        if kind != "F" and kind != "I" and action.stage not in self.grads_held:
            self.grads_held.add(action.stage)
            self.live += cost.grad_bytes
        held = self.residue.pop(key, 0)
        for phase in phases:
            if self.live + phase.peak_bytes > self.peak:
                self.peak = self.live + phase.peak_bytes
                self.peak_action = str(action)
                self.peak_inflight = dict(self.inflight)
            self.live += phase.residue_bytes - held
            held = phase.residue_bytes
        if kind == "F":
            self.inflight[action.stage] = self.inflight.get(action.stage, 0) + 1
        elif kind != "I":
            self.inflight[action.stage] -= 1
        if held:
            self.residue[key] = held
        return self.live


def simulate(
    order: Mapping[int, Sequence[Action]],
    costs: Mapping[int, StageCost],
    p2p_bytes_per_s: float | None = None,
    p2p_latency_s: float = 0.0,
    *,
    checked: bool = False,
) -> ScheduleResult:
    """Each rank's memory over its actions and the step's critical path.

    Memory per rank: live = its stages' resident bytes + grad bytes of its stages whose first
    B or W has started + the residues of its (stage, microbatch) pairs; an action peaks at live
    at its start + its phase's peak_bytes, then the pair's residue becomes the phase's.
    Time: F(s,m) waits for F(s-1,m); B or I(s,m) for B or I(s+1,m) and F(s,m); W(s,m) for
    I(s,m); across ranks plus latency + send_bytes / bandwidth (no bandwidth: latency only).

    Raises `WorkbenchError` for an order `check_order` refuses, a stage without a cost, I or W
    on a stage costed with B only, or an order that deadlocks.
    """
    if not checked:  # `checked`: the caller ran `check_order` on this order already
        check_order(order)
    bandwidth = (
        None
        if p2p_bytes_per_s is None
        else _check_number("p2p bandwidth", p2p_bytes_per_s, "bytes/s")
    )
    if bandwidth is not None and bandwidth <= 0:
        raise WorkbenchError(f"p2p bandwidth must be > 0 bytes/s, got {p2p_bytes_per_s!r}")
    latency = _check_number("p2p latency", p2p_latency_s)
    ranks = sorted(order)
    rank_of = {a.stage: r for r in ranks for a in order[r]}
    missing = sorted(set(rank_of) - set(costs))
    if missing:
        raise WorkbenchError(f"no StageCost for stage {missing[0]} (costs cover {sorted(costs)})")
    wrong = next((s for s in sorted(rank_of) if costs[s].stage != s), None)
    if wrong is not None:
        raise WorkbenchError(f"costs[{wrong}] is the StageCost of stage {costs[wrong].stage}")
    last = max(rank_of)
    # Seconds to move stage s's output to s + 1, or its gradient back from s + 1.
    hop = [
        0.0
        if s == last or rank_of[s] == rank_of[s + 1]
        else latency + (costs[s].send_bytes / bandwidth if bandwidth else 0.0)
        for s in range(last + 1)
    ]
    plans: dict[tuple[int, str], tuple[list[PhaseCost], float]] = {}
    span = 1 + max(a.microbatch for r in ranks for a in order[r])
    resident = {r: sum(costs[s].resident_bytes for s in {a.stage for a in order[r]}) for r in ranks}
    memory = {r: _Memory(resident[r], resident[r]) for r in ranks}
    timelines: dict[int, list[tuple[str, float, float, int]]] = {r: [] for r in ranks}
    # Ends by key: 2 * (stage * span + mb) for F, + 1 for B or I (the input gradient).
    done: dict[int, float] = {}
    waiting: dict[int, list[int]] = {}
    position = dict.fromkeys(ranks, 0)
    free = dict.fromkeys(ranks, 0.0)
    ready = list(ranks)
    while ready:
        rank = ready.pop()
        actions, mem, line = order[rank], memory[rank], timelines[rank]
        at, start = position[rank], free[rank]
        while at < len(actions):
            action = actions[at]
            s, kind = action.stage, action.kind
            base = 2 * (s * span + action.microbatch)
            if kind == "F":
                need, extra = (base - 2 * span, hop[s - 1]) if s > 0 else (-1, 0.0)
            elif kind == "W":
                need, extra = base + 1, 0.0
            else:
                need, extra = (base + 2 * span + 1, hop[s]) if s < last else (-1, 0.0)
            if need >= 0:
                ended = done.get(need)
                if ended is None:
                    waiting.setdefault(need, []).append(rank)
                    break
                start = max(start, ended + extra)
            plan = plans.get((s, kind))
            if plan is None:
                phases = _phases(action, costs[s])
                plan = plans[(s, kind)] = (phases, sum(p.seconds for p in phases))
            end = start + plan[1]
            line.append((str(action), start, end, mem.run(action, costs[s], plan[0])))
            at += 1
            start = end
            if kind != "W":
                produced = base + (kind != "F")
                done[produced] = end
                ready.extend(waiting.pop(produced, ()))
        position[rank], free[rank] = at, start
    stuck = [f"rank {r} at {order[r][position[r]]}" for r in ranks if position[r] < len(order[r])]
    if stuck:
        raise WorkbenchError(f"the action order deadlocks: {', '.join(stuck)} wait forever")
    return _result(ranks, rank_of, memory, timelines)


def _result(
    ranks: list[int],
    rank_of: dict[int, int],
    memory: dict[int, _Memory],
    timelines: dict[int, list[tuple[str, float, float, int]]],
) -> ScheduleResult:
    step = max((t[-1][2] for t in timelines.values() if t), default=0.0)
    rows = []
    for rank in ranks:
        busy = sum(end - start for _, start, end, _ in timelines[rank])
        bubble = max(step - busy, 0.0)
        mem = memory[rank]
        rows.append(
            RankTimeline(
                rank=rank,
                stages=sorted(s for s, r in rank_of.items() if r == rank),
                peak_bytes=mem.peak,
                peak_action=mem.peak_action,
                inflight_microbatches=sum(mem.peak_inflight.values()),
                busy_seconds=busy,
                bubble_seconds=bubble,
                bubble_fraction=bubble / step if step > 0 else 0.0,
                timeline=timelines[rank],
            )
        )
    stages = [
        StagePeak(
            stage=s,
            rank=rank_of[s],
            peak_bytes=memory[rank_of[s]].peak,
            inflight_microbatches=memory[rank_of[s]].peak_inflight.get(s, 0),
        )
        for s in sorted(rank_of)
    ]
    return ScheduleResult(ranks=rows, stages=stages, step_seconds=step)
