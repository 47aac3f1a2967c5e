"""Hostile inputs against a real `lorapipe serve` (tiny model, CPU): garbage on every socket edge, a lone
surrogate, a 32 MiB frame and plain TCP noise leave every stage serving; prompts too long are refused
by size before tokenizing and a long one being tokenized does not hold up another client; runtime
loads stay inside --adapter-root and names follow one rule on the wire; hostile adapters fail alone;
a soak mixes all of it into normal traffic (greedy outputs equal the offline engine's, nothing leaks);
SIGTERM leaves no process behind, the resource tracker included."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import time

import pytest
import zmq

from proto.client import ClientReply, ClientRequest, ErrorReply, GenerateRequest, LoadAdapter, UnloadAdapter
from proto.sampling import SamplingParams
from runtime.base.sockets import DealerSocket
from runtime.client import (
    Aborted,
    AdapterLoadFailed,
    AsyncClient,
    Forbidden,
    InvalidRequest,
    UnknownAdapter,
)
from runtime.offline import LLM
from tests.integration.hostile import (
    EDGE_RECEIVERS,
    ISSUE_FRAME,
    SURROGATE_PROMPT,
    client_frames,
    descendants,
    endpoints_of,
    live_descendants,
    raw_dealer,
    recv_all,
    refused_frames,
    tcp_garbage,
    wait_until,
)
from tests.integration.serving import serve

pytestmark = pytest.mark.timeout(300)
STAGES = ("tokenizer", "scheduler", "worker", "loader")
PROMPTS = ["The river carried the boat", "Stories begin when", "héllo wörld", "Numbers: one two three"]
MAX_TOKENS = 8
PROMPT_LIMIT = 4 << 20
FLAGS = ("--max-loras-per-batch", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16", "--num-pages", "256")


@pytest.fixture(scope="module")
def root(llama_adapters, tmp_path_factory):
    """The adapter root: a good adapter, a symlink out of the root, a FIFO config, a NaN alpha."""
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(llama_adapters["full8"], root / "inroot")
    (root / "escape").symlink_to(llama_adapters["qv5"])
    shutil.copytree(llama_adapters["qv5"], root / "fifo")
    (root / "fifo" / "adapter_config.json").unlink()
    os.mkfifo(root / "fifo" / "adapter_config.json")
    shutil.copytree(llama_adapters["mlp1"], root / "nan")
    c = json.loads((root / "nan" / "adapter_config.json").read_text())
    (root / "nan" / "adapter_config.json").write_text(json.dumps({**c, "lora_alpha": math.nan}))
    return root


@pytest.fixture(scope="module")
def server(tiny_llama, llama_adapters, root):
    flags = (*FLAGS, "--adapter-root", str(root), "--max-prompt-bytes", str(PROMPT_LIMIT))
    with serve(tiny_llama, llama_adapters, *flags) as s:
        s.pids = {stage: s.stage_pid(stage) for stage in STAGES}
        yield s


@pytest.fixture(scope="module")
def reference(tiny_llama, llama_adapters):
    llm = LLM(tiny_llama, device="cpu", adapters=llama_adapters, max_loras_per_batch=2, max_lora_rank=16)
    work = [(p, a) for p in PROMPTS for a in [*llama_adapters, None]]
    outs = llm.generate(
        [p for p, _ in work],
        adapters=[a for _, a in work],
        sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    return {key: o.token_ids for key, o in zip(work, outs, strict=True)}


def assert_all_serving(server, reference) -> None:
    """Same stage processes as at start, health ok, and a greedy request still exact."""
    assert {stage: server.stage_pid(stage) for stage in STAGES} == server.pids
    with server.client(timeout=60) as c:
        assert c.health().ok
        out = c.generate(PROMPTS[0], "full8", max_tokens=MAX_TOKENS, ignore_eos=True)
    assert out.token_ids == reference[(PROMPTS[0], "full8")]


def test_garbage_on_every_edge_leaves_the_server_serving(server, reference):
    rng = random.Random(12)
    ep = endpoints_of(server)
    ctx = zmq.Context()
    try:
        client = raw_dealer(server.endpoint, ctx)
        frames = [[ISSUE_FRAME], [SURROGATE_PROMPT], *client_frames(rng, 300)]
        for f in frames:
            client.send_multipart(f)
        burst = [[rng.randbytes(rng.randint(1, 4096))] for _ in range(50)]
        burst.insert(25, [b"\x91" + rng.randbytes(32 << 20)])  # 32 MiB: zmq drops this peer
        second = raw_dealer(server.endpoint, ctx)
        for f in burst:
            second.send_multipart(f)
        for _ in range(5):
            tcp_garbage(server.endpoint, rng)
        for edge in EDGE_RECEIVERS:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(ep[edge])
            for f in refused_frames(edge, rng, 100):
                push.send_multipart(f)
            push.close()
        control = ctx.socket(zmq.DEALER)
        control.setsockopt(zmq.IDENTITY, b"fuzz")
        control.setsockopt(zmq.LINGER, 2000)
        control.connect(ep["control"])
        for f in refused_frames("stage_to_launcher", rng, 50):
            control.send_multipart(f)
        replies = recv_all(client, 3.0)
        assert replies and all(isinstance(r, ClientReply.__args__) for r in replies)
        for sock in (client, second, control):
            sock.close()
    finally:
        ctx.term()
    assert server.metric_labeled("lorapipe_messages_malformed_total", "tokenizer", socket="client") > 0
    sent = {stage: 100 * list(EDGE_RECEIVERS.values()).count(stage) for stage in STAGES}
    for stage, n in sent.items():  # every internal edge dropped (and counted) all it was sent
        wait_until(
            lambda stage=stage, n=n: (
                server.metric_labeled("lorapipe_messages_malformed_total", stage)
                - server.metric_labeled("lorapipe_messages_malformed_total", stage, socket="client")
                >= n
            ),
            f"{stage} to drop {n} malformed messages",
        )
    assert_all_serving(server, reference)


def test_issue_frames_get_typed_error_replies(server):
    ctx = zmq.Context()
    try:
        sock = raw_dealer(server.endpoint, ctx)
        sock.send_multipart([ISSUE_FRAME])
        sock.send_multipart([SURROGATE_PROMPT])
        replies = recv_all(sock, 2.0)
        sock.close()
    finally:
        ctx.term()
    assert len(replies) == 2
    assert all(isinstance(r, ErrorReply) and r.kind == "invalid_request" for r in replies), replies
    assert "UnicodeDecodeError" in replies[1].message


def test_a_10_mib_prompt_is_refused_by_size_at_once(server):
    async def main():
        async with (
            AsyncClient(server.endpoint, timeout=30) as c,
            AsyncClient(server.endpoint, timeout=30) as d,
        ):
            t0 = time.monotonic()
            big = asyncio.ensure_future(c.generate("word " * (2 << 20), max_tokens=1))
            short = await d.generate("Stories begin when", max_tokens=2)
            with pytest.raises(InvalidRequest, match="bytes exceeds"):
                await big
            assert time.monotonic() - t0 < 5.0
            assert short.finish_reason in ("stop", "length")

    asyncio.run(main())


def test_a_long_prompt_being_tokenized_holds_up_no_other_client(server):
    """A 3 MiB prompt (under the limit, so it is tokenized; then too long for the context) takes
    seconds to tokenize. Another connection's requests meanwhile answer as fast as ever."""

    async def main():
        async with (
            AsyncClient(server.endpoint, timeout=60) as c,
            AsyncClient(server.endpoint, timeout=60) as d,
        ):
            big = asyncio.ensure_future(c.generate("The river ran slowly. " * (3 << 20 >> 5), max_tokens=1))
            await asyncio.sleep(0)  # let it be sent before the short ones
            latencies = []
            while not big.done():
                t = time.monotonic()
                await d.generate("Stories begin when", max_tokens=1)
                latencies.append(time.monotonic() - t)
            with pytest.raises(InvalidRequest, match="exceeds the model's context"):
                await big
            return latencies

    latencies = asyncio.run(main())
    assert len(latencies) >= 3, "the long prompt was not tokenized beside the short requests"
    assert max(latencies) < 1.5, latencies


