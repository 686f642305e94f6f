"""Memory snapshots in and out: the estimate written as a snapshot that torch's own
`_memory_viz` reads and that reads back with zero differences; snapshots recorded on the CPU
in torch's format attributed to nodes; torch's own CPU snapshot (`_profile_to_snapshot`)
read; bad files refused in one line without unpickling anything but plain data."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest
import torch
from snapshot_fixtures import record_snapshot
from torch.cuda import _memory_viz

from workbench.capture.graph import JointGraph
from workbench.capture.models import Workload, load_workload
from workbench.capture.trace import trace
from workbench.cost import snapshot as snapshot_module
from workbench.cost.allocator import AllocatorConfig, CachingAllocator, round_size
from workbench.cost.attribution import attribute, compare_snapshot, generated_lines
from workbench.cost.estimate import Estimate, Estimator, estimate_remat
from workbench.cost.estimated_snapshot import (
    BASE_ADDRESS,
    KINDS,
    estimated_snapshot,
    storage_table,
    write_estimated_snapshot,
)
from workbench.cost.profiles import CUDA_ALLOC_GRANULARITY
from workbench.cost.snapshot import (
    META_KEY,
    Frame,
    Snapshot,
    generated_code_line,
    load_snapshot,
    parse_snapshot,
    snapshot_bytes,
    write_snapshot,
)
from workbench.decide.policy import Policy
from workbench.errors import WorkbenchError
from workbench.files import is_ours
from workbench.rewrite.remat import RematResult, remat

# the opcodes memory_viz's JavaScript unpickler handles (torch/utils/viz/MemoryViz.js)
VIEWER_OPCODES = {
    "APPEND",
    "APPENDS",
    "BINGET",
    "BININT",
    "BININT1",
    "BININT2",
    "EMPTY_DICT",
    "EMPTY_LIST",
    "FRAME",
    "LONG1",
    "LONG_BINGET",
    "MARK",
    "MEMOIZE",
    "PROTO",
    "SETITEMS",
    "SHORT_BINUNICODE",
    "STOP",
    "TUPLE2",
    "NEWFALSE",
    "BINPUT",
    "BINUNICODE",
    "EMPTY_TUPLE",
    "NEWTRUE",
    "NONE",
    "BINFLOAT",
    "TUPLE",
    "TUPLE1",
    "TUPLE3",
    "LONG_BINPUT",
    "LIST",
    "DICT",
    "SETITEM",
}


@pytest.fixture(scope="module")
def peaky() -> tuple[Workload, JointGraph]:
    """llama3-debug, 2 layers, 128 tokens, real tensors: activations at the peak."""
    workload = load_workload("llama3-debug", layers=2, seq=128)
    return workload, trace(workload, mode="real")


def _remat_estimate(
    graph: JointGraph, policy: str, optimizer: str = "none"
) -> tuple[Estimator, RematResult, Estimate]:
    estimator = Estimator(graph, profiles=(), optimizer=optimizer)  # type: ignore[arg-type]
    result = remat(graph, Policy(policy))
    return estimator, result, estimate_remat(graph, result, estimator, CUDA_ALLOC_GRANULARITY)


def _written(estimator: Estimator, est: Estimate) -> dict[str, Any]:
    """The estimate's snapshot as a file holds it: pickled and unpickled."""
    data: dict[str, Any] = pickle.loads(snapshot_bytes(estimated_snapshot(estimator, est)))
    return data


# --- snapshot out -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "optimizer", "allocator"),
    [
        ("default", "adamw", AllocatorConfig()),
        ("full", "none", AllocatorConfig(expandable_segments=True)),
        ("offload", "sgd", AllocatorConfig(max_split_size=32 * 2**20)),
    ],
)
def test_the_estimate_written_as_a_snapshot_reads_back_with_zero_differences(
    peaky: tuple[Workload, JointGraph], policy: str, optimizer: str, allocator: AllocatorConfig
) -> None:
    _, graph = peaky
    estimator = Estimator(graph, profiles=(), optimizer=optimizer, allocator=allocator)  # type: ignore[arg-type]
    written = estimator.estimate(Policy(policy))  # the what-if, at 1-byte granularity
    snapshot = parse_snapshot(_written(estimator, written))
    result = remat(graph, Policy(policy))
    est = estimate_remat(graph, result, estimator, CUDA_ALLOC_GRANULARITY)
    comparison = compare_snapshot(snapshot, estimator, est, result.gm)
    report = comparison.to_json()
    assert report["difference"] == {"allocated_peak_bytes": 0, "reserved_peak_bytes": 0}
    assert report["nodes_differing"] == 0 and report["node_differences"] == []
    assert report["measured"] == report["estimated"]
    assert report["measured"]["allocated_peak_node"] == est.peak_node
    methods = report["attribution"]["methods"]
    assert methods["unattributed"]["allocations"] == 0
    assert methods["node_metadata"]["allocations"] == len(
        storage_table(estimator, est).entries
    ) - sum(1 for s in storage_table(estimator, est).requested if s == 0)
    # per step of the node order, the same live bytes (optimizer state as torch rounds it)
    state = storage_table(estimator, est).optimizer
    rounding = sum(round_size(b) - b for b in state)
    assert comparison.measured_timeline == [t + rounding for t in est.totals()]


