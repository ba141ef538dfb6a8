"""The caching-allocator simulation against figures worked out by hand from CUDACachingAllocator.cpp's rules."""

from __future__ import annotations

import pytest

from lorafit.trace.allocator import CachingAllocator, round_size

KIB, MIB = 1024, 1024**2


def test_requests_round_up_to_512_bytes() -> None:
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    allocator = CachingAllocator()
    allocator.malloc(1000)
    assert (allocator.requested, allocator.allocated) == (1000, 1024)


def test_a_small_request_reserves_a_2_mib_segment_that_later_small_requests_share() -> None:
    allocator = CachingAllocator()
    allocator.malloc(KIB)
    assert allocator.reserved == 2 * MIB
    for _ in range(2047):  # 2047 more 1 KiB blocks fill the same 2 MiB segment exactly
        allocator.malloc(KIB)
    assert allocator.reserved == 2 * MIB
    allocator.malloc(KIB)
    assert allocator.reserved == 4 * MIB


def test_a_zero_byte_request_allocates_nothing() -> None:
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(0))
    assert allocator.reserved == allocator.peak_allocated == 0


def test_two_6_mib_requests_share_one_20_mib_segment() -> None:
    allocator = CachingAllocator()
    allocator.malloc(6 * MIB)
    allocator.malloc(6 * MIB)
    assert allocator.reserved == 20 * MIB
    assert allocator.allocated == 12 * MIB
    allocator.malloc(6 * MIB)  # 12 + 6 = 18 MiB: the remainder (2 MiB > 1 MiB) was cut off, so it still fits
    assert allocator.reserved == 20 * MIB
    allocator.malloc(6 * MIB)  # 2 MiB left: a second segment
    assert allocator.reserved == 40 * MIB


def test_a_large_request_gets_its_own_segment_rounded_to_2_mib() -> None:
    allocator = CachingAllocator()
    allocator.malloc(30 * MIB)
    assert allocator.reserved == 30 * MIB
    allocator.malloc(30 * MIB + 1)
    assert allocator.reserved == 30 * MIB + 32 * MIB


def test_a_remainder_of_at_most_1_mib_stays_with_the_block_and_counts_as_allocated() -> None:
    allocator = CachingAllocator()
    allocator.malloc(19 * MIB + 512 * KIB)  # over 10 MiB: a segment of its own, rounded up to 20 MiB
    assert allocator.reserved == 20 * MIB
    assert allocator.allocated == 20 * MIB  # the 0.5 MiB remainder is not cut off: memory_allocated counts it


def test_a_freed_block_serves_a_smaller_request_but_not_a_larger_one() -> None:
    allocator = CachingAllocator()
    first = allocator.malloc(30 * MIB)
    allocator.free(first)
    assert (allocator.allocated, allocator.reserved) == (0, 30 * MIB)
    allocator.malloc(12 * MIB)  # best fit: the cached 30 MiB block, cut into 12 + 18
    assert allocator.reserved == 30 * MIB
    allocator.malloc(20 * MIB)  # the 18 MiB left is too small: fragmentation, a new segment
    assert allocator.reserved == 50 * MIB
    assert allocator.cached_free == 18 * MIB
    assert allocator.peak_reserved == 50 * MIB


def test_best_fit_takes_the_smallest_block_that_fits() -> None:
    allocator = CachingAllocator()
    big, small = allocator.malloc(40 * MIB), allocator.malloc(24 * MIB)
    allocator.free(big)
    allocator.free(small)
    allocator.malloc(22 * MIB)  # into the 24 MiB block (remainder 2 MiB is cut off), not the 40 MiB one
    allocator.malloc(40 * MIB)  # so this one still fits without a new segment
    assert allocator.reserved == 64 * MIB


def test_freed_neighbours_merge_within_a_segment() -> None:
    allocator = CachingAllocator()
    whole = allocator.malloc(60 * MIB)
    allocator.free(whole)
    parts = [allocator.malloc(20 * MIB) for _ in range(3)]  # three cuts of the one 60 MiB segment
    assert allocator.reserved == 60 * MIB
    allocator.free(parts[0])
    allocator.free(parts[2])
    allocator.malloc(40 * MIB)  # two free 20 MiB blocks, not adjacent: no room, a new segment
    assert allocator.reserved == 100 * MIB
    allocator.free(parts[1])  # merges with both free neighbours into one 60 MiB block
    allocator.malloc(60 * MIB)
    assert allocator.reserved == 100 * MIB


