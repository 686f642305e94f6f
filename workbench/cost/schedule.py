"""Memory and time of a pipeline schedule, from per-stage costs over torch's action order.

Entry point: `simulate(order, costs, p2p_bytes_per_s, p2p_latency_s) -> ScheduleResult`, with
`order` from `workbench.capture.pipeline.action_order` and one `StageCost` per stage (plain
numbers: what one microbatch's F, B, I and W of that stage cost). What does not depend on the
costs (which action waits for which, in-flight counts) is walked once (`ScheduleWalk.of`);
a simulation is then one pass over the actions for time and array sums for memory, so a
planner can call it for thousands of configurations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from workbench.capture.pipeline import Action, check_order
from workbench.errors import INT64_MAX, WorkbenchError, check_int

__all__ = [
    "PhaseCost",
    "RankTimeline",
    "ScheduleResult",
    "ScheduleWalk",
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
    actions: list[str] = field(repr=False)
    starts: list[float] = field(repr=False)
    ends: list[float] = field(repr=False)
    lives: list[int] = field(repr=False)
    """Live bytes after each action."""

    @property
    def timeline(self) -> list[tuple[str, float, float, int]]:
        """(action, start, end, live bytes after it) in run order (built when asked: a
        planner simulates hundreds of steps and reads none)."""
        return list(zip(self.actions, self.starts, self.ends, self.lives, strict=True))

    def to_json(self) -> dict[str, Any]:
        names = (
            "rank",
            "stages",
            "peak_bytes",
            "peak_action",
            "inflight_microbatches",
            "busy_seconds",
            "bubble_seconds",
            "bubble_fraction",
        )
        data = {name: getattr(self, name) for name in names}
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


_KINDS = {"F": 0, "B": 1, "I": 2, "W": 3}
_NO_PHASE = -(2**62)  # the second phase of an action that runs one: never the peak


@dataclass(frozen=True)
class ScheduleWalk:
    """What simulating `order` does whatever the costs: the order in which actions resolve
    across ranks (an action waits for the one it needs), and per rank its actions' stages,
    kinds, labels, the in-flight microbatches of each of its stages before each action and
    the action at which each stage first holds its gradients. A pipeline builds it once and
    simulates it for every policy its search tries.

    Built by `ScheduleWalk.of(order)`; raises `WorkbenchError` for an order that deadlocks.
    """

    ranks: list[int]
    rank_of: dict[int, int]
    steps: list[tuple[int, int, int, int, int, int]]
    """(rank, stage, kind, key needed or -1, hop index, key produced or -1) in resolve order."""
    keys: int
    first: dict[tuple[int, str], Action]
    """Each (stage, kind)'s first action in resolve order (errors name it)."""
    labels: dict[int, list[str]]
    stages: dict[int, np.ndarray]
    kinds: dict[int, np.ndarray]
    grads_from: dict[int, np.ndarray]
    """Per rank and action: its stage's gradients are first held from this action on."""
    inflight: dict[int, np.ndarray]
    """Per rank: (actions, stages of the rank) counts of in-flight microbatches before each."""
    columns: dict[int, list[int]]
    """Per rank: the stage of each `inflight` column."""

    @classmethod
    def of(cls, order: Mapping[int, Sequence[Action]]) -> ScheduleWalk:
        ranks = sorted(order)
        rank_of = {a.stage: r for r in ranks for a in order[r]}
        last = max(rank_of)
        span = 1 + max(a.microbatch for r in ranks for a in order[r])
        # Keys: 2 * (stage * span + mb) for F, + 1 for B or I (the input gradient).
        done: set[int] = set()
        waiting: dict[int, list[int]] = {}
        position = dict.fromkeys(ranks, 0)
        steps: list[tuple[int, int, int, int, int, int]] = []
        first: dict[tuple[int, str], Action] = {}
        ready = list(ranks)
        while ready:
            rank = ready.pop()
            actions, at = order[rank], position[rank]
            while at < len(actions):
                action = actions[at]
                s, kind = action.stage, action.kind
                base = 2 * (s * span + action.microbatch)
                if kind == "F":
                    need, hop = (base - 2 * span, s - 1) if s > 0 else (-1, last + 1)
                elif kind == "W":
                    need, hop = base + 1, last + 1
                else:
                    need, hop = (base + 2 * span + 1, s) if s < last else (-1, last + 1)
                if need >= 0 and need not in done:
                    waiting.setdefault(need, []).append(rank)
                    break
                produced = -1 if kind == "W" else base + (kind != "F")
                steps.append((rank, s, _KINDS[kind], need, hop, produced))
                first.setdefault((s, kind), action)
                at += 1
                if produced >= 0:
                    done.add(produced)
                    ready.extend(waiting.pop(produced, ()))
            position[rank] = at
        stuck = [
            f"rank {r} at {order[r][position[r]]}" for r in ranks if position[r] < len(order[r])
        ]
        if stuck:
            raise WorkbenchError(f"the action order deadlocks: {', '.join(stuck)} wait forever")
        per_rank = {rank: _rank_facts(order[rank]) for rank in ranks}
        return cls(
            ranks=ranks,
            rank_of=rank_of,
            steps=steps,
            keys=2 * (last + 1) * span + 2,
            first=first,
            labels={r: f[0] for r, f in per_rank.items()},
            stages={r: f[1] for r, f in per_rank.items()},
            kinds={r: f[2] for r, f in per_rank.items()},
            grads_from={r: f[3] for r, f in per_rank.items()},
            inflight={r: f[4] for r, f in per_rank.items()},
            columns={r: f[5] for r, f in per_rank.items()},
        )


