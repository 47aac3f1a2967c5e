"""Security on a server started with --api-key-file and --no-runtime-adapter-loading: clients without
the key, or with a wrong one, are refused at the handshake with a typed error; adapter ops are
forbidden; then the tokenizer is SIGKILLed while calls are in flight (one with timeout=None) and every
call gets ServerError within 5 s; right after the launcher exits, no process it started is alive."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from runtime.client import AsyncClient, Client, Forbidden, ServerError, Unauthorized
from tests.integration.hostile import descendants, live_descendants
from tests.integration.serving import serve

pytestmark = pytest.mark.timeout(300)
KEY = "k3y-for-tests-only-0123456789"


@pytest.fixture(scope="module")
def server(tiny_llama, llama_adapters, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    flags = ("--api-key-file", str(key_file), "--no-runtime-adapter-loading", "--max-lora-rank", "16")
    with serve(tiny_llama, {"full8": llama_adapters["full8"]}, *flags, api_key=KEY) as s:
        yield s


def test_the_key_is_required_and_checked(server, monkeypatch):
    for key in (None, "wrong-key-of-the-right-length"):
        t0 = time.monotonic()
        with (
            Client(server.endpoint, timeout=None, api_key=key) as c,
            pytest.raises(Unauthorized, match="API key"),
        ):
            c.health()
        assert time.monotonic() - t0 < 10
    with Client(server.endpoint, timeout=30, api_key=KEY) as c:
        assert c.health().ok
        assert c.generate("Stories begin", "full8", max_tokens=3).finish_reason == "length"
    monkeypatch.setenv("LORAPIPE_API_KEY", KEY)
    with Client(server.endpoint, timeout=30) as c:
        assert c.health().ok


def test_adapter_ops_are_forbidden_without_runtime_loading(server, llama_adapters):
    with server.client(timeout=30) as c:
        with pytest.raises(Forbidden, match="no-runtime-adapter-loading"):
            c.load_adapter("qv5", str(llama_adapters["qv5"]))
        with pytest.raises(Forbidden):
            c.unload_adapter("full8")
        assert [e.name for e in c.list_adapters()] == ["full8"]


def test_a_killed_tokenizer_fails_every_call_within_seconds(server):
    """Last in this module: kills the server."""
    started = descendants(server.proc.pid)
    got: dict[str, tuple[type, float]] = {}
    killed_at: list[float] = []
    first_tokens = threading.Barrier(5)  # four calls with a first token each, and the killer

    async def streaming(name: str, timeout: float | None) -> None:
        async with AsyncClient(server.endpoint, timeout=timeout, api_key=KEY) as c:
            try:
                seen = False
                async for _ in c.stream("Once upon a time", "full8", max_tokens=480, ignore_eos=True):
                    if not seen:
                        seen = True
                        await asyncio.to_thread(first_tokens.wait, 60)
            except Exception as exc:
                got[name] = (type(exc), time.monotonic())

    def blocking() -> None:  # the sync client, no timeout at all
        with Client(server.endpoint, timeout=None, api_key=KEY) as c:
            try:
                for i, _ in enumerate(c.stream("The river carried", max_tokens=480, ignore_eos=True)):
                    if i == 0:
                        first_tokens.wait(60)
            except Exception as exc:
                got["sync"] = (type(exc), time.monotonic())

    async def main() -> None:
        thread = threading.Thread(target=blocking)
        thread.start()
        tasks = [asyncio.ensure_future(streaming(f"async-{i}", t)) for i, t in enumerate((None, None, 120.0))]
        await asyncio.to_thread(first_tokens.wait, 60)  # every call is in flight
        pid = server.stage_pid("tokenizer")
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await asyncio.to_thread(thread.join, 10)

    asyncio.run(main())
    assert set(got) == {"async-0", "async-1", "async-2", "sync"}, got
    for name, (kind, when) in got.items():
        assert kind is ServerError, (name, kind)
        assert when - killed_at[0] < 5.0, (name, when - killed_at[0])
    assert server.proc.wait(timeout=60) != 0  # a dead tokenizer takes the pipeline down
    assert live_descendants(started) == []
