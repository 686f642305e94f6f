"""The caching allocator model on hand-built sequences, each reserved figure worked out by
hand from torch's rules (`c10/cuda/CUDACachingAllocator.cpp`). No GPU here: these check the
model against the rules as read, not against torch's allocator itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workbench.cost.allocator import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    AllocatorConfig,
    CachingAllocator,
    allocation_size,
    replay_allocator,
    round_size,
)
from workbench.errors import WorkbenchError

MiB = 2**20


def test_sizes_round_to_512_bytes_and_small_requests_share_a_2_mib_segment() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(1)
    b = alloc.malloc(513)
    assert (a.size, b.size) == (512, 1024)
    assert alloc.reserved_bytes == K_SMALL_BUFFER and alloc.segments == 1
    assert alloc.allocated_bytes == 1536
    assert round_size(0) == 512 and allocation_size(MiB) == K_SMALL_BUFFER


def test_a_third_mib_needs_a_second_small_segment() -> None:
    alloc = CachingAllocator()
    for _ in range(2):
        alloc.malloc(MiB)  # the first splits off 1 MiB (>= 512 B), the second takes it
    assert alloc.reserved_bytes == 2 * MiB
    alloc.malloc(MiB)
    assert alloc.reserved_bytes == 4 * MiB and alloc.segments == 2


def test_medium_requests_split_a_20_mib_segment_large_ones_round_to_2_mib() -> None:
    alloc = CachingAllocator()
    alloc.malloc(3 * MiB)  # 1-10 MiB: a 20 MiB segment, 17 MiB split off (> 1 MiB)
    alloc.malloc(3 * MiB)  # from the remainder
    assert alloc.reserved_bytes == K_LARGE_BUFFER
    alloc.malloc(11 * MiB)  # fits in the 14 MiB left
    assert alloc.reserved_bytes == K_LARGE_BUFFER
    alloc.malloc(15 * MiB - 100)  # >= 10 MiB, nothing cached fits: 16 MiB of its own
    assert alloc.reserved_bytes == 36 * MiB and alloc.segments == 2


def test_a_remainder_of_at_most_1_mib_stays_with_the_block() -> None:
    alloc = CachingAllocator()
    block = alloc.malloc(19 * MiB + MiB // 2)  # segment of 20 MiB, 0.5 MiB left: no split
    assert block.size == 20 * MiB
    assert alloc.allocated_bytes == 20 * MiB  # torch counts the whole block as allocated


def test_best_fit_reuses_the_smallest_cached_block() -> None:
    alloc = CachingAllocator()
    a, b = alloc.malloc(12 * MiB), alloc.malloc(16 * MiB)
    alloc.free(a)
    alloc.free(b)
    c = alloc.malloc(11 * MiB)  # 12 MiB block fits best; 1 MiB left is not split
    assert c.size == 12 * MiB
    assert alloc.reserved_bytes == 28 * MiB


def test_fragmentation_then_merge() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(8 * MiB)  # 20 MiB segment: [a 8 | 12 free]
    b = alloc.malloc(8 * MiB)  # [a 8 | b 8 | 4 free]
    c = alloc.malloc(4 * MiB)  # [a 8 | b 8 | c 4]
    alloc.free(a)
    alloc.free(c)  # 12 MiB free in the segment, but in two pieces around b
    d = alloc.malloc(10 * MiB)  # no piece fits: a new 10 MiB segment
    assert alloc.reserved_bytes == 30 * MiB
    assert alloc.allocated_bytes == 18 * MiB
    alloc.free(b)  # a, b and c merge back into one 20 MiB block
    e = alloc.malloc(20 * MiB)
    assert alloc.reserved_bytes == 30 * MiB
    assert e.size == 20 * MiB and d.size == 10 * MiB


def test_expandable_segments_grow_by_20_mib_pages() -> None:
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True))
    alloc.malloc(8 * MiB)  # one 20 MiB page: [8 | 12 free]
    assert alloc.reserved_bytes == 20 * MiB
    alloc.malloc(16 * MiB)  # 12 free at the end + one more page: [8 | 16 | 16 free]
    assert alloc.reserved_bytes == 40 * MiB
    alloc.malloc(16 * MiB)  # the 16 MiB left, no new page
    assert alloc.reserved_bytes == 40 * MiB and alloc.segments == 1
    # without expandable segments: 20 MiB for the 8, then a 16 MiB segment each
    plain = CachingAllocator()
    for size in (8, 16, 16):
        plain.malloc(size * MiB)
    assert plain.reserved_bytes == 52 * MiB


def test_expandable_segments_fill_the_fragmented_tail() -> None:
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a = alloc.malloc(8 * MiB)
    alloc.malloc(8 * MiB)
    c = alloc.malloc(4 * MiB)  # one page, full: [a 8 | b 8 | c 4]
    alloc.free(a)
    alloc.free(c)
    alloc.malloc(10 * MiB)  # c's 4 MiB at the end + one page: 24 MiB, 10 taken
    assert alloc.reserved_bytes == 40 * MiB
    alloc.malloc(14 * MiB)  # the rest of that block exactly
    alloc.malloc(8 * MiB)  # a's old place
    assert alloc.reserved_bytes == 40 * MiB
    assert alloc.allocated_bytes == 40 * MiB


def test_a_freed_block_serves_only_its_own_streams_requests() -> None:
    """`get_free_block` searches the pool by stream: 30 MiB freed on stream 1 is cached for
    stream 1 alone; the default stream's request of the same size takes a segment of its
    own, and stream 1's next request reuses its block."""
    alloc = CachingAllocator()
    side = alloc.malloc(30 * MiB, stream=1)
    assert side.stream == 1
    alloc.free(side)
    default = alloc.malloc(30 * MiB)
    assert default.stream == 0 and default.addr != side.addr
    assert alloc.reserved_bytes == 60 * MiB
    again = alloc.malloc(30 * MiB, stream=1)
    assert again is side and alloc.reserved_bytes == 60 * MiB
    assert alloc.reserved_by_stream == {0: 30 * MiB, 1: 30 * MiB}
    # split remainders stay with their stream: 10 MiB left of stream 1's 30 is not stream 0's
    alloc.free(again)
    alloc.malloc(20 * MiB, stream=1)
    alloc.malloc(10 * MiB)
    assert alloc.reserved_by_stream == {0: 40 * MiB, 1: 30 * MiB}


