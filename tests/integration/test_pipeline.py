"""The multi-process pipeline end to end (`lorapipe serve` as a subprocess, CPU, tiny model): greedy
outputs equal the offline engine's with more adapters than slots and than host-cache entries; 64
concurrent streams from 4 clients; an aborted stream frees its KV pages and slot reference; bad
requests fail alone; malformed frames are rejected while serving goes on."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time

import pytest
import zmq

from proto.sampling import SamplingParams
from runtime.client import AdapterLoadFailed, AsyncClient, InvalidRequest, UnknownAdapter
from runtime.offline import LLM
from tests.integration.serving import serve, stage_up

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    "The river carried the boat",
    "A quiet morning in the village",
    "Stories begin when",
    "The engine hummed while",
    "Numbers: one two three",
    "héllo wörld",
    "Once upon a time",
    "The long bridge over the valley",
]
FLAGS = ("--max-loras-per-batch", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16", "--num-pages", "256")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def workload(llama_adapters):
    names = [*llama_adapters, None]
    return [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS * 2)]


@pytest.fixture(scope="module")
def reference(tiny_llama, llama_adapters, workload):
    llm = LLM(tiny_llama, device="cpu", adapters=llama_adapters, max_loras_per_batch=2, max_lora_rank=16)
    outs = llm.generate(
        [p for p, _ in workload],
        adapters=[a for _, a in workload],
        sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    return {(p, a): o.token_ids for (p, a), o in zip(workload, outs, strict=True)}


@pytest.fixture(scope="module")
def server(tiny_llama, llama_adapters, tmp_path_factory):
    broken = tmp_path_factory.mktemp("broken") / "broken"
    shutil.copytree(llama_adapters["qv5"], broken)
    # runtime loads read the test's adapter directories, wherever pytest put them
    with serve(tiny_llama, {**llama_adapters, "broken": broken}, *FLAGS, "--allow-any-adapter-path") as s:
        # Valid when the server checked it at start-up; truncated before anything asks for it, so its
        # first load (a request in test_bad_requests_fail_alone) fails at run time.
        data = (broken / "adapter_model.safetensors").read_bytes()
        (broken / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
        yield s


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"


def test_greedy_outputs_equal_the_offline_engine(server, workload, reference):
    async def main():
        async with AsyncClient(server.endpoint, timeout=120) as c:
            outs = await asyncio.gather(
                *(c.generate(p, a, max_tokens=MAX_TOKENS, ignore_eos=True) for p, a in workload)
            )
        for (p, a), out in zip(workload, outs, strict=True):
            assert out.token_ids == reference[(p, a)], f"adapter {a} prompt {p!r}"
            assert out.finish_reason == "length"

    asyncio.run(main())
    listing = {e.name: e for e in server.client().list_adapters()}
    resident_rows = sum(e.rank for e in listing.values() if e.tier == "gpu")
    assert resident_rows <= server.metric("lorapipe_lora_pool_rows_capacity", "scheduler")
    assert server.metric("lorapipe_lora_pool_rows_used", "scheduler") > 0


def test_64_concurrent_streams_from_4_clients(server, workload, reference):
    async def one_client(k: int) -> list[tuple[tuple[str, str | None], list[int], str]]:
        async with AsyncClient(server.endpoint, timeout=120) as c:

            async def one(i: int):
                p, a = workload[(k * 16 + i) % len(workload)]
                ids, text = [], ""
                async for chunk in c.stream(p, a, max_tokens=MAX_TOKENS, ignore_eos=True):
                    ids += chunk.token_ids
                    text += chunk.text
                return (p, a), ids, text

            return await asyncio.gather(*(one(i) for i in range(16)))

    async def main():
        return await asyncio.gather(*(one_client(k) for k in range(4)))

    results = [r for per_client in asyncio.run(main()) for r in per_client]
    assert len(results) == 64
    for key, ids, _ in results:
        assert ids == reference[key], f"stream for {key} differs from the offline engine"


def test_aborted_stream_frees_pages_and_slot_reference(server, llama_adapters):
    async def main():
        async with AsyncClient(server.endpoint, timeout=60) as c:
            stream = c.stream("The river carried", "full8", max_tokens=400, ignore_eos=True)
            async with contextlib.aclosing(stream):
                got = 0
                async for chunk in stream:
                    got += len(chunk.token_ids)
                    if got >= 3:
                        break
            assert got >= 3

    asyncio.run(main())
    wait_for(lambda: server.metric("lorapipe_kv_pages_used", "scheduler") == 0, "KV pages to be freed")
    wait_for(lambda: server.metric("lorapipe_slot_refs", "scheduler") == 0, "slot references to drop")
    assert server.metric("lorapipe_running_requests", "scheduler") == 0


def test_bad_requests_fail_alone(server, workload, reference):
    async def main():
        async with AsyncClient(server.endpoint, timeout=120) as c:
            good = [c.generate(p, a, max_tokens=MAX_TOKENS, ignore_eos=True) for p, a in workload[:6]]
            bad = [
                c.generate("hello", "no-such-adapter", max_tokens=4),
                c.generate("hello", "broken", max_tokens=4),
                c.generate("hello", None, max_tokens=4, temperature=-1.0),
                c.generate("hello", None, max_tokens=4, top_p=1.5),
            ]
            return await asyncio.gather(*good, *bad, return_exceptions=True)

    res = asyncio.run(main())
    for (p, a), out in zip(workload[:6], res[:6], strict=True):
        assert not isinstance(out, Exception), out
        assert out.token_ids == reference[(p, a)]
    unknown, broken, temp, top_p = res[6:]
    assert isinstance(unknown, UnknownAdapter) and "no-such-adapter" in str(unknown)
    assert isinstance(broken, AdapterLoadFailed) and "broken" in str(broken) and "unreadable" in str(broken)
    assert isinstance(temp, InvalidRequest) and "temperature" in str(temp)
    assert isinstance(top_p, InvalidRequest) and "top_p" in str(top_p)


def test_malformed_frames_are_rejected_and_serving_goes_on(server):
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    try:
        for frames in ([b"\xff\x00garbage"], [b""], [b"\x93\x01\x02\x03", b"extra"], [b"\xc1" * 100]):
            raw.send_multipart(frames)
        poller = zmq.Poller()
        poller.register(raw, zmq.POLLIN)
        replies = 0
        deadline = time.monotonic() + 20
        while replies < 1 and time.monotonic() < deadline:
            if poller.poll(1000):
                raw.recv_multipart()
                replies += 1
        assert replies >= 1, "malformed frames got no error reply"
    finally:
        raw.close()
    out = server.client().generate("still serving", None, max_tokens=3)
    assert out.finish_reason in ("length", "stop")
    assert server.metric("lorapipe_messages_malformed_total", "tokenizer") >= 4


def test_dynamic_load_and_unload(server, llama_adapters):
    c = server.client()
    c.load_adapter("late", str(llama_adapters["mlp1"]))
    assert c.generate("hi there", "late", max_tokens=3).finish_reason
    with pytest.raises(AdapterLoadFailed, match="missing.*is not a directory"):
        c.load_adapter("missing", "/nonexistent/adapter")
    c.unload_adapter("late")
    with pytest.raises(UnknownAdapter, match="late"):
        c.generate("hi there", "late", max_tokens=3)
    assert "late" not in {e.name for e in c.list_adapters()}


def test_unload_lets_running_requests_finish_and_refuses_new_ones(server, llama_adapters):
    async def main():
        async with AsyncClient(server.endpoint, timeout=60) as c:
            await c.load_adapter("busy", str(llama_adapters["full8"]))
            stream = c.stream("The river carried", "busy", max_tokens=40, ignore_eos=True)
            async with contextlib.aclosing(stream):
                first = await anext(stream)
                await c.unload_adapter("busy")  # while the request above is running
                with pytest.raises(UnknownAdapter, match="busy"):
                    await c.generate("new request", "busy", max_tokens=2)
                rest = [chunk async for chunk in stream]
            ids = first.token_ids + [t for chunk in rest for t in chunk.token_ids]
            assert len(ids) == 40 and rest[-1].finish_reason == "length"

    asyncio.run(main())
    wait_for(
        lambda: "busy" not in {e.name for e in server.client().list_adapters()}, "the adapter to be removed"
    )


def test_a_scrape_the_scheduler_answers_late_is_not_read_as_zeros(server):
    """A stopped scheduler misses the launcher's scrape window: the endpoint reports it down with none of
    its samples, and `Server.metric` scrapes again until the stage answers instead of reading zeros."""
    import os
    import signal
    import threading

    pid = server.stage_pid("scheduler")
    assert pid is not None
    capacity = server.metric("lorapipe_lora_pool_rows_capacity", "scheduler")
    assert capacity > 0
    scrapes, saw_it_down = [], threading.Event()
    plain = server.metrics

    def counted():
        m = plain()
        scrapes.append(stage_up(m, "scheduler"))
        if scrapes[-1] == 0.0:
            saw_it_down.set()
        return m

    os.kill(pid, signal.SIGSTOP)
    try:
        m = plain()
        assert stage_up(m, "scheduler") == 0.0
        # none of its own samples (the launcher's lorapipe_stage_* families carry a stage label too)
        stale = [k for k in m if k[1] == "scheduler" and not k[0].startswith("lorapipe_stage_")]
        assert not stale, stale
        server.metrics = counted  # on the instance, for this test only
        got: list[float] = []
        reader = threading.Thread(
            target=lambda: got.append(server.metric("lorapipe_lora_pool_rows_capacity", "scheduler"))
        )
        reader.start()
        assert saw_it_down.wait(30), "the reader never scraped while the scheduler was stopped"
        os.kill(pid, signal.SIGCONT)
        reader.join(60)
    finally:
        os.kill(pid, signal.SIGCONT)
        server.__dict__.pop("metrics", None)  # back to the class's method
    assert got == [capacity], f"read {got} (scrapes saw the scheduler as {scrapes})"
    assert scrapes[-1] == 1.0 and 0.0 in scrapes


def test_loader_killed_mid_run_restarts_and_every_request_completes(server, workload, reference):
    """Last in this module: it kills the module server's loader (which the launcher restarts)."""
    import os
    import signal

    old = server.stage_pid("loader")
    assert old is not None

    async def main():
        async with AsyncClient(server.endpoint, timeout=120) as c:
            tasks = [
                asyncio.ensure_future(c.generate(p, a, max_tokens=MAX_TOKENS, ignore_eos=True))
                for p, a in workload
            ]
            os.kill(old, signal.SIGKILL)  # adapters are being staged and swapped for these requests
            return await asyncio.gather(*tasks)

    outs = asyncio.run(main())
    for (p, a), out in zip(workload, outs, strict=True):
        assert out.token_ids == reference[(p, a)], f"adapter {a} prompt {p!r}"
    wait_for(lambda: server.stage_pid("loader") not in (None, old), "a new loader process")
    assert server.metric("lorapipe_stage_restarts_total", "loader") >= 1
