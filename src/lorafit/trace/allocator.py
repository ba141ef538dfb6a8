"""A simulation of PyTorch's CUDA caching allocator: what `torch.cuda.memory_reserved()` would say for a
sequence of allocations and frees.

It follows `c10/cuda/CUDACachingAllocator.cpp` as of torch 2.4-2.9 (the `DeviceCachingAllocator` paths a
single-stream training step takes; the rules below have not changed in that range), block by block:

- `round_size`: every request is rounded up to a multiple of 512 B (`kMinBlockSize`, also the minimum); a
  request of 0 bytes allocates nothing. (`roundup_power2_divisions` is off by default and not modelled.)
- `get_pool`: requests of at most 1 MiB (`kSmallSize`) go to the small pool, the rest to the large pool. The
  pools never lend each other blocks.
- `get_free_block`: best fit among the pool's cached free blocks: the smallest block of at least the rounded
  size, ties broken by the lower address (the pool is a `std::set` ordered by size, then address). With
  `max_split_size` set, a request below it never takes a block at or above it, and a request at or above it
  takes a block only within `max_non_split_rounding_size` (20 MiB by default) of its size.
- `get_allocation_size`, on a miss: a new segment (`cudaMalloc`) of 2 MiB (`kSmallBuffer`) for the small pool,
  20 MiB (`kLargeBuffer`) for large requests under 10 MiB (`kMinLargeAlloc`), else the request rounded up to
  a multiple of 2 MiB (`kRoundLarge`).
- `alloc_found_block` / `should_split`: the block is cut at the request's size, the request at the lower
  address, when the remainder is at least 512 B (small pool) or more than 1 MiB (large pool, and only for a
  request below `max_split_size`). An uncut block is handed out whole, and `memory_allocated()` counts all of
  it: the simulation's `allocated` counts block sizes the same way, `requested` the bytes asked for.
- `free_block` / `try_merge_blocks`: a freed block merges with its free neighbours in the same segment.
- Segments are never given back: no `empty_cache()` runs inside a training step, the out-of-memory retry that
  frees cached blocks needs a device limit this simulation does not have, and the garbage collector
  (`garbage_collection_threshold`) only runs under a per-process memory fraction. So `reserved` is the sum of
  the segments cut so far, and it only grows.

`expandable=True` is `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (Note [Expandable Segments] in the same
file): each pool has one segment with a virtual address range far larger than the GPU, mapped on demand in
pages of 2 MiB (small pool) or 20 MiB (large pool: `kLargeBuffer`, the page size the note gives for the large
pool, to bound the number of physical handles to map). On a miss, `find_expandable_block` takes the lowest
unmapped range (with the free block right before it, if any) and `map_block` maps just enough pages to cover
the request; the free tail of the mapped range therefore serves a request of any size, and `reserved` is the
mapped pages. `should_split` cuts every block whose remainder is at least 512 B, and `get_free_block` ranks
the free block at the end of the mapping by the size it could grow to, so it is taken last. Pages are only
unmapped on an out-of-memory retry or `empty_cache()`, neither of which happens here.

One stream is simulated: a single-GPU training step allocates on the default stream only (the backward runs on
the stream of the forward). Not seen here, because the dispatcher never shows them: allocations made inside a
kernel's C++ (cuBLAS workspaces, flash-attention's scratch), which the real allocator serves from the same pools.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER_BYTES = 2 << 20  # kSmallBuffer: a small-pool segment (and expandable small-pool page)
LARGE_BUFFER_BYTES = 20 << 20  # kLargeBuffer: the segment of a 1-10 MiB request (and expandable large-pool page)
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc: from here on a request gets a segment of its own size
ROUND_LARGE_BYTES = 2 << 20  # kRoundLarge: what such a segment is rounded up to
UNLIMITED = 2**63  # max_split_size's default (SIZE_MAX)
_VIRTUAL_BYTES = 1 << 44  # an expandable segment's address range; no step comes near it


def round_size(nbytes: int) -> int:
    """A request's block size: a multiple of 512 B, at least 512 B."""
    return max(MIN_BLOCK_BYTES, -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def allocation_size(size: int) -> int:
    """The segment cut for a (rounded) request no cached block can serve."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    pool: _Pool
    allocated: bool = False
    mapped: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass(eq=False)
class _Pool:
    small: bool
    free: list[tuple[int, int]] = field(default_factory=list)  # (size, address) of the cached free blocks
    by_addr: dict[int, _Block] = field(default_factory=dict)
    unmapped: list[int] = field(default_factory=list)  # addresses of unmapped blocks (expandable segments)
    unmapped_by_addr: dict[int, _Block] = field(default_factory=dict)

    def insert(self, block: _Block) -> None:
        if block.mapped:
            bisect.insort(self.free, (block.size, block.addr))
            self.by_addr[block.addr] = block
        else:
            bisect.insort(self.unmapped, block.addr)
            self.unmapped_by_addr[block.addr] = block

    def remove(self, block: _Block) -> None:
        if block.mapped:
            del self.free[bisect.bisect_left(self.free, (block.size, block.addr))]
            del self.by_addr[block.addr]
        else:
            del self.unmapped[bisect.bisect_left(self.unmapped, block.addr)]
            del self.unmapped_by_addr[block.addr]


class CachingAllocator:
    """Blocks and segments of one device's caching allocator; `malloc` returns a handle for `free`."""

    def __init__(self, expandable: bool = False, max_split_size: int = UNLIMITED) -> None:
        self.expandable = expandable
        self.max_split_size = max_split_size
        self.max_non_split_rounding = LARGE_BUFFER_BYTES
        self._pools = (_Pool(small=True), _Pool(small=False))
        self._next_addr = 1 << 40
        self._handles: dict[int, _Block | None] = {}
        self._last_handle = 0
        self._undo: tuple[int, int, int, list[_Block]] | None = None  # what `cancel` may undo
        self.allocated = 0  # memory_allocated(): the blocks handed out
        self.requested = 0  # the bytes asked for
        self.reserved = 0  # memory_reserved(): the segments (mapped pages) held
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments = 0  # cudaMalloc calls (expandable: page mappings)
        self._requested_by_handle: dict[int, int] = {}

    # --- the public calls ----------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        """Allocate `nbytes`; returns a handle for `free`."""
        self._last_handle += 1
        handle = self._last_handle
        self._undo = None
        if nbytes <= 0:
            self._handles[handle] = None
            return handle
        undo = (handle, self.peak_allocated, self.peak_reserved, [])
        size = round_size(nbytes)
        pool = self._pools[0] if size <= SMALL_SIZE_BYTES else self._pools[1]
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._expandable_block(pool, size) if self.expandable else self._new_segment(pool, size)
            undo[3].append(block)
        block = self._alloc_found_block(block, size)
        self._handles[handle] = block
        self._requested_by_handle[handle] = nbytes
        self.allocated += block.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._undo = undo
        return handle

    def free(self, handle: int) -> None:
        """Return the block behind `handle` to its pool's cache."""
        self._undo = None
        block = self._handles.pop(handle)
        if block is None:
            return
        self.requested -= self._requested_by_handle.pop(handle)
        self.allocated -= block.size
        block.allocated = False
        for neighbour in (block.prev, block.next):
            self._try_merge(block, neighbour)
        block.pool.insert(block)

    def cancel(self, handle: int) -> None:
        """Take back the allocation just made, as if it had never reached the device (a host copy or managed
        memory the trace only learns about after the op returned). Right after its `malloc` this restores the
        previous state exactly, peaks and segments included (expandable: pages it mapped stay mapped, as a free
        tail the next request uses); later it is the same as `free`."""
        undo = self._undo
        self.free(handle)
        if undo is None or undo[0] != handle:
            return
        _, peak_allocated, peak_reserved, created = undo
        if created:
            if self.expandable:
                return
            segment = created[0]
            while segment.prev is not None:
                segment = segment.prev
            if segment.next is not None or segment.allocated:  # not whole and free again
                return
            segment.pool.remove(segment)
            self.reserved -= segment.size
            self.segments -= 1
        self.peak_allocated, self.peak_reserved = peak_allocated, peak_reserved

    # --- the allocator's own steps -------------------------------------------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        index = bisect.bisect_left(pool.free, (size, 0))
        if index == len(pool.free):
            return None
        block = pool.by_addr[pool.free[index][1]]
        if self.expandable:
            # a free block at the end of the mapping counts as the size it can grow to
            while index + 1 < len(pool.free):
                following = pool.by_addr[pool.free[index + 1][1]]
                if _expandable_size(following) >= _expandable_size(block):
                    break
                index, block = index + 1, following
        if size < self.max_split_size <= block.size:
            return None
        if size >= self.max_split_size and block.size >= size + self.max_non_split_rounding:
            return None
        pool.remove(block)
        return block

    def _new_segment(self, pool: _Pool, size: int) -> _Block:
        segment_bytes = allocation_size(size)
        block = _Block(self._next_addr, segment_bytes, pool)
        self._next_addr += segment_bytes
        self._grow(segment_bytes)
        return block

    def _expandable_block(self, pool: _Pool, size: int) -> _Block:
        """try_allocate_expandable_block: the lowest address with room for `size`, mapped as far as needed."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped:
            candidate = self._map_block(candidate, min(candidate.size, size))
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            candidate = self._map_block(following, min(size - candidate.size, following.size))
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        def has_room(block: _Block | None) -> bool:
            room = 0
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            return room >= size

        for addr in pool.unmapped:
            candidate = pool.unmapped_by_addr[addr]
            if candidate.prev is not None and not candidate.prev.allocated:
                candidate = candidate.prev
            if has_room(candidate):
                return candidate
        block = _Block(self._next_addr, _VIRTUAL_BYTES, pool, mapped=False)  # a new segment: all unmapped
        self._next_addr += _VIRTUAL_BYTES
        pool.insert(block)
        return block

    def _map_block(self, block: _Block, size: int) -> _Block:
        """Map the pages that cover the first `size` bytes of an unmapped block; merge it with free neighbours."""
        page = SMALL_BUFFER_BYTES if block.pool.small else LARGE_BUFFER_BYTES
        mapped_bytes = -(-size // page) * page
        pool = block.pool
        pool.remove(block)
        if mapped_bytes < block.size:
            rest = _Block(block.addr + mapped_bytes, block.size - mapped_bytes, pool, mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = mapped_bytes
            pool.insert(rest)
        block.mapped = True
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.insert(block)
        self._grow(mapped_bytes)
        return block

    def _alloc_found_block(self, block: _Block, size: int) -> _Block:
        remaining = block.size - size
        if block.pool.small or self.expandable:
            split = remaining >= MIN_BLOCK_BYTES
        else:
            split = size < self.max_split_size and remaining > SMALL_SIZE_BYTES
        if split:
            rest = _Block(block.addr + size, remaining, block.pool)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            block.pool.insert(rest)
        block.allocated = True
        return block

    def _try_merge(self, dst: _Block, src: _Block | None) -> None:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        src.pool.remove(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    # --- for the reader ------------------------------------------------------------------------------------
    @property
    def cached_free(self) -> int:
        """Reserved but not handed out: the free blocks of every pool (mapped ones only)."""
        return sum(size for pool in self._pools for size, _ in pool.free)


def _expandable_size(block: _Block) -> int:
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)