def test_runtime_loads_stay_inside_the_adapter_root(server, llama_adapters, root):
    with server.client(timeout=60) as c:
        c.load_adapter("in-rel", "inroot")  # relative paths are taken inside the root
        c.load_adapter("in-abs", str(root / "inroot"))
        assert c.generate(PROMPTS[1], "in-rel", max_tokens=2).finish_reason == "length"
        texts = set()
        for path in [
            str(llama_adapters["qv5"]),
            "/nonexistent/x",
            "escape",
            "../" * 8 + "etc",
            str(root / ".."),
        ]:
            with pytest.raises(Forbidden) as info:
                c.load_adapter("out", path)
            texts.add(str(info.value))
        assert len(texts) == 1 and "adapter root" in texts.pop()  # one text: nothing about what exists
        c.unload_adapter("in-rel")
        c.unload_adapter("in-abs")


def test_adapter_names_follow_one_rule_on_the_wire(server):
    bad_names = ["../../etc", "a\nb", "", "x" * 65536, "-lead"]

    async def main():
        sock = DealerSocket(server.endpoint, ClientReply, ClientRequest)
        try:
            for i, name in enumerate(bad_names):
                for msg in (
                    LoadAdapter(request_id=f"l{i}", name=name, path="inroot"),
                    UnloadAdapter(request_id=f"u{i}", name=name),
                    GenerateRequest(request_id=f"g{i}", prompt="x", adapter=name),
                ):
                    await sock.send(msg)
                    reply = await asyncio.wait_for(sock.recv(), 10)
                    assert isinstance(reply, ErrorReply) and reply.kind == "invalid_request", (
                        name[:9],
                        reply,
                    )
                    assert "adapter name" in reply.message and len(reply.message) < 300
        finally:
            sock.close()
        async with AsyncClient(server.endpoint, timeout=10) as c:
            for name in bad_names:
                with pytest.raises(InvalidRequest, match="adapter name"):
                    await c.load_adapter(name, "inroot")

    asyncio.run(main())


