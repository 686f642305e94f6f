"""The estimate as a memory snapshot: its allocations and frees, node by node, through the
caching allocator model, in the format pytorch.org/memory_viz and `torch.cuda._memory_viz`
read, so that the estimate shows in the viewer users already know.

Entry points: `storage_table(estimator, est)` (the estimate's device storages, each with the
node-order entry that allocates it, its kind and sizes: what a snapshot is compared with) and
`estimated_snapshot(estimator, est)` (the snapshot dict) and `write_estimated_snapshot`.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.cost.allocator import Block, CachingAllocator, allocation_steps, round_size
from workbench.cost.estimate import CATEGORIES, Estimate, Estimator
from workbench.cost.snapshot import META_KEY, SNAPSHOT_FORMAT, write_snapshot
from workbench.errors import WorkbenchError

__all__ = [
    "BASE_ADDRESS",
    "CATEGORY_KIND",
    "KINDS",
    "StorageTable",
    "estimated_snapshot",
    "storage_table",
    "write_estimated_snapshot",
]

# What an allocation holds, as the comparison with a measured snapshot itemises it; the
# estimate's categories map onto all but the last (`CATEGORY_KIND`).
KINDS: tuple[str, ...] = (
    "parameters",
    "inputs",
    "gradients",
    "optimizer",
    "saved activations",
    "temporaries",
    "communication buffers",
    "workspaces",
    "unattributed",
)
CATEGORY_KIND: dict[str, str] = {
    "parameters": "parameters",
    "inputs": "inputs",
    "gradients": "gradients",
    "activations": "saved activations",
    "temporaries": "temporaries",
    "gathered": "communication buffers",  # FSDP's all-gathered (and cast) parameter copies
    "optimizer": "optimizer",
    "workspaces": "workspaces",  # cuBLAS's (`workbench.cost.workspaces`)
}
# where the writer's addresses start (the allocator model counts from 0): a device address
# as a CUDA process sees one, never the null pointer
BASE_ADDRESS = 0x7F00_0000_0000
_SOURCE = re.compile(r"^(?P<file>.+?):(?P<line>\d+) in (?P<name>[^:]+)")


@dataclass
class StorageTable:
    """The estimate's device storages in its storage order: the node-order entry allocating
    each (`Estimate.order`'s names: a recomputed copy or a reload keeps its own), the bytes
    requested and as torch rounds them (`allocator.round_size`), birth and free steps, kind;
    `workspaces` cuBLAS's and `optimizer` the optimizer's state tensors, allocated before
    the step (in that order) and held."""

    entries: list[str]
    requested: list[int]
    rounded: list[int]
    born: list[int]
    freed: list[int]
    kinds: list[str]
    optimizer: list[int]
    steps: int
    workspaces: list[int]

    def by_entry(self) -> dict[str, list[int]]:
        """Each entry's storages, in storage order."""
        found: dict[str, list[int]] = {}
        for i, entry in enumerate(self.entries):
            found.setdefault(entry, []).append(i)
        return found


def storage_table(estimator: Estimator, est: Estimate) -> StorageTable:
    """`est`'s device storages (`Estimate.device_storages`, `allocator_input`), each named by
    the entry that allocates it: the one at its birth step, else (a graph input, held from
    the first step; an all-gather issued early) the first entry of its node from there on."""
    storages, walk = est.device_storages, est.allocator_input
    if storages is None or walk is None:
        raise WorkbenchError("this estimate has no allocation sequence (made by an Estimator)")
    names = estimator.index.names
    positions: dict[str, list[int]] = {}
    for p, entry in enumerate(est.order):
        positions.setdefault(estimator.traced_node(entry), []).append(p)
    entries = []
    for node, born in zip(storages.node.tolist(), storages.born.tolist(), strict=True):
        traced = names[node]
        spots = positions.get(traced, [])
        at = bisect.bisect_left(spots, born)
        entries.append(est.order[spots[at]] if at < len(spots) else traced)
    requested = walk.sizes.tolist()
    return StorageTable(
        entries=entries,
        requested=requested,
        rounded=[round_size(s) if s else 0 for s in requested],
        born=walk.born.tolist(),
        freed=walk.freed.tolist(),
        kinds=[CATEGORY_KIND[CATEGORIES[c]] for c in storages.category.tolist()],
        optimizer=list(walk.before[len(estimator.workspace_tensors) :]),
        steps=walk.steps,
        workspaces=list(estimator.workspace_tensors),
    )


def _frames(estimator: Estimator, entry: str, position: int, title: str) -> list[dict[str, Any]]:
    """Innermost first, as torch lists them: the node (its node-order position as the line,
    `fx_node_name` as `_snapshot(augment_with_fx_traces=True)` adds it), the model's source
    line it came from, and the estimate."""
    info = estimator.graph.nodes.get(estimator.traced_node(entry))
    op = info.op if info is not None else "?"
    frames = [
        {
            "filename": (info.module if info is not None else "") or "<graph>",
            "line": position,
            "name": f"{entry} = {op}",
            "fx_node_name": entry,
            "fx_node_op": "placeholder" if op == "placeholder" else "call_function",
            "fx_node_target": op,
        }
    ]
    source = _SOURCE.match(info.source) if info is not None and info.source else None
    if source:
        frames.append(
            {"filename": source["file"], "line": int(source["line"]), "name": source["name"]}
        )
    frames.append({"filename": "sac-workbench estimate", "line": 0, "name": title})
    return frames


def estimated_snapshot(estimator: Estimator, est: Estimate, title: str = "") -> dict[str, Any]:
    """`est` as a memory snapshot: the optimizer's state allocated first, then at each step
    of the node order its storages allocated and the dead ones freed (`allocation_steps`, the
    order `replay_allocator` runs), each through the caching allocator model, which places
    blocks and makes segments (`segment_alloc`, or `segment_map` with expandable segments).
    Events carry frames naming the node, its module and source line, a `category` (the
    viewer colours by it) and `time_us` = the node-order step (not a time); the segments hold
    the blocks live at the end, as torch's `_snapshot()` would."""
    walk = est.allocator_input
    table = storage_table(estimator, est)
    assert walk is not None
    title = title or estimator.graph.model_name
    expandable = walk.config.expandable_segments
    allocator = CachingAllocator(walk.config)
    trace: list[dict[str, Any]] = []
    held: dict[int, tuple[Block, int, list[dict[str, Any]]]] = {}  # key -> block, bytes, frames
    addresses: dict[int, int] = {}
    frames_of: dict[str, list[dict[str, Any]]] = {}
    position: dict[str, int] = {}
    for p, name in enumerate(est.order):
        position.setdefault(name, p)
    optimizer_frames = [
        {"filename": "optimizer", "line": 0, "name": f"{estimator.optimizer} state"},
        {"filename": "sac-workbench estimate", "line": 0, "name": title},
    ]

    def event(action: str, addr: int, size: int, step: int, frames: list[Any]) -> dict[str, Any]:
        return {
            "action": action,
            "addr": addr,
            "size": size,
            "stream": 0,
            "time_us": step,
            "frames": frames,
        }

    def malloc(key: int, nbytes: int, step: int, frames: list[Any], kind: str) -> None:
        mapped = len(allocator.mapped)
        block = allocator.malloc(nbytes)
        for addr, size, _ in allocator.mapped[mapped:]:
            action = "segment_map" if expandable else "segment_alloc"
            trace.append(event(action, BASE_ADDRESS + addr, size, step, frames))
        addresses[key] = BASE_ADDRESS + block.addr
        trace.append({**event("alloc", addresses[key], nbytes, step, frames), "category": kind})
        held[key] = (block, nbytes, frames)

    workspace_frames = [
        {"filename": "cuBLAS", "line": 0, "name": "cuBLAS / cuBLASLt workspace"},
        {"filename": "sac-workbench estimate", "line": 0, "name": title},
    ]
    for k, nbytes in enumerate(table.workspaces):
        malloc(-1 - k, nbytes, 0, workspace_frames, "workspaces")
    for k, nbytes in enumerate(table.optimizer, start=len(table.workspaces)):
        malloc(-1 - k, nbytes, 0, optimizer_frames, "optimizer")
    steps = allocation_steps(walk.sizes, walk.born, walk.freed, walk.steps)
    for step, allocated, released in steps:
        for i in allocated:
            entry = table.entries[i]
            if entry not in frames_of:
                at = position.get(entry, step)
                frames_of[entry] = _frames(estimator, entry, at, title)
            malloc(i, table.requested[i], step, frames_of[entry], table.kinds[i])
        for i in released:
            block, nbytes, frames = held.pop(i)
            allocator.free(block)  # may merge it with its free neighbours: its address is kept
            for action in ("free_requested", "free_completed"):
                trace.append(event(action, addresses[i], nbytes, step, frames))
    # torch records a `snapshot` action when one is taken; memory_viz needs the category
    # "unknown" among those it has seen once it has seen any (MemoryViz.js annotate_snapshot)
    trace.append({**event("snapshot", 0, 0, walk.steps, []), "category": "unknown"})
    return {
        "segments": _segments(allocator, held, expandable),
        "device_traces": [trace],
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": _alloc_conf(walk.config),
            "expandable_segments": expandable,
            "max_split_size": walk.config.split_limit,
        },
        "external_annotations": [],
        META_KEY: {
            "format": SNAPSHOT_FORMAT,
            "model": estimator.graph.model_name,
            "kernels": estimator.graph.config.get("kernels"),  # what compare-snapshot traces
            "title": title,
            "steps": walk.steps,
            "peak_bytes": est.peak_bytes,
            "reserved_peak_bytes": est.reserved_peak_bytes,
            "time_us": "the node-order step of each event, not a time",
        },
    }