def _rank_facts(
    actions: Sequence[Action],
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """One rank's labels, stages, kinds, gradient starts, in-flight counts and columns
    (`ScheduleWalk`'s fields)."""
    columns = sorted({a.stage for a in actions})
    column = {s: c for c, s in enumerate(columns)}
    counts = np.zeros((len(actions) + 1, len(columns)), dtype=np.int64)
    grads_from = np.zeros(len(actions), dtype=bool)
    holding: set[int] = set()
    for k, action in enumerate(actions):
        counts[k + 1] = counts[k]
        if action.kind == "F":
            counts[k + 1, column[action.stage]] += 1
        elif action.kind != "I":
            counts[k + 1, column[action.stage]] -= 1
        if action.kind not in "FI" and action.stage not in holding:
            holding.add(action.stage)
            grads_from[k] = True
    return (
        [str(a) for a in actions],
        np.array([a.stage for a in actions], dtype=np.int64),
        np.array([_KINDS[a.kind] for a in actions], dtype=np.int64),
        grads_from,
        counts[:-1],
        columns,
    )


def _phase_table(
    walk: ScheduleWalk, costs: Mapping[int, StageCost]
) -> tuple[list[list[float]], np.ndarray]:
    """Per stage and kind: the action's seconds, and (first phase's peak, its change of the
    pair's held bytes, second phase's peak, its change): a B on a stage costed as I and W
    runs I then W; an action of one phase has no second."""
    n = max(walk.rank_of) + 1
    seconds = [[0.0] * 4 for _ in range(n)]
    table = np.zeros((n, 4, 4), dtype=np.int64)
    table[:, :, 2] = _NO_PHASE
    for (s, kind), action in walk.first.items():
        phases = costs[s].phases
        if kind in phases:
            runs = [phases[kind]]
        elif kind == "B":
            runs = [phases["I"], phases["W"]]
        else:
            raise WorkbenchError(
                f"the schedule runs {action} but stage {action.stage} has only "
                f"{', '.join(sorted(phases))} phases; a zero-bubble schedule needs the backward "
                "split into I and W (graph trainer's split_di_dw)"
            )
        # what the pair holds before it: F's residue before B or I, I's before W
        held = {"F": 0, "W": phases["I"].residue_bytes if "I" in phases else 0}.get(
            kind, phases["F"].residue_bytes
        )
        k = _KINDS[kind]
        seconds[s][k] = sum(p.seconds for p in runs)
        for p, phase in enumerate(runs):
            table[s, k, 2 * p] = phase.peak_bytes
            table[s, k, 2 * p + 1] = phase.residue_bytes - held
            held = phase.residue_bytes
    return seconds, table


def simulate(  # noqa: PLR0915
    order: Mapping[int, Sequence[Action]] | ScheduleWalk,
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
    `order` may be its `ScheduleWalk`, built once for many simulations.

    Raises `WorkbenchError` for an order `check_order` refuses, a stage without a cost, I or W
    on a stage costed with B only, or an order that deadlocks.
    """
    if isinstance(order, ScheduleWalk):
        walk = order
    else:
        if not checked:  # `checked`: the caller ran `check_order` on this order already
            check_order(order)
        walk = ScheduleWalk.of(order)
    bandwidth = (
        None
        if p2p_bytes_per_s is None
        else _check_number("p2p bandwidth", p2p_bytes_per_s, "bytes/s")
    )
    if bandwidth is not None and bandwidth <= 0:
        raise WorkbenchError(f"p2p bandwidth must be > 0 bytes/s, got {p2p_bytes_per_s!r}")
    latency = _check_number("p2p latency", p2p_latency_s)
    rank_of = walk.rank_of
    missing = sorted(set(rank_of) - set(costs))
    if missing:
        raise WorkbenchError(f"no StageCost for stage {missing[0]} (costs cover {sorted(costs)})")
    wrong = next((s for s in sorted(rank_of) if costs[s].stage != s), None)
    if wrong is not None:
        raise WorkbenchError(f"costs[{wrong}] is the StageCost of stage {costs[wrong].stage}")
    last = max(rank_of)
    # Seconds to move stage s's output to s + 1, or its gradient back from s + 1 (the last
    # entry: no hop).
    hop = [
        0.0
        if s == last or rank_of[s] == rank_of[s + 1]
        else latency + (costs[s].send_bytes / bandwidth if bandwidth else 0.0)
        for s in range(last + 1)
    ] + [0.0]
    seconds, table = _phase_table(walk, costs)
    done = [0.0] * walk.keys
    free = dict.fromkeys(walk.ranks, 0.0)
    starts: dict[int, list[float]] = {r: [] for r in walk.ranks}
    ends: dict[int, list[float]] = {r: [] for r in walk.ranks}
    for rank, s, kind, need, h, produced in walk.steps:
        start = free[rank]
        if need >= 0:
            ready = done[need] + hop[h]
            if ready > start:
                start = ready
        end = start + seconds[s][kind]
        starts[rank].append(start)
        ends[rank].append(end)
        free[rank] = end
        if produced >= 0:
            done[produced] = end
    step = max((e[-1] for e in ends.values() if e), default=0.0)
    rows, stage_rows = [], {}
    grads = np.array([costs[s].grad_bytes for s in range(last + 1)], dtype=np.int64)
    for rank in walk.ranks:
        stages, kinds = walk.stages[rank], walk.kinds[rank]
        resident = sum(costs[s].resident_bytes for s in walk.columns[rank])
        phase = table[stages, kinds]  # (actions, 4)
        change = phase[:, 1] + np.where(phase[:, 2] == _NO_PHASE, 0, phase[:, 3])
        after = resident + np.cumsum(np.where(walk.grads_from[rank], grads[stages], 0) + change)
        before = after - change
        tops = np.maximum(before + phase[:, 0], before + phase[:, 1] + phase[:, 2])
        k = int(np.argmax(tops)) if len(tops) else 0
        peak, label, inflight = resident, "", np.zeros(len(walk.columns[rank]), dtype=np.int64)
        if len(tops) and tops[k] > resident:
            peak, label, inflight = int(tops[k]), walk.labels[rank][k], walk.inflight[rank][k]
        busy = sum(e - b for b, e in zip(starts[rank], ends[rank], strict=True))
        bubble = max(step - busy, 0.0)
        rows.append(
            RankTimeline(
                rank=rank,
                stages=walk.columns[rank],
                peak_bytes=peak,
                peak_action=label,
                inflight_microbatches=int(inflight.sum()),
                busy_seconds=busy,
                bubble_seconds=bubble,
                bubble_fraction=bubble / step if step > 0 else 0.0,
                actions=walk.labels[rank],
                starts=starts[rank],
                ends=ends[rank],
                lives=after.tolist(),
            )
        )
        for column, s in enumerate(walk.columns[rank]):
            stage_rows[s] = StagePeak(s, rank, peak, int(inflight[column]))
    stages_list = [stage_rows[s] for s in sorted(stage_rows)]
    return ScheduleResult(ranks=rows, stages=stages_list, step_seconds=step)
