"""The explorer's history of tried policies in plain Python: one estimated and at most one
measured point per policy, each restorable, with the Pareto front within each kind.

Entry points: `History` (`add`, `policy(index)`, `to_json(profile)`) and `Point`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.show.viz import pareto_front
from workbench.show.widgets.policy_state import policy_label
from workbench.units import format_bytes, format_seconds

__all__ = ["History", "Point"]


@dataclass
class Point:
    """One tried policy: estimated step time per device profile, or one measured time."""

    policy: dict[str, Any]
    peak_bytes: int
    seconds: dict[str, float]  # profile -> estimated step time; {device: time} when measured
    measured: bool = False
    solver: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    label: str = ""  # what the point is called, where its policy is not one Policy's JSON

    @property
    def name(self) -> str:
        return ("solver: " if self.solver else "") + (self.label or policy_label(self.policy))


class History:
    """Every policy tried, one estimated and at most one measured point per policy.

    Estimated points keep their time on every profile, so switching the profile re-times
    them; measured points are times on a real device and form their own front.
    """

    def __init__(self) -> None:
        self.points: list[Point] = []

    def add(self, point: Point) -> None:
        """Add `point`, replacing an earlier one of the same policy and kind."""
        self.points = [
            p
            for p in self.points
            if not (p.policy == point.policy and p.measured == point.measured)
        ]
        self.points.append(point)

    def point(self, index: int) -> Point:
        if not 0 <= index < len(self.points):
            raise WorkbenchError(f"no history point #{index}; there are {len(self.points)}")
        return self.points[index]

    def policy(self, index: int) -> Policy:
        return Policy.from_json(self.point(index).policy)

    def to_json(self, profile: str, current: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Points for the plot: `step_seconds` on `profile` for estimates (the measured time
        for measured points), `pareto` within each kind and `current` where the point's
        policy is `current`; `peak` and `step` as text."""
        rows = []
        for index, p in enumerate(self.points):
            seconds = next(iter(p.seconds.values())) if p.measured else p.seconds[profile]
            rows.append(
                {
                    "index": index,
                    "name": p.name,
                    "policy": p.policy,
                    "peak_bytes": p.peak_bytes,
                    "step_seconds": seconds,
                    "measured": p.measured,
                    "peak": format_bytes(p.peak_bytes),
                    "step": format_seconds(seconds),
                    "profile": next(iter(p.seconds)) if p.measured else profile,
                    "current": p.policy == current,
                    **({"solver": p.solver} if p.solver else {}),
                    **p.extra,
                }
            )
        on_front: set[int] = set()
        for measured in (False, True):
            kind = [r for r in rows if r["measured"] == measured]
            on_front |= {r["index"] for r in pareto_front(kind)}
        return [{**r, "pareto": r["index"] in on_front} for r in rows]