def test_hostile_adapters_fail_alone(server, reference):
    with server.client(timeout=30) as c:
        for _ in range(2):  # twice: a FIFO must not wedge a loader thread
            t0 = time.monotonic()
            with pytest.raises(AdapterLoadFailed, match="not a regular file"):
                c.load_adapter("fifo", "fifo")
            assert time.monotonic() - t0 < 10
        with pytest.raises(AdapterLoadFailed, match="lora_alpha"):
            c.load_adapter("nan", "nan")
        health = c.health()
        assert health.ok, health
        c.load_adapter("fine", "inroot")
        c.unload_adapter("fine")
    assert_all_serving(server, reference)


def test_a_tiny_temperature_samples_greedily_beside_six_streams(server, reference):
    async def main():
        async with AsyncClient(server.endpoint, timeout=120) as c:
            work = [(p, a) for p in PROMPTS for a in ("full8", "qv5", None)][:7]
            temps = [1e-300] + [0.0] * 6
            outs = await asyncio.gather(
                *(
                    c.generate(p, a, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=t)
                    for (p, a), t in zip(work, temps, strict=True)
                )
            )
        for (p, a), out in zip(work, outs, strict=True):
            assert out.token_ids == reference[(p, a)]

    asyncio.run(main())


def test_sdk_raises_typed_errors_for_unsendable_requests(server):
    with server.client(timeout=10) as c:
        with pytest.raises(InvalidRequest, match="max_tokens"):
            c.generate("hi", max_tokens=2**64 + 1)
        with pytest.raises(InvalidRequest, match="surrogate"):
            c.generate("hi \ud800 there")
        with pytest.raises(InvalidRequest, match="temperature"):
            c.generate("hi", temperature=float("nan"))
        with pytest.raises(InvalidRequest, match="int32"):
            c.generate([2**40])
        with pytest.raises(InvalidRequest):
            c.load_adapter("ok", "path\udcff")