def test_expandable_segments_are_one_per_stream() -> None:
    """With expandable segments each stream maps pages into a segment of its own: a page
    stream 1 freed is not grown into by the default stream."""
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True))
    alloc.free(alloc.malloc(8 * MiB, stream=1))
    alloc.malloc(8 * MiB)
    assert alloc.reserved_by_stream == {1: 20 * MiB, 0: 20 * MiB} and alloc.segments == 2
    alloc.malloc(12 * MiB, stream=1)  # stream 1's page, free again: no new page
    assert alloc.reserved_bytes == 40 * MiB


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    config = AllocatorConfig(max_split_size=40 * MiB)
    alloc = CachingAllocator(config)
    alloc.free(alloc.malloc(64 * MiB))
    alloc.malloc(30 * MiB)  # under the limit: may not take the oversize 64 MiB block
    assert alloc.reserved_bytes == 94 * MiB
    big = alloc.malloc(50 * MiB)  # over the limit, within 20 MiB of 64: takes it whole
    assert big.size == 64 * MiB and alloc.reserved_bytes == 94 * MiB
    plain = CachingAllocator()
    plain.free(plain.malloc(64 * MiB))
    assert plain.malloc(30 * MiB).size == 30 * MiB and plain.reserved_bytes == 64 * MiB


def test_max_split_size_must_be_above_20_mib() -> None:
    with pytest.raises(WorkbenchError, match="max_split_size"):
        AllocatorConfig(max_split_size=MiB)


def test_replay_allocates_then_frees_per_step_and_never_returns() -> None:
    # storage 0 lives steps 0-1, storage 1 is born at 1 and held; 2 is empty
    sizes = np.array([12 * MiB, 12 * MiB, 0])
    born, freed = np.array([0, 1, 0]), np.array([1, 3, 3])
    got = replay_allocator(sizes, born, freed, steps=3, before=[MiB])
    # the optimizer's MiB in a small segment; both 12 MiB live at step 1: two segments
    assert got.reserved_timeline == [2 * MiB + 12 * MiB, 2 * MiB + 24 * MiB, 26 * MiB]
    assert got.reserved_peak_bytes == 26 * MiB
    assert got.allocated_peak_bytes == MiB + 24 * MiB
    reused = replay_allocator(sizes, born, np.array([0, 3, 3]), steps=3)
    assert reused.reserved_peak_bytes == 12 * MiB  # freed after step 0, reused at step 1


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    from workbench.cli import main

    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_and_solve_report_reserved_beside_allocated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = ["--model", "llama3-debug", "--layers", "1", "--seq", "32"]
    est = _run(capsys, ["estimate", *model, "--profile", "h100", "--timeline"])
    for key in (
        "peak_bytes",
        "reserved_peak_bytes",
        "exposed_comm_seconds",
        "est_compute_seconds",
        "est_comm_seconds",
        "outside_allocator_bytes",
    ):
        assert key in est
    assert est["reserved_peak_bytes"] >= est["peak_bytes"]  # type: ignore[operator]
    assert max(est["reserved_timeline"]) == est["reserved_peak_bytes"]  # type: ignore[call-overload]
    budget = int(est["reserved_peak_bytes"])  # type: ignore[call-overload]
    solved = _run(
        capsys, ["solve", *model, "--budget-bytes", str(budget), "--budget-kind", "reserved"]
    )
    assert solved["budget_kind"] == "reserved"
    assert solved["reserved_peak_bytes"] <= budget  # type: ignore[operator]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the skip without CUDA")
def test_bench_gpu_says_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    result = _run(capsys, ["bench", "gpu", "--model", "llama3-1b", "--dtype", "bfloat16"])
    assert result == {"skipped": "no CUDA device here: bench gpu measures on one", "presets": []}


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_bench_gpu_estimates_beside_torchs_counters(capsys: pytest.CaptureFixture[str]) -> None:
    model = ["--model", "llama3-debug", "--layers", "2", "--seq", "64", "--dtype", "bfloat16"]
    result = _run(capsys, ["bench", "gpu", *model, "--presets", "none,full", "--repeat", "1"])
    for row in result["presets"]:  # type: ignore[attr-defined]
        assert row["bitwise_equal"]
        assert row["max_memory_reserved"] >= row["max_memory_allocated"]
