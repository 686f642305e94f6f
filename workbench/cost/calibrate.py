"""Measured op times in place of the roofline's: from a torch.profiler trace or a table.

Entry points: `calibration_table(prof)` turns a finished `torch.profiler.profile` into a
table with torch's own `key_averages(group_by_input_shape=True)`; `load_calibration(path)`
reads such a table (JSON) or a Chrome trace (`prof.export_chrome_trace`); and
`Calibration.node_seconds(graph)` gives the measured seconds of each graph node whose op
and input shapes match, with the coverage. `time_basis` and `measured_basis` say in words
what a step time or tokens/s figure rests on, beside every such figure.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from workbench.capture.graph import JointGraph
from workbench.cost.profiles import DeviceProfile
from workbench.errors import WorkbenchError
from workbench.files import read_file

__all__ = [
    "Calibration",
    "OpKey",
    "calibration_table",
    "load_calibration",
    "measured_basis",
    "node_key",
    "time_basis",
]

OpKey = tuple[str, tuple[tuple[int, ...], ...]]


def _shapes(dims: Any) -> tuple[tuple[int, ...], ...]:
    """The tensor shapes of a profiler's `Input Dims`: non-empty lists of ints (scalars,
    zero-dim tensors and tensor lists are left out, as `node_key` leaves them out).

    >>> _shapes([[64, 32], [], [32, 16], [[1, 2]]])
    ((64, 32), (32, 16))
    """
    return tuple(
        tuple(int(x) for x in d)
        for d in dims or []
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d)
    )


def node_key(node: fx.Node) -> OpKey | None:
    """The profiler's name for an ATen op node (`aten::mm`) and its tensor inputs' shapes."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    shapes = []
    for arg in node.args:
        value = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            shapes.append(tuple(int(s) for s in value.shape))
    return schema.name, tuple(shapes)


@dataclass
class Calibration:
    """Measured seconds per (op, input shapes), each the median of its measurements, and
    where they came from."""

    seconds: dict[OpKey, float]
    source: str

    def node_seconds(self, graph: JointGraph) -> dict[str, float]:
        """Measured seconds of each node of `graph` whose key has a measurement."""
        found: dict[str, float] = {}
        for node in graph.gm.graph.nodes:
            key = node_key(node)
            if key is not None and key in self.seconds:
                found[node.name] = self.seconds[key]
        return found

    @staticmethod
    def coverage(roofline: dict[str, float], measured: dict[str, float]) -> dict[str, Any]:
        """How much of the roofline's compute the measurements replace: ops (those with a
        time) and seconds."""
        timed = {name for name, s in roofline.items() if s > 0}
        hit = timed & set(measured)
        total = sum(roofline[n] for n in timed)
        return {
            "ops": len(timed),
            "ops_measured": len(hit),
            "roofline_seconds_measured_fraction": (
                sum(roofline[n] for n in hit) / total if total else 0.0
            ),
        }


def calibration_table(prof: torch.profiler.profile) -> list[dict[str, Any]]:
    """Rows `{op, input_shapes, seconds, count}` from a finished profiler (run with
    `record_shapes=True`): torch's `key_averages(group_by_input_shape=True)`, the device
    time per call where kernels ran, else the CPU time per call."""
    rows = []
    for avg in prof.key_averages(group_by_input_shape=True):
        if not avg.key.startswith("aten::") or not avg.count:
            continue
        micros = avg.device_time if avg.device_time > 0 else avg.cpu_time
        rows.append(
            {
                "op": avg.key,
                "input_shapes": [list(s) for s in _shapes(avg.input_shapes)],
                "seconds": micros * 1e-6,
                "count": avg.count,
            }
        )
    return rows


# A profiler trace of one step is tens to hundreds of MiB; the cap keeps a wrong file (or
# /dev/zero) from filling memory.
MAX_CALIBRATION_BYTES = 2**30


def load_calibration(path: str | Path) -> Calibration:
    """A table (a JSON list of `calibration_table` rows) or a Chrome trace (a JSON object
    with `traceEvents`; recorded with `record_shapes=True`): on a GPU trace each op's time
    is its kernels' (those its own or nested ops launched), else its CPU duration."""
    where = Path(path)
    if not os.path.lexists(where):
        raise WorkbenchError(f"--calibrate {where}: no such file")
    raw = read_file(where, f"--calibrate {where}", MAX_CALIBRATION_BYTES)  # no pipe, no device
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise WorkbenchError(f"--calibrate {where}: not a JSON file ({err})") from None
    if isinstance(data, list):
        samples = _table_samples(data, where)
    elif isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        samples = _trace_samples(data["traceEvents"])
    else:
        raise WorkbenchError(
            f"--calibrate {where}: expected a torch.profiler Chrome trace (an object with "
            "traceEvents) or a table (a list of {op, input_shapes, seconds} rows)"
        )
    if not samples:
        raise WorkbenchError(
            f"--calibrate {where}: no aten op with input shapes in it; profile with "
            "torch.profiler.profile(record_shapes=True)"
        )
    return Calibration({k: statistics.median(v) for k, v in samples.items()}, str(where))