def test_torchs_memory_viz_reads_the_estimates_snapshot(
    peaky: tuple[Workload, JointGraph],
) -> None:
    _, graph = peaky
    estimator, _, est = _remat_estimate(graph, "default", "adamw")
    raw = snapshot_bytes(estimated_snapshot(estimator, est, "llama3-debug default"))
    # what pytorch.org/memory_viz's own unpickler reads: protocol 4, its opcodes only
    opcodes = {op.name for op, _, _ in pickletools.genops(raw)}
    assert raw[:2] == b"\x80\x04" and opcodes <= VIEWER_OPCODES, opcodes - VIEWER_OPCODES
    data = pickle.loads(raw)
    summary = _memory_viz.segsum(data)  # asserts every segment's blocks add up
    reserved = sum(s["total_size"] for s in data["segments"])
    assert reserved == est.reserved_peak_bytes and "segments:" in summary
    assert "TOTAL MEM" in _memory_viz.trace(data)

    def lines(text: str) -> str:  # the flamegraph's input, without the perl script
        return text

    flame = _memory_viz.memory(data, format_flamegraph=lines)
    assert "sac-workbench estimate:0:llama3-debug default" in flame
    assert " = aten.mm.default" in flame  # a gradient, live at the end
    assert _memory_viz.segments(data, format_flamegraph=lines)
    segments = data["segments"]  # what `compare` takes: two snapshots' segments
    assert "only_after" not in _memory_viz.compare(segments, segments, format_flamegraph=lines)
    for html in (_memory_viz.trace_plot(data), _memory_viz.segment_plot(data)):
        assert "MemoryViz.js" in html and "snapshot.pickle" in html
    # every block of a segment at its address, the segments tiled
    for segment in data["segments"]:
        at = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == at
            at += block["size"]
        assert at == segment["address"] + segment["total_size"] >= BASE_ADDRESS
    # the viewer colours by category and needs "unknown" among them
    categories = {e.get("category") for e in data["device_traces"][0]} - {None}
    assert "unknown" in categories and {"parameters", "optimizer"} <= categories


def test_frames_name_the_node_its_module_and_source_line(
    peaky: tuple[Workload, JointGraph],
) -> None:
    _, graph = peaky
    estimator, _, est = _remat_estimate(graph, "default")
    data = estimated_snapshot(estimator, est, "title")
    allocs = [e for e in data["device_traces"][0] if e["action"] == "alloc"]
    mm = next(e for e in allocs if e["frames"][0]["fx_node_name"].startswith("mm"))
    node, source, outer = mm["frames"]
    assert node["filename"].startswith("layers.0.") and node["name"].endswith("aten.mm.default")
    assert source["filename"] == "llama3.py" and source["line"] > 0
    assert outer == {"filename": "sac-workbench estimate", "line": 0, "name": "title"}
    assert data[META_KEY]["format"] == 1 and data[META_KEY]["steps"] == len(est.order)


def test_storage_table_names_each_storage_by_the_entry_allocating_it(
    peaky: tuple[Workload, JointGraph],
) -> None:
    _, graph = peaky
    estimator, _, est = _remat_estimate(graph, "full")
    table = storage_table(estimator, est)
    assert len(table.entries) == len(est.device_storages.sizes)  # type: ignore[union-attr]
    assert set(table.entries) <= set(est.order)
    assert any(e.endswith("_recomputed") for e in table.entries)
    assert set(table.kinds) <= set(KINDS)
    assert all(r == round_size(s) for r, s in zip(table.rounded, table.requested, strict=True) if s)
    inputs = [e for e, k in zip(table.entries, table.kinds, strict=True) if k == "parameters"]
    assert inputs and all(graph.nodes[e].op == "placeholder" for e in inputs)
    assert table.by_entry()[table.entries[0]][0] == 0