def test_segments_do_not_merge_with_each_other() -> None:
    allocator = CachingAllocator()
    a, b = allocator.malloc(30 * MIB), allocator.malloc(30 * MIB)
    allocator.free(a)
    allocator.free(b)
    allocator.malloc(60 * MIB)
    assert allocator.reserved == 120 * MIB


def test_the_pools_do_not_lend_to_each_other() -> None:
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(30 * MIB))
    allocator.malloc(KIB)  # a small request never takes a large-pool block
    assert allocator.reserved == 32 * MIB


def test_max_split_size_keeps_big_blocks_whole() -> None:
    allocator = CachingAllocator(max_split_size=100 * MIB)
    allocator.free(allocator.malloc(200 * MIB))
    allocator.malloc(50 * MIB)  # below max_split_size: may not take the oversize block
    assert allocator.reserved == 250 * MIB
    allocator.malloc(190 * MIB)  # within 20 MiB of the cached 200 MiB block: takes it whole
    assert allocator.reserved == 250 * MIB
    assert allocator.allocated == 250 * MIB


def test_expandable_segments_reuse_a_free_tail_for_any_size() -> None:
    allocator = CachingAllocator(expandable=True)
    first = allocator.malloc(30 * MIB)
    assert allocator.reserved == 40 * MIB  # two 20 MiB pages of the large pool's segment
    allocator.free(first)
    allocator.malloc(12 * MIB)
    allocator.malloc(20 * MIB)  # 28 MiB free after the 12: fits without mapping more
    assert allocator.reserved == 40 * MIB
    allocator.malloc(30 * MIB)  # 8 MiB left at the end, 22 more mapped: two pages
    assert allocator.reserved == 80 * MIB
    allocator.malloc(6 * MIB)  # 1-10 MiB: no 20 MiB segment of its own, it goes in the tail (10 MiB left)
    assert allocator.reserved == 80 * MIB


def test_expandable_segments_where_the_plain_allocator_fragments() -> None:
    sizes = [30 * MIB, 50 * MIB, 70 * MIB]  # a growing sequence: each freed block is too small for the next
    plain, expandable = CachingAllocator(), CachingAllocator(expandable=True)
    for allocator in (plain, expandable):
        for size in sizes:
            allocator.free(allocator.malloc(size))
    assert plain.reserved == 150 * MIB
    assert expandable.reserved == 80 * MIB  # the free tail grows to the largest request, in 20 MiB pages


def test_expandable_small_pool_maps_2_mib_pages() -> None:
    allocator = CachingAllocator(expandable=True)
    allocator.malloc(KIB)
    assert allocator.reserved == 2 * MIB


def test_expandable_prefers_a_hole_to_the_growable_tail() -> None:
    allocator = CachingAllocator(expandable=True)
    hole = allocator.malloc(20 * MIB)
    allocator.malloc(20 * MIB)
    allocator.free(hole)
    allocator.malloc(10 * MIB)  # into the hole at the start, not the mapped tail (there is none) or new pages
    assert allocator.reserved == 40 * MIB


def test_cancel_right_after_malloc_leaves_no_trace() -> None:
    allocator = CachingAllocator()
    allocator.malloc(4 * MIB)
    allocator.cancel(allocator.malloc(200 * MIB))
    assert (allocator.reserved, allocator.peak_reserved, allocator.peak_allocated) == (20 * MIB, 20 * MIB, 4 * MIB)


@pytest.mark.parametrize("expandable", [False, True])
def test_reserved_never_falls_below_allocated(expandable: bool) -> None:
    import random

    rng = random.Random(0)
    allocator = CachingAllocator(expandable=expandable)
    live: list[int] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(allocator.malloc(rng.choice([KIB, 300 * KIB, 3 * MIB, 17 * MIB, 64 * MIB])))
        assert allocator.allocated <= allocator.reserved
        assert allocator.allocated + allocator.cached_free == allocator.reserved
    for handle in live:
        allocator.free(handle)
    assert allocator.allocated == 0 and allocator.cached_free == allocator.reserved