def _table_samples(rows: list[Any], where: Path) -> dict[OpKey, list[float]]:
    samples: dict[OpKey, list[float]] = defaultdict(list)
    for i, row in enumerate(rows):
        try:
            key = (str(row["op"]), _shapes(row["input_shapes"]))
            seconds = float(row["seconds"])
        except (KeyError, TypeError, ValueError):
            raise WorkbenchError(
                f"--calibrate {where}: row {i} needs op, input_shapes and seconds, got {row!r}"
            ) from None
        if seconds < 0:
            raise WorkbenchError(f"--calibrate {where}: row {i} has negative seconds")
        samples[key].append(seconds)
    return samples


def _trace_samples(events: list[Any]) -> dict[OpKey, list[float]]:
    """Per (op, shapes) the durations in seconds of each call: its kernels' where a kernel
    names it (or an op nested in it) by `External id`, else its own CPU span."""
    ops = [e for e in events if isinstance(e, dict) and e.get("cat") == "cpu_op"]
    kernel_us: dict[Any, float] = defaultdict(float)
    for e in events:
        if isinstance(e, dict) and e.get("cat") == "kernel":
            kernel_us[(e.get("args") or {}).get("External id")] += float(e.get("dur", 0))
    # nest ops per thread by their spans, so an op's kernels include its children's
    ops.sort(key=lambda e: (e.get("tid"), float(e["ts"]), -float(e.get("dur", 0))))
    own = {id(e): kernel_us.get((e.get("args") or {}).get("External id"), 0.0) for e in ops}
    device = dict(own)
    stack: list[dict[str, Any]] = []
    for e in ops:
        end = float(e["ts"]) + float(e.get("dur", 0))
        while stack and (
            stack[-1].get("tid") != e.get("tid")
            or float(stack[-1]["ts"]) + float(stack[-1].get("dur", 0)) < end
        ):
            stack.pop()
        for parent in stack:
            device[id(parent)] += own[id(e)]
        stack.append(e)
    samples: dict[OpKey, list[float]] = defaultdict(list)
    gpu = bool(kernel_us)
    for e in ops:
        name, args = str(e.get("name", "")), e.get("args") or {}
        if not name.startswith("aten::") or "Input Dims" not in args:
            continue
        micros = device[id(e)] if gpu else float(e.get("dur", 0))
        samples[(name, _shapes(args["Input Dims"]))].append(micros * 1e-6)
    return samples


def time_basis(
    profiles: Iterable[DeviceProfile], calibration: dict[str, Any] | None = None
) -> dict[str, str]:
    """Per profile, what its estimated step times and tokens/s rest on: the roofline at the
    profile's rates (`DeviceProfile.description`: datasheet peaks, so lower bounds, or this
    machine's measured rates), or, for the profile an `Estimator`'s `calibration` names, the
    share of the roofline's op time that measured op times replace.

    >>> from workbench.cost.profiles import H100
    >>> time_basis([H100])["h100"][:53]
    'roofline at NVIDIA H100 SXM datasheet peaks: bf16 989'
    >>> calibrated = {"profile": "h100", "source": "trace.json", "ops": 10, "ops_measured": 8,
    ...               "roofline_seconds_measured_fraction": 0.9}
    >>> time_basis([H100], calibrated)["h100"][:76]
    'calibrated: measured op times (trace.json) cover 90% of the roofline op time'
    """
    basis = {}
    for profile in profiles:
        roofline = f"roofline at {profile.description}"
        if calibration and calibration.get("profile") == profile.name:
            basis[profile.name] = (
                f"calibrated: measured op times ({calibration['source']}) cover "
                f"{calibration['roofline_seconds_measured_fraction']:.0%} of the roofline op "
                f"time ({calibration['ops_measured']} of {calibration['ops']} ops); the rest "
                f"is the {roofline}"
            )
        else:
            basis[profile.name] = roofline
    return basis


def measured_basis(device: str, runs: int) -> str:
    """What a measured step time rests on.

    >>> measured_basis("cuda:0", 5)
    'measured: median of 5 timed runs on cuda:0'
    """
    return f"measured: median of {runs} timed run{'s' if runs != 1 else ''} on {device}"