def test_written_snapshot_is_replaced_when_run_again(
    peaky: tuple[Workload, JointGraph], tmp_path: Path
) -> None:
    _, graph = peaky
    estimator, _, est = _remat_estimate(graph, "default")
    path = write_estimated_snapshot(tmp_path / "est.pickle", estimator, est, "x")
    assert is_ours(path)  # the mark inside the pickle
    assert write_estimated_snapshot(path, estimator, est, "y") == path
    assert load_snapshot(path).meta["title"] == "y"
    other = tmp_path / "torch.pickle"
    other.write_bytes(pickle.dumps({"segments": [], "device_traces": []}))
    with pytest.raises(WorkbenchError, match="exists and was not written by the workbench"):
        write_snapshot(other, {"segments": []})
    write_snapshot(other, {"segments": []}, overwrite=True)
    assert load_snapshot(other).segments == []


# --- snapshot in: attribution -----------------------------------------------------------


@pytest.mark.parametrize("policy", ["default", "full", "none"])
def test_a_recorded_snapshot_is_attributed_to_nodes_by_generated_code_lines(
    peaky: tuple[Workload, JointGraph], policy: str
) -> None:
    """A real CPU run recorded in torch's format, frames as torch records them: every
    allocation found by its `<eval_with_key>` line (the inputs, made before, by size), and the
    run's memory equals the estimate's, node for node."""
    _, graph = peaky
    estimator, result, est = _remat_estimate(graph, policy)
    data, _ = record_snapshot(result.gm, graph.example_inputs or [])
    report = compare_snapshot(parse_snapshot(data), estimator, est, result.gm).to_json()
    attribution = report["attribution"]
    assert attribution["peak_fraction_attributed_to_nodes"] >= 0.95
    assert attribution["methods"]["generated_code"]["allocations"] > 100
    assert attribution["methods"]["unattributed"]["allocations"] == 0
    assert report["difference"]["allocated_peak_bytes"] == 0
    assert report["measured"]["allocated_peak_node"] == est.peak_node
    assert report["nodes_differing"] == 0
    assert report["measured"]["at_peak_bytes"] == report["estimated"]["at_peak_bytes"]


def test_allocations_without_frames_are_matched_by_size_and_order(
    peaky: tuple[Workload, JointGraph],
) -> None:
    _, graph = peaky
    estimator, result, est = _remat_estimate(graph, "default")
    data, _ = record_snapshot(result.gm, graph.example_inputs or [], strip_every=4)
    snapshot = parse_snapshot(data)
    report = compare_snapshot(snapshot, estimator, est, result.gm).to_json()
    methods = report["attribution"]["methods"]
    assert methods["size_and_order"]["allocations"] > 20
    assert report["attribution"]["peak_fraction_attributed_to_nodes"] >= 0.95
    # without the graph module, frames cannot be read: size and order for all, said so
    blind = compare_snapshot(snapshot, estimator, est).to_json()
    assert blind["attribution"]["methods"]["generated_code"]["allocations"] == 0
    assert blind["attribution"]["peak_fraction_attributed_to_nodes"] >= 0.95
    assert any("no graph module" in note for note in blind["notes"])
    # each allocation says how it was found and what it holds
    allocations = attribute(snapshot, estimator, est, result.gm)
    assert {a.method for a in allocations} == {"generated_code", "size_and_order", "size"}
    assert {a.kind for a in allocations} <= set(KINDS) - {"unattributed"}


def test_torchs_own_cpu_snapshot_reads_and_its_peak_is_the_estimates(
    peaky: tuple[Workload, JointGraph],
) -> None:
    """A snapshot torch itself makes on the CPU (`_profile_to_snapshot` of a memory profile):
    its frames name no line (the profiler's), so allocations go by size and order."""
    from torch.profiler import ProfilerActivity, profile

    _, graph = peaky
    estimator, result, est = _remat_estimate(graph, "default")
    with (
        torch.no_grad(),
        profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=True,
            with_stack=True,
        ) as prof,
    ):
        result.gm(*(graph.example_inputs or []))
    data = pickle.loads(pickle.dumps(_memory_viz._profile_to_snapshot(prof)))
    report = compare_snapshot(parse_snapshot(data), estimator, est, result.gm).to_json()
    measured, estimated = report["measured"], report["estimated"]
    assert (
        abs(measured["allocated_peak_bytes"] - estimated["allocated_peak_bytes"])
        <= 0.01 * (estimated["allocated_peak_bytes"])
    )
    assert report["attribution"]["methods"]["size_and_order"]["allocations"] > 100
    assert report["attribution"]["peak_fraction_attributed_to_nodes"] >= 0.9
    assert any("made no segments" in note for note in report["notes"])


