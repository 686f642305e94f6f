"""What was measured, beside the estimate: a memory snapshot of a run (its live bytes drawn on
the timeline, its peak in the message) and the eager baselines run as eager runs them.

Entry point: `Measured` (`load_snapshot`, `show_baselines`, `baselines`), one of the concerns
`ExplorerModel` combines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.show.widgets.baselines import baseline_rows, cached_rows
from workbench.show.widgets.core import ExplorerCore
from workbench.show.widgets.policy_state import policy_label
from workbench.units import format_bytes

__all__ = ["Measured"]


class Measured(ExplorerCore):
    """Measurements of this graph shown with the estimate's figures."""

    @property
    def baselines(self) -> list[dict[str, Any]]:
        """The eager baselines' rows, once asked for this graph (`show_baselines`)."""
        return cached_rows(self.graph)

    def show_baselines(self) -> list[dict[str, Any]]:
        """No AC, eager SAC and eager full AC as eager runs them, under torch's memory
        trackers (`workbench.interop.eager_runs`): rows of the side panel beside the estimate,
        run once per graph (the first call takes as long as three eager steps)."""
        rows = baseline_rows(self.graph, self.workload, self.estimator)
        self.message = "eager baselines: " + "; ".join(f"{r['name']} {r['peak']}" for r in rows)
        return rows

    def load_snapshot(self, path: str | Path, device: int | None = None) -> dict[str, Any]:
        """A memory snapshot of a run of the current policy's rematerialized graph (torch's
        `_dump_snapshot` pickle) against its estimate (`compare_snapshot`): the timeline
        draws the measured live bytes beside the estimate's, and the message says the peaks;
        returns the comparison's JSON. The line stays, labelled with its policy, until
        another snapshot is loaded."""
        from workbench.cost.attribution import compare_snapshot
        from workbench.cost.profiles import CUDA_ALLOC_GRANULARITY
        from workbench.cost.snapshot import load_snapshot
        from workbench.rewrite.remat import remat

        snapshot = load_snapshot(path)
        order = self.estimator.order_for(self.decisions, self.policy.offload)
        est = self.estimator.simulate(order, CUDA_ALLOC_GRANULARITY)
        gm = None
        if self.passes == "workbench":
            gm = remat(self.graph, self.decisions, self.policy.offload).gm
        result = compare_snapshot(snapshot, self.estimator, est, gm, device)
        label = f"measured: {Path(path).name} ({policy_label(self.policy_json)})"
        self.measured = (result.measured_timeline, label)
        said = [
            f"{format_bytes(side['allocated_peak_bytes'])} at {side['allocated_peak_node']}"
            for side in (result.measured, result.estimated)
        ]
        self.message = f"{label}: peak {said[0]}, estimated {said[1]}"
        return result.to_json()
