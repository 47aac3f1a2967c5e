"""Pool accounting under forced fragmentation: many randomized mixed-rank loads and evictions, each
checked against an independent per-row owner array. No row is ever given to two adapters, no row leaks,
free runs stay coalesced, best fit keeps an adapter in one run whenever one free run holds it, and the
pool's capacity follows rows, not a slot count."""

from __future__ import annotations

import random

import pytest

from stages.scheduler.pool_table import PoolTable
from stages.scheduler.row_allocator import RowAllocator


def _check(table: PoolTable, owner: list[str | None]) -> None:
    rows = table.rows
    for start, n in rows.free_runs:
        assert all(owner[r] is None for r in range(start, start + n)), "a free run holds an owned row"
    runs = rows.free_runs
    assert all(a[0] + a[1] < b[0] for a, b in zip(runs, runs[1:], strict=False)), "free runs not coalesced"
    assert rows.num_free == sum(n for _, n in runs) == owner.count(None), "row count drifted (a leak)"
    ids = [res.lora_id for res in table.residents.values()]
    assert len(ids) == len(set(ids)) and table.free_ids + len(ids) == table.num_ids, "ids leaked or shared"
    for name, res in table.residents.items():
        mine = [s + k for s, n in res.runs for k in range(n)]
        assert all(owner[r] == name for r in mine), f"{name}'s rows are not all its own"
        assert len(mine) == owner.count(name), f"{name} owns rows outside its runs"


@pytest.mark.parametrize("seed", range(20))
def test_random_mixed_rank_churn_never_overlaps_or_leaks(seed):
    rng = random.Random(seed)
    total = rng.choice([64, 100, 257])
    table = PoolTable(total, num_ids=rng.choice([8, 32, 64]))
    owner: list[str | None] = [None] * total
    ranks = {f"a{i}": rng.choice([1, 2, 3, 7, 8, 16, 33, 64]) for i in range(200)}  # ~10x the pool
    for _ in range(1500):
        name = rng.choice(list(ranks))
        res = table.get(name)
        if res is not None:
            if res.refs and rng.random() < 0.6:
                table.release(res.lora_id)
            elif not res.refs and rng.random() < 0.3:
                table.evict(name)
                for r in range(total):
                    owner[r] = None if owner[r] == name else owner[r]
            else:
                table.acquire(res.lora_id)
        elif ranks[name] <= total:
            fits_whole = any(n >= ranks[name] for _, n in table.rows.free_runs)
            victims = table.victims(ranks[name])
            if victims is None:
                with pytest.raises(RuntimeError, match="no room"):
                    table.assign(name, ranks[name])
                continue
            res, evicted = table.assign(name, ranks[name])
            assert evicted == victims
            for gone in evicted:
                for r in range(total):
                    owner[r] = None if owner[r] == gone else owner[r]
            for s, n in res.runs:
                for r in range(s, s + n):
                    assert owner[r] is None, f"row {r} of {owner[r]} given to {name}"
                    owner[r] = name
            if fits_whole and not evicted:
                assert len(res.runs) == 1, "best fit split an adapter that one free run holds"
        _check(table, owner)


def test_capacity_follows_rows_not_slots():
    table = PoolTable(64, num_ids=16)
    for i in range(8):
        table.assign(f"r8_{i}", 8)  # eight rank-8 adapters fill 64 rows
    assert table.victims(8) == ["r8_0"]  # the least recently used goes first
    small = PoolTable(64, num_ids=16)
    small.assign("r64", 64)
    assert small.victims(1) == ["r64"]  # one rank-64 adapter costs what eight rank-8 ones do


def test_referenced_loading_and_pinned_adapters_are_never_victims():
    table = PoolTable(24, num_ids=4, pinned=("p",), max_rank=8)
    a, _ = table.assign("a", 8)
    table.acquire(a.lora_id)
    table.assign("b", 8, loading=True)
    table.assign("p", 8)
    assert table.victims(1) is None
    with pytest.raises(RuntimeError, match="references"):
        table.evict("a")
    table.release(a.lora_id)
    assert table.victims(1) == ["a"]


def test_allocator_refuses_double_frees_and_out_of_range_runs():
    rows = RowAllocator(10)
    runs = rows.allocate(4)
    rows.free(runs)
    with pytest.raises(ValueError, match="already free"):
        rows.free(runs)
    with pytest.raises(ValueError, match="outside"):
        rows.free([(8, 4)])
    assert rows.allocate(11) is None and rows.num_free == 10
