"""Host-cache placement: blocks never overlap or leave the pool, pinned blocks are never evicted,
eviction is least-recently-used, and the adapter-count bound holds."""

from __future__ import annotations

import random

import pytest

from stages.loader.host_cache import ALIGN, HostCache, HostCacheFull


def _check_disjoint(cache: HostCache) -> None:
    spans = sorted((b.offset, b.offset + b.nbytes) for b in cache.blocks.values())
    for (_, a1), (b0, _) in zip(spans, spans[1:], strict=False):
        assert a1 <= b0, "two blocks overlap"
    assert all(0 <= s and e <= cache.capacity for s, e in spans)
    assert all(b.offset % ALIGN == 0 for b in cache.blocks.values())


@pytest.mark.parametrize("seed", range(8))
def test_random_reserve_and_evict_keep_blocks_disjoint(seed):
    rng = random.Random(seed)
    cache = HostCache(capacity_bytes=64 * ALIGN, max_adapters=6)
    pinned: set[str] = set()
    for _ in range(300):
        name = f"a{rng.randrange(20)}"
        if cache.get(name) is None:
            try:
                _, evicted = cache.reserve(name, rng.randint(1, 16) * ALIGN - rng.randrange(ALIGN))
            except HostCacheFull:
                assert pinned, "full although nothing was pinned"
                continue
            assert not set(evicted) & pinned, "a pinned block was evicted"
        if rng.random() < 0.2 and name in cache.blocks:
            cache.pin(name)
            pinned.add(name)
        if rng.random() < 0.3 and pinned:
            n = pinned.pop()
            while cache.blocks[n].pins:
                cache.unpin(n)
        assert len(cache.blocks) <= cache.max_adapters
        _check_disjoint(cache)


def test_lru_order_and_count_bound():
    cache = HostCache(capacity_bytes=100 * ALIGN, max_adapters=2)
    cache.reserve("a", ALIGN)
    cache.reserve("b", ALIGN)
    cache.get("a")  # a is now more recent than b
    _, evicted = cache.reserve("c", ALIGN)
    assert evicted == ["b"]
    cache.pin("a")
    cache.pin("c")
    with pytest.raises(HostCacheFull, match="every cached adapter is in use"):
        cache.reserve("d", ALIGN)
    with pytest.raises(HostCacheFull, match="needs"):
        cache.reserve("huge", 101 * ALIGN)


def _gaps(cache: HostCache) -> list[tuple[int, int]]:
    """Free ranges, computed here from the blocks' spans."""
    out, cursor = [], 0
    for start, end in sorted((b.offset, b.offset + b.nbytes) for b in cache.blocks.values()):
        out.append((cursor, start))
        cursor = (end + ALIGN - 1) // ALIGN * ALIGN
    return [*out, (cursor, cache.capacity)]


def _free_bytes(cache: HostCache) -> int:
    """Capacity minus every block's aligned span: what a leak-free cache can still place."""
    return cache.capacity - sum((b.nbytes + ALIGN - 1) // ALIGN * ALIGN for b in cache.blocks.values())


def test_fragmentation_is_resolved_by_lru_eviction_without_overlap_or_leak():
    """Rank-sized blocks (a rank-8 adapter takes 1/8 of a rank-64 one) with no adapter cap: freeing every
    other small block leaves free bytes in holes none of which fits a large block; the reservation then
    evicts least recently used unpinned blocks until one gap is large enough, never a pinned one."""
    rank8, rank64 = 2 * ALIGN, 16 * ALIGN
    cache = HostCache(capacity_bytes=32 * rank8)  # no adapter cap: bytes alone bound it
    for i in range(32):
        cache.reserve(f"s{i}", rank8 - 100)
    assert cache.largest_free() == 0 and _free_bytes(cache) == 0
    for i in range(0, 32, 2):
        cache.drop(f"s{i}")
    for i in (1, 3, 5, 7, 9):
        cache.pin(f"s{i}")  # in use: these must survive
    assert _free_bytes(cache) == 16 * rank8 and cache.largest_free() == rank8  # fragmented
    block, evicted = cache.reserve("big", rank64)
    # LRU order with the pinned ones skipped: s11..s17 go, which opens [10, 19) rank-8 shares
    assert evicted == ["s11", "s13", "s15", "s17"] and block.offset == 10 * rank8
    _check_disjoint(cache)
    assert sum(e - s for s, e in _gaps(cache)) == _free_bytes(cache) == 16 * rank8 - rank64 + 4 * rank8
    # everything released and dropped: the whole pool is one gap again (no leaked bytes)
    for name in list(cache.blocks):
        while cache.blocks[name].pins:
            cache.unpin(name)
        cache.drop(name)
    assert cache.largest_free() == cache.capacity and cache.used_bytes == 0
    assert cache.reserve("whole", cache.capacity)[0].offset == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_ranks_never_overlap_or_leak(seed):
    """Random rank-sized reserves, pins, releases and drops in a byte-sized cache: blocks stay disjoint,
    inside the pool and aligned; used + free always equals capacity; a full reset frees everything."""
    rng = random.Random(seed)
    per_rank = 3 * ALIGN + 512  # rows of a rank are not page multiples: blocks get padded to pages
    cache = HostCache(capacity_bytes=200 * ALIGN)
    for _ in range(400):
        name = f"a{rng.randrange(40)}"
        op = rng.random()
        if name not in cache.blocks and op < 0.6:
            try:
                _, evicted = cache.reserve(name, rng.choice((1, 2, 8, 16, 64)) * per_rank // 4)
            except HostCacheFull as e:  # every block fits an empty pool: only pins can refuse one
                assert e.retryable and any(b.pins for b in cache.blocks.values())
                continue
            assert all(n not in cache.blocks for n in evicted)
        elif name in cache.blocks and op < 0.75:
            cache.pin(name)
        elif name in cache.blocks and op < 0.9:
            cache.unpin(name)
        elif name in cache.blocks and cache.blocks[name].pins == 0:
            cache.drop(name)
        _check_disjoint(cache)
        gaps = _gaps(cache)
        assert sum(e - s for s, e in gaps) == _free_bytes(cache)
        assert cache.largest_free() == max(e - s for s, e in gaps)
    for name in list(cache.blocks):
        cache.drop(name)
    assert cache.largest_free() == cache.capacity
