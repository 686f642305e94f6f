"""What torch's CUDA caching allocator reserves for a sequence of allocations and frees.

Entry points: `CachingAllocator(AllocatorConfig(...))` with `malloc(nbytes, stream) -> block`
and `free(block)`, `replay_allocator(sizes, born, freed, steps, config)` for an estimate's walk,
and `allocation_steps`, the order that replay (and the estimate's memory snapshot) runs in.
The rules are those of `c10/cuda/CUDACachingAllocator.cpp` (torch 2.x, named per constant
and function below) for one device, with no memory limit. Each stream has pools of its own:
a freed block serves only requests made on the stream it was allocated on (`get_free_block`
searches by stream first; expandable segments are per stream too), so what an eager FSDP2
step allocates on its all-gather and reduce-scatter streams is never reused by the compute
stream. Nothing is ever released to CUDA within a step (torch returns cached segments only
when a cudaMalloc fails, on `empty_cache()`, or under a garbage-collection threshold, none of
which a step that fits runs into), so the reserved bytes only grow.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "AllocatorConfig",
    "AllocatorReplay",
    "Block",
    "CachingAllocator",
    "allocation_size",
    "allocation_steps",
    "replay_allocator",
    "round_size",
]

# c10/cuda/CUDACachingAllocator.cpp, constants of the same names:
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # kSmallSize: the largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # kSmallBuffer: small allocations are packed in 2 MiB segments
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: requests of 1-10 MiB take a kLargeBuffer
K_LARGE_BUFFER = 20971520  # kLargeBuffer: "large" allocations may be packed in 20 MiB
K_ROUND_LARGE = 2097152  # kRoundLarge: larger requests are rounded up to 2 MiB
MAX_SPLIT_SIZE = 2**40  # a max_split_size above any GPU's memory splits like none at all


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorConfig:
    """The `PYTORCH_CUDA_ALLOC_CONF` settings the model follows (torch's docs, "CUDA
    semantics: optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF")."""

    expandable_segments: bool = False
    """`expandable_segments:True`: one segment per pool that grows by pages (kSmallBuffer
    for the small pool, kLargeBuffer for the large one; `find_expandable_block`), and any
    remainder of at least kMinBlockSize is split off (`should_split`)."""

    max_split_size: int | None = None
    """`max_split_size_mb` in bytes; None is torch's default (SIZE_MAX: any block may be
    split). Blocks of at least this size are never split, and serve only requests of at
    least this size within kLargeBuffer of theirs (`get_free_block`)."""

    def __post_init__(self) -> None:
        from workbench.errors import WorkbenchError, check_int, check_type

        check_type("expandable_segments", self.expandable_segments, bool, "True or False")
        size = self.max_split_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
            raise WorkbenchError(f"max_split_size must be bytes (an int) or None, got {size!r}")
        if size is not None and size <= K_LARGE_BUFFER:
            # torch's parser refuses max_split_size_mb at or below kLargeBuffer's 20 MiB
            raise WorkbenchError(
                f"max_split_size must be above {K_LARGE_BUFFER} bytes (20 MiB, torch's "
                f"kLargeBuffer) or None, got {size}"
            )
        if size is not None:
            check_int("max_split_size", size, 1, MAX_SPLIT_SIZE, "1 TiB: above any GPU's memory")

    @property
    def split_limit(self) -> int:
        return self.max_split_size if self.max_split_size is not None else 2**64 - 1


def round_size(nbytes: int) -> int:
    """`round_size` with no `roundup_power2_divisions`: up to a multiple of 512 bytes.

    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * -(-nbytes // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the segment cudaMalloc'd for a rounded request no cached
    block serves.

    >>> allocation_size(512), allocation_size(2 * 2**20), allocation_size(11 * 2**20)
    (2097152, 20971520, 12582912)
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)


@dataclass(eq=False)
class Block:
    """A range of one segment: allocated or cached free; `prev`/`next` are its neighbours
    in the segment (torch's `Block`); `mapped` is False for an expandable segment's
    not-yet-backed tail."""

    addr: int
    size: int
    small: bool
    allocated: bool = False
    mapped: bool = True
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    expandable: bool = False
    stream: int = 0


class CachingAllocator:
    """One device's pools (small and large) per stream (0: the default stream).
    `reserved_bytes` counts what was cudaMalloc'd (or mapped, with expandable segments), and
    `reserved_by_stream` the same per stream; `allocated_bytes` the blocks handed out (rounded
    sizes, as `torch.cuda.memory_allocated` counts them); `mapped` the address, bytes and pool
    (small or not) of each cudaMalloc, or of each page run mapped with expandable segments, in
    order."""

    def __init__(self, config: AllocatorConfig | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.mapped: list[tuple[int, int, bool]] = []
        # free blocks of each pool of each stream ordered by (size, address):
        # `BlockComparatorSize`; a pool's key is `stream << 1 | small`, cheap on the hot path
        self._free: dict[int, list[tuple[int, int, Block]]] = {}
        self._tail: dict[int, Block] = {}  # expandable: each pool's unmapped tail
        self._next_addr = 0
        self.reserved_bytes = 0
        self.reserved_by_stream: dict[int, int] = {}
        self.allocated_bytes = 0
        self.segments = 0

    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        """`DeviceCachingAllocator::malloc` on `stream`: round, best fit in that stream's
        pool, else a new segment (or pages mapped), then split off the remainder when
        `should_split`."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._free_block(size, small, stream) or self._new_block(size, small, stream)
        if self._should_split(block, size):
            rest = Block(
                block.addr + size,
                block.size - size,
                small,
                expandable=block.expandable,
                stream=stream,
            )
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.allocated = True
        self.allocated_bytes += block.size
        return block

    def free(self, block: Block) -> None:
        """`free_block`: merge with free neighbours of the same segment, back to the pool;
        nothing goes back to CUDA."""
        block.allocated = False
        self.allocated_bytes -= block.size
        for other in (block.prev, block.next):
            if other is None or other.allocated or other.mapped != block.mapped:
                continue
            self._remove(other)
            if other is block.prev:
                block.addr, block.prev = other.addr, other.prev
                if other.prev is not None:
                    other.prev.next = block
            else:
                block.next = other.next
                if other.next is not None:
                    other.next.prev = block
            block.size += other.size
        self._insert(block)

    def cached_blocks(self) -> list[Block]:
        """The free blocks every pool caches, in no particular order (an expandable segment's
        unmapped tail is not one)."""
        return [block for pool in self._free.values() for _, _, block in pool]

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.config.split_limit and remaining > K_SMALL_SIZE

    def _free_block(self, size: int, small: bool, stream: int) -> Block | None:
        """`get_free_block`: the smallest cached block of at least `size` allocated on
        `stream`; with expandable segments a block before unmapped pages counts as the size it
        can grow to, so a smaller-growing larger block is preferred; oversize rules of
        `max_split_size`."""
        pool = self._free.get(stream << 1 | small)
        if not pool:
            return None
        at = bisect.bisect_left(pool, (size, -1))
        if at == len(pool):
            return None
        if pool[at][2].expandable:
            while at + 1 < len(pool) and self._growable(pool[at + 1][2]) < self._growable(
                pool[at][2]
            ):
                at += 1
        block = pool[at][2]
        limit = self.config.split_limit
        if size < limit <= block.size or size >= limit and block.size >= size + K_LARGE_BUFFER:
            return None
        del pool[at]
        return block

    @staticmethod
    def _growable(block: Block) -> int:
        nxt = block.next
        return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

    def _reserve(self, nbytes: int, stream: int) -> None:
        self.reserved_bytes += nbytes
        self.reserved_by_stream[stream] = self.reserved_by_stream.get(stream, 0) + nbytes

    def _new_block(self, size: int, small: bool, stream: int) -> Block:
        if self.config.expandable_segments:
            return self._map(size, small, stream)
        segment = allocation_size(size)  # `alloc_block`: one cudaMalloc
        block = Block(self._next_addr, segment, small, stream=stream)
        self.mapped.append((block.addr, segment, small))
        self._next_addr += segment
        self._reserve(segment, stream)
        self.segments += 1
        return block

    def _map(self, size: int, small: bool, stream: int) -> Block:
        """`try_allocate_expandable_block`: grow the stream's one segment of the pool at its
        end by whole pages (kSmallBuffer or kLargeBuffer, the segment's page size), merging
        with a free block just before the unmapped tail."""
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        key = stream << 1 | small
        if key not in self._tail:
            tail = Block(
                self._next_addr, 2**62, small, mapped=False, expandable=True, stream=stream
            )
            self._next_addr += 2**62
            self._tail[key] = tail
            self.segments += 1
        tail = self._tail[key]
        before = tail.prev
        start = before if before is not None and not before.allocated else None
        have = start.size if start is not None else 0
        grow = page * -(-(size - have) // page)
        self._reserve(grow, stream)
        self.mapped.append((tail.addr, grow, small))
        block = Block(
            tail.addr, grow, small, prev=tail.prev, next=tail, expandable=True, stream=stream
        )
        if tail.prev is not None:
            tail.prev.next = block
        tail.prev, tail.addr, tail.size = block, tail.addr + grow, tail.size - grow
        if start is not None:  # merge the free block before the new pages into them
            self._remove(start)
            block.addr, block.size, block.prev = start.addr, block.size + start.size, start.prev
            if start.prev is not None:
                start.prev.next = block
        return block

    def _insert(self, block: Block) -> None:
        key = block.stream << 1 | block.small
        try:
            pool = self._free[key]
        except KeyError:  # a stream's first free block of this pool
            pool = self._free[key] = []
        bisect.insort(pool, (block.size, block.addr, block))

    def _remove(self, block: Block) -> None:
        pool = self._free[block.stream << 1 | block.small]
        at = bisect.bisect_left(pool, (block.size, block.addr))
        del pool[at]


@dataclass
class AllocatorReplay:
    """One step's allocator figures: reserved bytes after each step of the node order and
    their peak, the allocated bytes torch counts (sizes rounded by `round_size`) and their
    peak (`max_memory_allocated`), the segments made and, per stream, the bytes its pools
    reserved (0: the default stream)."""

    reserved_peak_bytes: int
    allocated_peak_bytes: int
    segments: int
    reserved_timeline: list[int]
    reserved_by_stream: dict[int, int] = field(default_factory=dict)


def allocation_steps(
    sizes: np.ndarray, born: np.ndarray, freed: np.ndarray, steps: int
) -> Iterator[tuple[int, list[int], list[int]]]:
    """Per step of a walk: the step, the storages allocated there (in storage order), then
    the storages freed after it (in order of their free step, then storage order). A storage
    freed at `steps` or later is held to the end; an empty one takes no block (torch hands
    out no memory for it), so it appears in neither list.

    >>> sizes, born, freed = np.array([8, 0, 4]), np.array([0, 0, 1]), np.array([1, 1, 9])
    >>> list(allocation_steps(sizes, born, freed, 2))
    [(0, [0], []), (1, [2], [0])]
    """
    index = np.flatnonzero(sizes > 0)
    born_order = index[np.argsort(born[index], kind="stable")]
    dying = index[freed[index] < steps]
    free_order = dying[np.argsort(freed[dying], kind="stable")]
    b_ids, f_ids = born_order.tolist(), free_order.tolist()
    b_end = np.searchsorted(born[born_order], np.arange(steps), side="right").tolist()
    f_end = np.searchsorted(freed[free_order], np.arange(steps), side="right").tolist()
    b_at = f_at = 0
    for step in range(steps):
        yield step, b_ids[b_at : b_end[step]], f_ids[f_at : f_end[step]]
        b_at, f_at = b_end[step], f_end[step]


def replay_allocator(
    sizes: np.ndarray,
    born: np.ndarray,
    freed: np.ndarray,
    steps: int,
    config: AllocatorConfig | None = None,
    before: list[int] | None = None,
) -> AllocatorReplay:
    """Run an estimate's storages through the allocator: `before` (bytes allocated ahead of
    the step and held: optimizer state) first, then each step of `allocation_steps`."""
    allocator = CachingAllocator(config)
    for nbytes in before or []:
        allocator.malloc(nbytes)
    blocks: dict[int, Block] = {}
    timeline = np.zeros(steps, dtype=np.int64)
    allocated_peak = allocator.allocated_bytes
    size_list = sizes.tolist()
    for step, allocated, released in allocation_steps(sizes, born, freed, steps):
        for i in allocated:
            blocks[i] = allocator.malloc(int(size_list[i]))
        allocated_peak = max(allocated_peak, allocator.allocated_bytes)
        timeline[step] = allocator.reserved_bytes
        for i in released:
            allocator.free(blocks.pop(i))
    return AllocatorReplay(
        reserved_peak_bytes=allocator.reserved_bytes,
        allocated_peak_bytes=allocated_peak,
        segments=allocator.segments,
        reserved_timeline=timeline.tolist(),
        reserved_by_stream=dict(allocator.reserved_by_stream),
    )