def test_generated_lines_map_each_statement_to_its_node(
    peaky: tuple[Workload, JointGraph],
) -> None:
    _, graph = peaky
    _, result, _ = _remat_estimate(graph, "full")
    lines = generated_lines(result.gm)
    code = result.gm.code.splitlines()
    nodes = list(result.gm.graph.nodes)
    called = [n for n in nodes if n.op == "call_function"]
    assert {nodes[k] for k in lines.values()} >= set(called)
    for line, k in lines.items():
        if nodes[k].op == "call_function":
            assert code[line - 1].strip().startswith(f"{nodes[k].name} = "), code[line - 1]


def test_compare_wants_the_estimate_at_torchs_rounding(peaky: tuple[Workload, JointGraph]) -> None:
    _, graph = peaky
    estimator, result, _ = _remat_estimate(graph, "default")
    exact = estimate_remat(graph, result, estimator)  # 1-byte granularity
    snapshot = parse_snapshot(_written(estimator, exact))
    with pytest.raises(WorkbenchError, match="512-byte rounding"):
        compare_snapshot(snapshot, estimator, exact, result.gm)
    other = remat(graph, Policy("none")).gm
    at_512 = estimate_remat(graph, result, estimator, CUDA_ALLOC_GRANULARITY)
    with pytest.raises(WorkbenchError, match="give the estimate of the graph that ran"):
        compare_snapshot(snapshot, estimator, at_512, other)


# --- the format --------------------------------------------------------------------------


def _torch_like() -> dict[str, Any]:
    """A snapshot as `_snapshot()` returns it: one segment, two blocks, four events."""
    frames = [
        {"filename": "<eval_with_key>.3", "line": 7, "name": "forward"},
        {"filename": "/x/torch/fx/graph_module.py", "line": 800, "name": "__call__"},
    ]
    return {
        "segments": [
            {
                "device": 0,
                "address": 4096,
                "total_size": 2097152,
                "allocated_size": 512,
                "active_size": 512,
                "requested_size": 100,
                "stream": 0,
                "segment_type": "small",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": [
                    {
                        "address": 4096,
                        "size": 512,
                        "requested_size": 100,
                        "state": "active_allocated",
                        "frames": frames,
                    },
                    {
                        "address": 4608,
                        "size": 2096640,
                        "requested_size": 0,
                        "state": "inactive",
                        "frames": [],
                    },
                ],
            }
        ],
        "device_traces": [
            [
                {
                    "action": "segment_alloc",
                    "addr": 4096,
                    "size": 2097152,
                    "stream": 0,
                    "time_us": 1,
                    "frames": frames,
                },
                {
                    "action": "alloc",
                    "addr": 4096,
                    "size": 100,
                    "stream": 0,
                    "time_us": 2,
                    "frames": frames,
                },
                {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 3},
                {"action": "oom", "device_free": 7, "size": 9, "stream": 0, "time_us": 4},
            ]
        ],
        "allocator_settings": {},
        "external_annotations": [],
    }


def test_parse_snapshot_types_torchs_format() -> None:
    snapshot = parse_snapshot(_torch_like(), "s")
    (segment,) = snapshot.segments
    assert segment.total_size == 2097152 and segment.segment_type == "small"
    assert [b.state for b in segment.blocks] == ["active_allocated", "inactive"]
    events = snapshot.trace(0)
    assert [e.action for e in events] == ["segment_alloc", "alloc", "snapshot", "oom"]
    assert events[1].frames[0] == Frame("<eval_with_key>.3", 7, "forward")
    assert events[1].time_us == 2 and events[3].addr == 0
    assert snapshot.devices() == [0] and snapshot.device() == 0
    # a list is segments alone, as torch's _memory_viz takes it; old blocks without frames
    old = parse_snapshot(
        [
            {
                "address": 0,
                "total_size": 512,
                "blocks": [
                    {"size": 512, "state": "active_allocated", "history": [{"real_size": 8}]}
                ],
            }
        ]
    )
    assert old.segments[0].blocks[0].requested_size == 8 and old.traces == []


def test_snapshot_device_names_the_devices_it_holds() -> None:
    two = _torch_like()
    two["device_traces"].append([{"action": "alloc", "addr": 1, "size": 1, "stream": 0}])
    snapshot = parse_snapshot(two, "snapshot s.pickle")
    assert snapshot.devices() == [0, 1] and snapshot.device(1) == 1
    with pytest.raises(WorkbenchError, match=r"holds devices 0, 1: name one \(--device N\)"):
        snapshot.device()
    with pytest.raises(WorkbenchError, match=r"holds no device 5 \(devices: 0, 1\)"):
        snapshot.device(5)
    assert Snapshot([], [], "s").devices() == []


