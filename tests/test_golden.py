"""Golden figures: every preset's estimate on both reference models and one per-rank graph,
byte for byte as recorded, so a refactor that moves code cannot move a number.

Regenerate (only when a change is meant to move them, and say so in the commit):
`SAC_WRITE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from workbench.capture.graph import JointGraph
from workbench.cost.estimate import Estimator
from workbench.decide.policy import Policy
from workbench.decide.presets import PRESETS

GOLDEN = Path(__file__).with_name("golden_figures.json")
PROFILE = "h100"


def figures(graph: JointGraph) -> dict[str, dict[str, Any]]:
    """Per preset: the estimate's byte figures (allocated and the caching allocator's
    reserved), recompute FLOPs, step time and exposed communication (h100)."""
    estimator = Estimator(graph, (PROFILE,))
    result = {}
    for preset in PRESETS:
        est = estimator.estimate(Policy(preset))
        result[preset] = {
            "peak_bytes": est.peak_bytes,
            "peak_node": est.peak_node,
            "saved_activation_bytes": est.saved_activation_bytes,
            "host_peak_bytes": est.host_peak_bytes,
            "offloaded_bytes": est.offloaded_bytes,
            "recompute_flops": est.recompute_flops,
            "step_seconds": float(f"{est.step_seconds[PROFILE]:.12g}"),
            "reserved_peak_bytes": est.reserved_peak_bytes,
            "exposed_comm_seconds": float(f"{est.exposed_comm_seconds[PROFILE]:.12g}"),
        }
    return result


def test_estimates_are_the_recorded_ones(small_graphs_and_rank: dict[str, JointGraph]) -> None:
    got = {name: figures(graph) for name, graph in sorted(small_graphs_and_rank.items())}
    if os.environ.get("SAC_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {GOLDEN.name}")
    assert got == json.loads(GOLDEN.read_text())
