"""The explorer's eager baselines: no AC, eager SAC and eager full AC run as eager runs them
(`workbench.interop.eager_runs`), as rows of the side panel, computed once per graph and only
when asked (a few seconds on a small model; about a minute for a Llama3-8B rank).

Entry points: `baseline_rows(graph, workload, estimator)` (runs them, or returns the rows
already made for `graph`), `cached_rows(graph)` and `baseline_options(graph, estimator)`.
"""

from __future__ import annotations

import weakref
from typing import Any

from workbench.capture.graph import JointGraph
from workbench.capture.parallel import Parallel
from workbench.capture.workload import Workload
from workbench.cost.estimate import Estimator
from workbench.errors import WorkbenchError
from workbench.interop.eager_runs import BaselineOptions, estimate_baselines
from workbench.units import format_bytes

__all__ = ["baseline_options", "baseline_rows", "cached_rows"]

# rows per graph, kept while the graph lives (graphs hash by identity)
_ROWS: weakref.WeakKeyDictionary[JointGraph, list[dict[str, Any]]] = weakref.WeakKeyDictionary()


def baseline_options(graph: JointGraph, estimator: Estimator) -> BaselineOptions:
    """The baselines of the job `graph` is a step of: its mode, sharding and kernels (from
    the graph's config), the estimator's optimizer state and allocator settings."""
    config = graph.config
    parallel = None
    if graph.world_size > 1:
        parallel = Parallel.of(
            graph.degrees,
            param_dtype=config.get("param_dtype", "bfloat16"),
            reduce_dtype=config.get("reduce_dtype", "float32"),
        )
    return BaselineOptions(
        mode=graph.mode,
        parallel=parallel,
        kernels=config.get("kernels") if graph.mode == "fake" else None,
        optimizer=estimator.optimizer,
        allocator=estimator.allocator,
    )


def cached_rows(graph: JointGraph) -> list[dict[str, Any]]:
    """The rows `baseline_rows` made for `graph`; none before it was asked."""
    return _ROWS.get(graph, [])


def baseline_rows(
    graph: JointGraph, workload: Workload | None, estimator: Estimator
) -> list[dict[str, Any]]:
    """One row per baseline: its name, tracker peak and reserved peak (bytes and text), what
    each stream's pools reserved when more than one stream allocated (FSDP2's), and where the
    peak is. Run once per graph; the same rows after that."""
    if graph in _ROWS:
        return _ROWS[graph]
    if workload is None:
        raise WorkbenchError(
            "eager baselines run the model: open the explorer with its workload "
            "(PolicyExplorer(graph, policy, workload=...) or from a Workload)"
        )
    rows = []
    for b in estimate_baselines(workload, baseline_options(graph, estimator)):
        reserved, streams = b.reserved_peak_bytes, b.reserved_by_stream
        rows.append(
            {
                "name": b.name,
                "peak_bytes": b.peak_bytes,
                "peak": format_bytes(b.peak_bytes),
                "reserved": format_bytes(reserved) if reserved is not None else "-",
                "streams": ", ".join(
                    f"{name} {format_bytes(size)}" for name, size in streams.items()
                )
                if len(streams) > 1
                else "",
                "at": f"{b.tracked.peak_module or 'model'} ({b.tracked.peak_phase})",
                "rule": b.rule,
            }
        )
    _ROWS[graph] = rows
    return rows