def write_estimated_snapshot(
    path: str | os.PathLike[str],
    estimator: Estimator,
    est: Estimate,
    title: str = "",
    overwrite: bool = False,
) -> Path:
    """`estimated_snapshot` written to `path` (`snapshot.write_snapshot`)."""
    return write_snapshot(path, estimated_snapshot(estimator, est, title), overwrite=overwrite)


def _alloc_conf(config: Any) -> str:
    settings = []
    if config.expandable_segments:
        settings.append("expandable_segments:True")
    if config.max_split_size is not None:
        settings.append(f"max_split_size_mb:{config.max_split_size // 2**20}")
    return ",".join(settings)


def _segments(
    allocator: CachingAllocator,
    held: dict[int, tuple[Block, int, list[dict[str, Any]]]],
    expandable: bool,
) -> list[dict[str, Any]]:
    """The segments at the end, each with the blocks that tile it (held and cached), as
    `_snapshot()` lists them. With expandable segments each pool's mapped pages are one."""
    ranges: list[tuple[int, int, bool]] = []
    for addr, size, small in allocator.mapped:
        if expandable and ranges and any(r[2] == small for r in ranges):
            at = next(i for i, r in enumerate(ranges) if r[2] == small)
            ranges[at] = (ranges[at][0], ranges[at][1] + size, small)
        else:
            ranges.append((addr, size, small))
    blocks: list[tuple[int, dict[str, Any]]] = []
    held_blocks = [(b, n, f, "active_allocated") for b, n, f in held.values()]
    none: list[dict[str, Any]] = []
    cached = [(b, 0, none, "inactive") for b in allocator.cached_blocks()]
    for block, nbytes, frames, state in held_blocks + cached:
        blocks.append(
            (
                block.addr,
                {
                    "address": BASE_ADDRESS + block.addr,
                    "size": block.size,
                    "requested_size": nbytes,
                    "state": state,
                    "frames": frames,
                },
            )
        )
    blocks.sort(key=lambda b: b[0])
    starts = [b[0] for b in blocks]
    segments = []
    for addr, size, small in ranges:
        first, end = bisect.bisect_left(starts, addr), bisect.bisect_left(starts, addr + size)
        inside = [b for _, b in blocks[first:end]]
        if sum(b["size"] for b in inside) != size:
            raise AssertionError(f"blocks of segment {addr:#x} do not tile its {size} bytes")
        used = [b for b in inside if b["state"] == "active_allocated"]
        segments.append(
            {
                "device": 0,
                "address": BASE_ADDRESS + addr,
                "total_size": size,
                "allocated_size": sum(b["size"] for b in used),
                "active_size": sum(b["size"] for b in used),
                "requested_size": sum(b["requested_size"] for b in used),
                "stream": 0,
                "segment_type": "small" if small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": expandable,
                "frames": [],
                "blocks": inside,
            }
        )
    return segments