def test_soak_hostile_inputs_mixed_into_normal_traffic(server, reference, llama_adapters):
    """Three clients stream 96 greedy requests while a fourth task throws every hostile input of this
    module at the server. Every good output is exact, and afterwards nothing is held anywhere."""
    names = [*llama_adapters, None]
    work = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS * 24)]
    stop = asyncio.Event()
    two_rounds = asyncio.Event()  # the attack ran whole twice (the good traffic may finish sooner)

    async def good(k: int) -> list[tuple[tuple[str, str | None], list[int]]]:
        async with AsyncClient(server.endpoint, timeout=120) as c:
            sem = asyncio.Semaphore(8)

            async def one(i: int, key):
                async with sem:
                    temp = 1e-300 if i % 5 == 0 else 0.0  # below the greedy threshold: still exact
                    out = await c.generate(*key, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=temp)
                    return key, out.token_ids

            return await asyncio.gather(*(one(i, key) for i, key in enumerate(work[k::3])))

    async def hostile() -> int:
        rng, rounds, ctx = random.Random(7), 0, zmq.Context()
        try:
            while not stop.is_set():
                rounds += 1
                sock = raw_dealer(server.endpoint, ctx)
                for f in [[ISSUE_FRAME], [SURROGATE_PROMPT], *client_frames(rng, 20)]:
                    sock.send_multipart(f)
                sock.close(0)  # gone without reading its replies
                await asyncio.to_thread(tcp_garbage, server.endpoint, rng, 2048)
                async with AsyncClient(server.endpoint, timeout=60) as c:
                    with pytest.raises(InvalidRequest):
                        await c.generate("x" * (PROMPT_LIMIT + 1))
                    with pytest.raises(UnknownAdapter):
                        await c.generate("hi", "nobody")
                    with pytest.raises(AdapterLoadFailed):
                        await c.load_adapter("fifo", "fifo")
                    with pytest.raises(Forbidden):
                        await c.load_adapter("out", "escape")
                    stream = c.stream("The river", "rs12", max_tokens=200, ignore_eos=True)
                    async with contextlib.aclosing(stream):
                        async for _ in stream:
                            break  # aborted mid-stream
                disconnecting = AsyncClient(server.endpoint, timeout=60)
                pending = asyncio.ensure_future(disconnecting.generate("Once", "mlp1", max_tokens=300))
                await asyncio.sleep(0.05)
                pending.cancel()
                await disconnecting.close()  # the connection goes away with the request open
                with contextlib.suppress(asyncio.CancelledError, Aborted):  # a Timeout here: it hung
                    await pending
                if rounds >= 2:
                    two_rounds.set()
        finally:
            ctx.term()
        return rounds

    async def main():
        attack = asyncio.ensure_future(hostile())
        results = await asyncio.gather(*(good(k) for k in range(3)))
        await asyncio.wait([asyncio.ensure_future(two_rounds.wait()), attack], return_when="FIRST_COMPLETED")
        stop.set()
        return results, await attack

    results, rounds = asyncio.run(main())
    assert rounds >= 2
    outputs = [r for per_client in results for r in per_client]
    assert len(outputs) == len(work)
    for key, ids in outputs:
        assert ids == reference[key], f"{key} differs from the offline engine"
    for name, stage in [
        ("lorapipe_kv_pages_used", "scheduler"),
        ("lorapipe_slot_refs", "scheduler"),
        ("lorapipe_running_requests", "scheduler"),
        ("lorapipe_waiting_requests", "scheduler"),
        ("lorapipe_requests_in_flight", "tokenizer"),
    ]:
        wait_until(lambda name=name, stage=stage: server.metric(name, stage) == 0, f"{name} back to 0")
    assert_all_serving(server, reference)


def test_sigterm_leaves_no_process_behind(server):
    """Last in this module: stops the module's server. Right after the launcher exits, none of the
    processes it started (stages, multiprocessing's resource tracker) is alive."""
    started = descendants(server.proc.pid)
    assert len(started) >= len(STAGES) + 1, started  # the stages and the resource tracker
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    assert live_descendants(started) == []
