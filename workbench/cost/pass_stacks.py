"""The what-if under a pass stack: figures of the graph the chosen stack of passes makes.

Entry point: `estimator_for(graph, passes, ...) -> Estimator`. `workbench`: the Estimator of
the traced graph, which replays torch's remat pass and the workbench's offload pass on
indices. `graph-trainer`: a `PassStackEstimator` of graph trainer's cleaned graph, which
replays graph trainer's offload and remat passes on indices (`graph_trainer_replay`), equal
order for order to running them; `reference=True` runs them on every estimate instead,
and `check_replay(policy)` compares the two.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import DEFAULT_PROFILES, Estimator, OptimizerName
from workbench.cost.graph_trainer_replay import Unreplayable, replay_graph_trainer
from workbench.cost.profiles import DeviceProfile
from workbench.decide.decider import Decisions, decide
from workbench.decide.offloadable import OffloadOptions
from workbench.decide.policy import Policy
from workbench.rewrite.entries import Flat
from workbench.rewrite.graph_trainer import prepare, run_passes

__all__ = ["PassStackEstimator", "estimator_for"]

REPLAYED = "replayed on indices"


class PassStackEstimator(Estimator):
    """An Estimator of a cleaned graph (`rewrite.graph_trainer.cleanup`) whose node orders are
    those of graph trainer's pass stack: tagging, its offload pass, its remat pass. They are
    replayed on indices (`replay_graph_trainer`); where the replay cannot say
    (`Unreplayable`), or with `reference=True`, graph trainer's passes run (`run_passes`).
    `fallback` says why the last node order ran them (None: replayed)."""

    passes = "graph-trainer"

    def __init__(
        self,
        graph: JointGraph,
        profiles: Iterable[str | DeviceProfile] = DEFAULT_PROFILES,
        optimizer: OptimizerName = "adamw",
        *,
        reference: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(graph, profiles, optimizer, **options)
        self.reference = reference
        self.fallback: str | None = None

    def order_for(self, decisions: Decisions, options: OffloadOptions | None = None) -> Flat:
        """The node order of the graph graph trainer's passes make of `graph` tagged with
        `decisions` (offloads placed with `options`)."""
        self.fallback = "reference: graph trainer's passes ran" if self.reference else None
        if not self.reference:
            try:
                return replay_graph_trainer(self.index, decisions, options)
            except Unreplayable as why:
                self.fallback = f"graph trainer's passes ran: {why}"
        return self.passes_order(decisions, options)

    def passes_order(self, decisions: Decisions, options: OffloadOptions | None = None) -> Flat:
        """The node order of the graph graph trainer's own passes make (`run_passes`): the
        reference the replay equals."""
        result = run_passes(self.graph, decisions, options or OffloadOptions())
        return self.index.flat(self.order_of(result.gm))

    def whatif_note(self) -> str:
        """How the last node order was made: replayed, or why graph trainer's passes ran."""
        return self.fallback or REPLAYED

    def check_replay(self, policy: Policy | Decisions) -> list[str]:
        """Where the replay and graph trainer's own passes differ for `policy`, in words
        (empty: the same node order, entry for entry and input for input; a policy the replay
        cannot say is listed with why)."""
        decisions = decide(self.graph, policy) if isinstance(policy, Policy) else policy
        options = policy.offload if isinstance(policy, Policy) else OffloadOptions()
        try:
            replayed = replay_graph_trainer(self.index, decisions, options)
        except Unreplayable as why:
            return [f"not replayed: {why}"]
        ran = self.passes_order(decisions, options)
        return _differences(self, replayed, ran)


def _differences(estimator: Estimator, replayed: Flat, ran: Flat) -> list[str]:
    """Where two node orders of one estimator first differ, in its entries' names: in their
    order, else in an entry's inputs."""
    names = estimator._entry_names
    a, b = replayed.entries.tolist(), ran.entries.tolist()
    if a != b:
        k = _first_difference(a, b)
        mine, theirs = (names[x[k]] if k < len(x) else "the end" for x in (a, b))
        return [f"step {k}: replayed {mine}, graph trainer's passes {theirs}"]
    pairs = list(zip(replayed.reader.tolist(), replayed.read.tolist(), strict=True))
    other = list(zip(ran.reader.tolist(), ran.read.tolist(), strict=True))
    if pairs == other:
        return []
    k = _first_difference(pairs, other)
    at = (pairs if k < len(pairs) else other)[k][0]
    return [f"the inputs of step {at} ({names[a[at]]}) differ"]


def _first_difference(a: list[Any], b: list[Any]) -> int:
    """The first index where two different lists differ (one's length if it is the other's
    start)."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def estimator_for(
    graph: JointGraph,
    passes: str = "workbench",
    profiles: Iterable[str | DeviceProfile] = DEFAULT_PROFILES,
    optimizer: OptimizerName = "adamw",
    *,
    reference: bool = False,
    **options: Any,
) -> Estimator:
    """The Estimator of the graph a pass stack analyses (`prepare(graph, passes)`; a
    prepared graph is taken as it is); `options` are Estimator's allocator, overlap and
    calibration settings; `reference` (graph-trainer) runs graph trainer's passes on every
    estimate in place of their replay."""
    prepared = prepare(graph, passes)
    if passes == "workbench":
        return Estimator(prepared, profiles, optimizer, **options)
    return PassStackEstimator(prepared, profiles, optimizer, reference=reference, **options)