def test_generated_code_line_finds_the_innermost_generated_frame() -> None:
    frames = (
        Frame("/x/torch/_ops.py", 840, "__call__"),
        Frame("<eval_with_key>.7 from /m.py:4 in forward", 12, "forward"),
        Frame("<eval_with_key>.2", 30, "forward"),
    )
    assert generated_code_line(frames) == frames[1]
    assert generated_code_line(frames, "<eval_with_key>.2") == frames[2]
    assert generated_code_line((Frame("/tmp/fx_generated_ab12.py", 3, "forward"),)) is not None
    assert generated_code_line(frames[:1]) is None


def test_caching_allocator_says_what_it_mapped_and_caches() -> None:
    allocator = CachingAllocator()
    block = allocator.malloc(100)
    big = allocator.malloc(3 * 2**20)
    assert allocator.mapped == [(0, 2**21, True), (2**21, 20 * 2**20, False)]
    allocator.free(block)
    cached = allocator.cached_blocks()
    assert sum(b.size for b in cached) + big.size == allocator.reserved_bytes


# --- bad snapshots ------------------------------------------------------------------------


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/sac-workbench-pwned",))


BAD: list[tuple[str, bytes, str]] = [
    ("empty", b"", "is not a pickle"),
    ("text", b"segments: []\n", "is not a pickle"),
    ("truncated", pickle.dumps(_torch_like(), protocol=4)[:-40], "truncated"),
    ("code", pickle.dumps(_Payload()), r"names (posix|os)\.system, and a snapshot names none"),
    ("object", pickle.dumps(io.BytesIO(b"x")), r"names _io\.BytesIO"),
    ("tensor", pickle.dumps(torch.zeros(2)), r"names torch\._utils\."),
    ("a number", pickle.dumps(7), r"is not a memory snapshot \(got int\)"),
    ("other dict", pickle.dumps({"model": 1}), r"got keys model\)"),
    ("segments not a list", pickle.dumps({"segments": 3}), "segments must be a list, got int"),
    (
        "block size",
        pickle.dumps(
            {
                "segments": [
                    {"address": 0, "total_size": 1, "blocks": [{"size": "1", "state": "inactive"}]}
                ]
            }
        ),
        r"blocks\[0\]: size must be an int",
    ),
    ("traces", pickle.dumps({"segments": [], "device_traces": {}}), "device_traces must be a"),
    (
        "action",
        pickle.dumps({"segments": [], "device_traces": [[{"action": "malloc"}]]}),
        "unknown action 'malloc'; torch's are alloc",
    ),
    (
        "frames",
        pickle.dumps(
            {
                "segments": [],
                "device_traces": [
                    [{"action": "alloc", "addr": 0, "size": 1, "frames": [{"line": 1}]}]
                ],
            }
        ),
        r"frames\[0\]: filename must be a string",
    ),
    (
        "newer format",
        pickle.dumps({"segments": [], META_KEY: {"format": 9}}),
        "has sac_workbench format 9; this workbench reads format 1",
    ),
    ("nested", b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b".", r"segments\[0\] must be a"),
    ("persistent id", b"\x80\x04X\x01\x00\x00\x00aQ.", "holds a persistent id"),
    ("protocol 9", b"\x80\x09N.", "unsupported pickle protocol"),
]


@pytest.mark.parametrize(("data", "message"), [(d, m) for _, d, m in BAD], ids=[b[0] for b in BAD])
def test_bad_snapshots_are_refused_in_one_line(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.pickle"
    path.write_bytes(data)
    with pytest.raises(WorkbenchError, match=message) as err:
        load_snapshot(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    assert not Path("/tmp/sac-workbench-pwned").exists()


def test_huge_missing_and_special_files_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.pickle"
    path.write_bytes(snapshot_bytes({"segments": []}))
    monkeypatch.setattr(snapshot_module, "MAX_SNAPSHOT_BYTES", 64)
    with pytest.raises(WorkbenchError, match="is larger than 64 bytes"):
        load_snapshot(path)
    with pytest.raises(WorkbenchError, match="no such file"):
        load_snapshot(tmp_path / "missing.pickle")
    with pytest.raises(WorkbenchError, match="it is a folder"):
        load_snapshot(tmp_path)
    with pytest.raises(WorkbenchError, match="it is a device"):
        load_snapshot("/dev/zero")
