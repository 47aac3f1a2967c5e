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
