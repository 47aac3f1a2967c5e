"""The replica's adapter table: Ray's LRU evictions become server unloads only once no request uses the
adapter; an adapter asked for again before that is kept without a reload; a stale lease is ignored."""

from __future__ import annotations

import asyncio
import threading

import pytest

from runtime.ray_serve.adapter_table import AdapterTable


class FakeServer:
    """The server's load/unload ops, recorded (the table's collaborator; the table is under test)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str]] = []
        self.registered: set[str] = set()
        self.fail_load: set[str] = set()

    async def load(self, name: str) -> None:
        if name in self.fail_load:
            raise RuntimeError(f"{name} is broken")
        assert name not in self.registered, f"{name} loaded twice"
        self.registered.add(name)
        self.ops.append(("load", name))

    async def unload(self, name: str) -> None:
        self.registered.remove(name)
        self.ops.append(("unload", name))


def run(body):
    async def main():
        server = FakeServer()
        table = AdapterTable(server.load, server.unload, asyncio.get_running_loop())
        await body(server, table)

    asyncio.run(main())


async def settle() -> None:
    for _ in range(5):  # let scheduled callbacks and unload tasks run
        await asyncio.sleep(0)


def test_eviction_with_no_request_unloads_at_once():
    async def body(server, table):
        lease = await table.admit("a")
        table.evict(lease)
        await settle()
        assert server.ops == [("load", "a"), ("unload", "a")]
        assert table.entries == {} and (table.loads, table.unloads) == (1, 1)

    run(body)


def test_eviction_waits_for_the_last_request():
    async def body(server, table):
        lease = await table.admit("a")
        table.acquire("a")
        table.acquire("a")
        table.evict(lease)
        await settle()
        assert server.ops == [("load", "a")] and table.held() == []
        table.release("a")
        await settle()
        assert server.ops == [("load", "a")]
        table.release("a")
        await settle()
        assert server.ops == [("load", "a"), ("unload", "a")]

    run(body)


def test_admitted_again_before_its_unload_is_kept_without_a_reload():
    async def body(server, table):
        old = await table.admit("a")
        table.acquire("a")
        table.evict(old)
        new = await table.admit("a")
        assert new is not old and table.held() == ["a"]
        table.release("a")
        table.evict(old)  # the old lease again (the garbage collector's call): ignored
        await settle()
        assert server.ops == [("load", "a")]

    run(body)


def test_admit_during_an_unload_waits_for_it_then_loads():
    async def body(server, table):
        lease = await table.admit("a")
        table.evict(lease)  # unload task started, not yet run
        again = await table.admit("a")
        assert server.ops == [("load", "a"), ("unload", "a"), ("load", "a")]
        assert table.held() == ["a"] and table.entries["a"].lease is again

    run(body)


def test_a_failed_load_records_nothing():
    async def body(server, table):
        server.fail_load.add("bad")
        with pytest.raises(RuntimeError, match="bad is broken"):
            await table.admit("bad")
        assert table.entries == {} and table.loads == 0

    run(body)


def test_lease_del_from_another_thread_reaches_the_loop_once():
    async def body(server, table):
        lease = await table.admit("a")
        t = threading.Thread(target=lease.__del__)  # Ray calls it in an executor thread
        t.start()
        t.join()
        lease.__del__()  # and the garbage collector later: no second eviction
        await settle()
        assert server.ops == [("load", "a"), ("unload", "a")]

    run(body)
