"""The explorer's long actions: Suggest (the solver's cheapest policy for a budget), Sweep (its
memory-vs-time front into the history) and Run (torch's pass, measured for real); while one
runs, `running` and `status` say so and reach the front end at once (`on_change`).

Entry point: `Solving` (`set_host_budget`, `suggest`, `sweep`, `run`), one of the concerns
`ExplorerModel` combines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from workbench.errors import INT64_MAX, WorkbenchError, check_int
from workbench.show.widgets.core import ExplorerCore
from workbench.show.widgets.history import Point
from workbench.show.widgets.panels import run_status
from workbench.show.widgets.suggest import suggestion
from workbench.units import format_bytes

__all__ = ["Solving"]


class Solving(ExplorerCore):
    """The solver's and the device's answers: a suggested policy is a change like any other
    (undoable), the front and measured runs are points of the history."""

    def set_host_budget(self, budget_bytes: int) -> None:
        """The host bytes Suggest and Sweep may offload to (0: they do not offload)."""
        check_int("host budget", budget_bytes, 0, INT64_MAX, "bytes; 0: no offload")
        self.suggest_host_budget_bytes = budget_bytes
        self.message = (
            f"Suggest and Sweep may offload up to {format_bytes(budget_bytes)} to host memory"
            if budget_bytes
            else "Suggest and Sweep do not offload (host budget 0)"
        )

    def suggest(self, budget_bytes: int, method: str | None = None) -> None:
        """Load the solver's cheapest policy whose estimated peak fits `budget_bytes`
        (undoable, like any other change)."""
        budget = format_bytes(budget_bytes) if isinstance(budget_bytes, int) else budget_bytes
        with self.busy(f"Suggest: solving for a budget of {budget}…"):
            policy, message = suggestion(
                self.graph,
                self.policy,
                budget_bytes,
                method=method or self.suggest_method,
                profile=self.profile,
                estimator=self.estimator,
                has_fsdp=self.has_fsdp,
                host_budget_bytes=self.suggest_host_budget_bytes,
                budget_kind=self.budget_kind,
            )
        self._change(policy)
        self.message = message
        self._autosave()

    def sweep(self, points: int = 8) -> None:
        """Put the solver's memory-vs-time front into the history (each point restorable)."""
        from workbench.search.pareto import pareto
        from workbench.search.solve import SolveOptions

        def progress(done: int, total: int, _solution: object) -> None:
            self.status = f"solving budget {done} of {total}…"
            self.on_change()

        options = SolveOptions(
            method=self.suggest_method,  # type: ignore[arg-type]
            profile=self.profile,
            host_budget_bytes=self.suggest_host_budget_bytes,
            budget_kind=self.budget_kind,
        )
        with self.busy(f"Sweep: solving {points} budgets…"):
            solutions = pareto(
                self.graph,
                points=points,
                options=options,
                progress=progress,
                estimator=self.estimator,
            )
        for solution in solutions:
            est = solution.estimate
            point = Point(
                solution.policy.to_json(),
                est.peak_bytes,
                dict(est.step_seconds),
                solver=solution.method,
            )
            self.history_log.add(point)
        self.status = f"{len(solutions)} solver points added to the history"

    def run(self, repeats: int = 3) -> dict[str, Any]:
        """Remat with torch's pass and measure on the graph's device (GPU when the graph was
        traced on one, else CPU), with the bitwise check against eager."""
        from workbench.interop.baselines import measure_policy

        if self.run_refusal:
            raise WorkbenchError(self.run_refusal)
        assert self.workload is not None  # `run_refusal` says why not otherwise
        try:
            with self.busy("Run: rematerializing with torch's pass and measuring…"):
                result = measure_policy(
                    self.workload,
                    self.policy,
                    graph=self.graph,
                    estimator=self.estimator,
                    repeats=repeats,
                )
        except BaseException:
            self.status = "Run failed: see the message line"
            raise
        summary = {
            **result.to_json(),
            "policy": self.policy.to_json(),
            "optimizer": self.estimator.optimizer,
            "optimizer_bytes": self.estimator.optimizer_bytes,
        }
        self.run_result = summary
        self.status = run_status(summary, self.policy)
        measured = Point(
            self.policy.to_json(),
            result.graph_sac.peak_bytes,
            {summary["device"]: result.graph_sac.step_seconds},
            measured=True,
            extra={"device": summary["device"]},
        )
        self.history_log.add(measured)
        return summary

    @contextlib.contextmanager
    def busy(self, words: str) -> Iterator[None]:
        """A long action (Run, Suggest, Sweep): `running` and `status` say so, and reach the
        front end at once (`on_change`), until it ends, also when it fails; then the status
        line is the last Run's again (an action may say more)."""
        self.running, self.status = True, words
        self.on_change()
        try:
            yield
        finally:
            self.running = False
            self.status = run_status(self.run_result, self.policy)
