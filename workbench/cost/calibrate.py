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
import math
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
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"load_calibration: path must be a str or os.PathLike, got {path!r}")
    if not str(path):
        raise WorkbenchError("--calibrate '' names no file: give a profiler trace or table")
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
        samples = _trace_samples(data["traceEvents"], where)
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
            seconds = row["seconds"]
        except (KeyError, TypeError, ValueError):
            raise WorkbenchError(
                f"--calibrate {where}: row {i} needs op, input_shapes and seconds, got {row!r}"
            ) from None
        if not isinstance(row["input_shapes"], list):
            raise WorkbenchError(
                f"--calibrate {where}: row {i} input_shapes must be a list of shapes, got "
                f"{row['input_shapes']!r}"
            )
        samples[key].append(_duration(seconds, f"row {i} seconds", where))
    return samples


def _duration(value: Any, field: str, where: Path) -> float:
    """A measured time: a finite number >= 0 (a negative, NaN or infinite one would give
    step times that mean nothing, and JSON cannot hold NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise WorkbenchError(
            f"--calibrate {where}: {field} must be a finite number >= 0, got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class _Event:
    """A trace event's fields the reader uses, each checked (`_checked_events`)."""

    name: str
    tid: int | str
    ts: float
    dur: float
    ext: int | str | None  # `External id`: what ties a kernel to the op that launched it
    dims: list[Any] | None  # `Input Dims`


def _checked_events(events: list[Any], where: Path) -> tuple[list[_Event], list[_Event]]:
    """The ops and kernels of a Chrome trace, each field checked once here, so a malformed
    event is one line naming its index and field rather than an error deep in the nesting."""
    ops: list[_Event] = []
    kernels: list[_Event] = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("cat") not in ("cpu_op", "kernel"):
            continue
        at = f"event {i} ({e['cat']})"
        args = e.get("args") or {}
        if not isinstance(args, dict):
            raise WorkbenchError(f"--calibrate {where}: {at} args must be an object, got {args!r}")
        ext = args.get("External id")
        dims = args.get("Input Dims")
        tid = e.get("tid", 0)
        for field, value, kinds in (
            ("tid", tid, (int, str)),
            ("args 'External id'", ext, (int, str, type(None))),
            ("args 'Input Dims'", dims, (list, type(None))),
        ):
            if isinstance(value, bool) or not isinstance(value, kinds):
                names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
                raise WorkbenchError(
                    f"--calibrate {where}: {at} {field} must be {names}, got {value!r}"
                )
        ts = e.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            raise WorkbenchError(
                f"--calibrate {where}: {at} ts must be a finite number of microseconds, got {ts!r}"
            )
        event = _Event(
            str(e.get("name", "")),
            tid,
            float(ts),
            _duration(e.get("dur", 0), f"{at} dur", where),
            ext,
            dims,
        )
        (ops if e["cat"] == "cpu_op" else kernels).append(event)
    return ops, kernels


def _trace_samples(events: list[Any], where: Path) -> dict[OpKey, list[float]]:
    """Per (op, shapes) the durations in seconds of each call: its kernels' where a kernel
    names it (or an op nested in it) by `External id`, else its own CPU span."""
    ops, kernels = _checked_events(events, where)
    kernel_us: dict[Any, float] = defaultdict(float)
    for k in kernels:
        kernel_us[k.ext] += k.dur
    # nest ops per thread by their spans, so an op's kernels include its children's (a
    # thread id may be a number or a string: grouped by its type and text)
    ops.sort(key=lambda e: (type(e.tid).__name__, str(e.tid), e.ts, -e.dur))
    own = {id(e): 0.0 if e.ext is None else kernel_us.get(e.ext, 0.0) for e in ops}
    device = dict(own)
    stack: list[_Event] = []
    for e in ops:
        while stack and (stack[-1].tid != e.tid or stack[-1].ts + stack[-1].dur < e.ts + e.dur):
            stack.pop()
        for parent in stack:
            device[id(parent)] += own[id(e)]
        stack.append(e)
    samples: dict[OpKey, list[float]] = defaultdict(list)
    gpu = bool(kernel_us)
    for e in ops:
        if not e.name.startswith("aten::") or e.dims is None:
            continue
        micros = device[id(e)] if gpu else e.dur
        samples[(e.name, _shapes(e.dims))].append(micros * 1e-6)
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
