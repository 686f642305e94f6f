"""Calibration: a torch.profiler trace made here on the CPU (and torch's own table of it)
replaces the roofline time of the graph's ops with matching op and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload
from workbench.cost.calibrate import calibration_table, load_calibration, node_key
from workbench.cost.estimate import Estimator
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError

Fixture = tuple[Workload, JointGraph]


def _mm_shapes(graph: JointGraph) -> tuple[tuple[int, ...], tuple[int, ...]]:
    for node in graph.gm.graph.nodes:
        key = node_key(node)
        if key is not None and key[0] == "aten::mm":
            a, b = key[1]
            return a, b
    raise AssertionError("no mm in the graph")


def _profiled(graph: JointGraph) -> profile:
    a_shape, b_shape = _mm_shapes(graph)
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            torch.mm(a, b)
    return prof


def test_a_profiler_trace_replaces_matching_ops(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    _, graph = small_graphs["llama3-debug"]
    prof = _profiled(graph)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    calibration = load_calibration(trace)
    key = ("aten::mm", _mm_shapes(graph))
    assert calibration.seconds[key] > 0
    plain = Estimator(graph, ("h100",))
    calibrated = Estimator(graph, ("h100",), calibration=calibration)
    report = calibrated.calibration
    assert report is not None and report["profile"] == "h100"
    assert 0 < report["ops_measured"] < report["ops"]
    assert 0 < report["roofline_seconds_measured_fraction"] < 1
    names = plain.index.names
    matched = [i for i, n in enumerate(graph.gm.graph.nodes) if node_key(n) == key]
    for i in matched:
        assert calibrated.seconds["h100"][i] == calibration.seconds[key]
    others = [i for i in range(len(names)) if i not in matched]
    assert all(calibrated.seconds["h100"][i] == plain.seconds["h100"][i] for i in others)
    # CPU times are far above an H100's roofline: the step gets slower
    policy = Policy("default")
    slow = calibrated.estimate(policy).step_seconds["h100"]
    assert slow > plain.estimate(policy).step_seconds["h100"]


def test_torchs_table_of_the_same_run_loads_alike(
    small_graphs: dict[str, Fixture], tmp_path: Path
) -> None:
    _, graph = small_graphs["llama3-debug"]
    rows = calibration_table(_profiled(graph))
    table = tmp_path / "table.json"
    table.write_text(json.dumps(rows))
    key = ("aten::mm", _mm_shapes(graph))
    assert key in load_calibration(table).seconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not a JSON file"),
        ('{"a": 1}', "expected a torch.profiler Chrome trace"),
        ('[{"op": "aten::mm"}]', "row 0 needs op, input_shapes and seconds"),
        (
            '[{"op": "aten::mm", "input_shapes": [[2]], "seconds": -1}]',
            "seconds must be a finite number >= 0",
        ),
        ('{"traceEvents": []}', "record_shapes=True"),
    ],
)
def test_bad_calibration_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(WorkbenchError, match=message):
        load_calibration(path)
