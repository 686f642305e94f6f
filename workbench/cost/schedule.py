"""(lead's placeholder until helper sched's module lands: memory over torch's action order)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workbench.capture.pipeline import Action


@dataclass(frozen=True)
class PhaseCost:
    seconds: float
    peak_bytes: int
    residue_bytes: int


@dataclass(frozen=True)
class StageCost:
    stage: int
    resident_bytes: int
    grad_bytes: int
    phases: dict[str, PhaseCost]
    send_bytes: int = 0


@dataclass
class ScheduleResult:
    ranks: list[dict[str, Any]]
    stages: list[dict[str, Any]]
    step_seconds: float
    timelines: dict[int, list[Any]] = field(default_factory=dict)


def simulate(
    order: dict[int, list[Action]],
    costs: dict[int, StageCost],
    p2p_bytes_per_s: float | None = None,
    p2p_latency_s: float = 0.0,
) -> ScheduleResult:
    ranks, stages = [], []
    for rank, actions in order.items():
        mine = sorted({a.stage for a in actions})
        live = sum(costs[s].resident_bytes for s in mine)
        residue: dict[tuple[int, int], int] = {}
        grads: set[int] = set()
        peak, at, inflight = 0, "", 0
        busy = 0.0
        for a in actions:
            c = costs[a.stage]
            phase = c.phases[a.kind]
            start = live + sum(residue.values()) + sum(costs[s].grad_bytes for s in grads)
            if start + phase.peak_bytes > peak:
                peak, at = start + phase.peak_bytes, f"{a.stage}{a.kind}{a.microbatch}"
                inflight = len(residue)
            residue[(a.stage, a.microbatch)] = phase.residue_bytes
            if not phase.residue_bytes:
                del residue[(a.stage, a.microbatch)]
            if a.kind in ("B", "W"):
                grads.add(a.stage)
            busy += phase.seconds
        ranks.append(
            {
                "rank": rank,
                "stages": mine,
                "peak_bytes": peak,
                "peak_action": at,
                "inflight_microbatches": inflight,
                "busy_seconds": busy,
            }
        )
        stages += [
            {"stage": s, "rank": rank, "peak_bytes": peak, "inflight_microbatches": inflight}
            for s in mine
        ]
    stages.sort(key=lambda r: r["stage"])
    return ScheduleResult(ranks, stages, max(float(r["busy_seconds"]) for r in ranks))  # type: ignore[arg-type]
