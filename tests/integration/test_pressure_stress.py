"""The end-to-end stress test under adapter memory pressure (`lorapipe serve` as a subprocess, CPU, tiny
model): 40 adapters of ranks 8/16/32 behind a host cache of four rank-32 adapters and a GPU pool of two,
48 requests in flight, a Zipf phase, a uniform phase and clients that abort. Every request that was not
aborted completes within a bound, greedy outputs equal the offline engine's, and afterwards nothing is
held and no process is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from proto.sampling import SamplingParams
from runtime.client import AsyncClient, LorapipeError
from runtime.offline import LLM
from runtime.synthetic.adapters import make_adapters
from tests.conftest import pool_gb
from tests.integration.hostile import descendants, live_descendants, wait_until
from tests.integration.serving import Server, serve

pytestmark = pytest.mark.timeout(300)

RANKS = (8, 16, 32)
MAX_RANK = 32
N_ADAPTERS = 40
HOST_ADAPTERS = 4  # the tight host cache: 4 rank-32 blocks' bytes and at most 4 adapters, 1/10 of them
POOL_ADAPTERS = 2  # the GPU pool: the rows of 2 rank-32 adapters, 1/20 of them
IN_FLIGHT = 48
PHASE_REQUESTS = 120  # per phase: Zipf, then uniform
ABORT_EVERY = 7  # one request in ABORT_EVERY is a client that leaves before its answer is whole
BASE_SHARE = 0.1  # requests without an adapter
ZIPF_S = 1.1
# A healthy server answers each of these requests within a few seconds (the whole run takes seconds with
# a cache that holds every adapter); a request stranded behind an adapter that never arrives waits
# forever, so each is bounded well below the test's timeout, and the run ends even when many strand.
REQUEST_TIMEOUT_S = 30.0
# The running batch (64) takes every request in flight, so admission alone could ask for far more
# adapters than the host cache stages at once: the pressure the server must turn into waiting.
FLAGS = ("--max-lora-rank", str(MAX_RANK), "--max-running-requests", "64")


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    adapter: str | None
    max_tokens: int
    abort: str | None = None  # "queued": the client gives up after `patience` s; "streaming": after a chunk
    patience: float = 0.0


@pytest.fixture(scope="module")
def stress_adapters(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("stress_adapters")
    paths = make_adapters(tiny_llama, out, n=N_ADAPTERS, ranks=RANKS, seed=38, prefix="s")
    return {p.name: p for p in paths}


def phase(rng: random.Random, names: list[str], weights: list[float] | None) -> list[Req]:
    """Adapters drawn by `weights`; None: uniform, every adapter once per round in a seeded order."""
    out, rounds = [], []
    for i in range(PHASE_REQUESTS):
        if weights is None and not rounds:
            rounds = rng.sample(names, len(names))
        pick = rounds.pop() if weights is None else rng.choices(names, weights)[0]
        adapter = None if rng.random() < BASE_SHARE else pick
        prompt = [rng.randrange(1, 250) for _ in range(rng.randint(3, 20))]
        if i % ABORT_EVERY == ABORT_EVERY - 1:
            abort = rng.choice(("queued", "streaming"))
            out.append(Req(prompt, adapter, 64, abort, rng.uniform(0.0, 1.0)))
        else:
            out.append(Req(prompt, adapter, rng.randint(2, 10)))
    return out


def workload(names: list[str]) -> list[list[Req]]:
    """Two phases: Zipf popularity over a seeded order of the adapters, then uniform."""
    rng = random.Random(38)
    ranked = rng.sample(names, len(names))
    zipf = [1.0 / (k + 1) ** ZIPF_S for k in range(len(ranked))]
    return [phase(rng, ranked, zipf), phase(rng, ranked, None)]


def key(r: Req) -> tuple:
    return tuple(r.prompt), r.adapter, r.max_tokens


@pytest.fixture(scope="module")
def reference(tiny_llama, stress_adapters) -> dict[tuple, list[int]]:
    """The offline engine's greedy tokens for every request no client aborts (it holds every adapter)."""
    kept = [r for ph in workload(sorted(stress_adapters)) for r in ph if r.abort is None]
    llm = LLM(tiny_llama, adapters=stress_adapters, max_lora_rank=MAX_RANK)
    outs = llm.generate(
        [r.prompt for r in kept],
        adapters=[r.adapter for r in kept],
        sampling=[SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in kept],
    )
    return {key(r): o.token_ids for r, o in zip(kept, outs, strict=True)}


async def one(c: AsyncClient, r: Req) -> list[int] | str:
    """The request's tokens, "aborted" for a client that left, "timeout" for a request that did not end
    within REQUEST_TIMEOUT_S (leaving aborts it), or the error it ended with."""
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            if r.abort is None:
                out = await c.generate(r.prompt, r.adapter, max_tokens=r.max_tokens, ignore_eos=True)
                return out.token_ids
            stream = c.stream(r.prompt, r.adapter, max_tokens=r.max_tokens, ignore_eos=True)
            async with contextlib.aclosing(stream):
                if r.abort == "streaming":
                    await anext(stream)
                    return "aborted"
                with contextlib.suppress(TimeoutError):  # gives up queued or mid-stream, or got it all
                    async with asyncio.timeout(r.patience):
                        async for _ in stream:
                            pass
                return "aborted"
    except TimeoutError:  # the SDK's Timeout (no reply within its limit) included
        return "timeout"
    except LorapipeError as exc:
        return f"{type(exc).__name__}: {exc}"


async def drive(endpoint: str, phases: list[list[Req]]) -> list[list[int] | str]:
    """Each phase's requests with IN_FLIGHT open at a time, phases one after another."""
    results: list[list[int] | str] = []
    async with AsyncClient(endpoint, timeout=REQUEST_TIMEOUT_S) as c:
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def gated(r: Req) -> list[int] | str:
            async with gate:
                return await one(c, r)

        for ph in phases:
            results += await asyncio.gather(*(gated(r) for r in ph))
    return results


def cache_samples(server: Server, name: str) -> dict[tuple, float]:
    """{(stage, labels): value} of `name` from the stages that may keep the host cache's table (its series
    come from whichever does), each read from a scrape that stage answered."""
    out = {}
    for stage in ("scheduler", "loader"):
        for (n, st, labels), value in server.answered(stage).items():
            if n == name and st == stage:
                out[(st, labels)] = value
    return out


def host_cache_adapters(server: Server, state: Callable[[str], bool]) -> float:
    """Adapters in the host cache whose `state` label passes `state`."""
    samples = cache_samples(server, "lorapipe_host_cache_adapters")
    return sum(v for (_, labels), v in samples.items() if state(dict(labels).get("state", "")))


# (host cache adapters, whether it evicts): tight is the pressure; roomy holds all 40, the same
# traffic without host-cache pressure (the pool still churns)
CACHES = {"tight": (HOST_ADAPTERS, True), "roomy": (N_ADAPTERS, False)}


@pytest.mark.parametrize("cache", list(CACHES))
def test_pressure_every_request_completes_and_matches_the_offline_engine(
    tiny_llama, stress_adapters, reference, cache
):
    phases = workload(sorted(stress_adapters))
    reqs = [r for ph in phases for r in ph]
    kept = [r for r in reqs if r.abort is None]
    used = {r.adapter for r in reqs if r.adapter is not None}
    assert len(used) == N_ADAPTERS, f"the workload uses only {len(used)} adapters"
    host, evicts = CACHES[cache]
    # --max-cpu-loras alone sizes the cache to that many blocks of --max-lora-rank, and caps it there
    sizes = ("--max-cpu-loras", str(host))
    sizes += ("--lora-gpu-memory-gb", repr(pool_gb(tiny_llama, POOL_ADAPTERS * MAX_RANK, MAX_RANK)))
    with serve(tiny_llama, stress_adapters, *FLAGS, *sizes) as server:
        started = descendants(server.proc.pid)
        t0 = time.monotonic()
        results = asyncio.run(drive(server.endpoint, phases))
        elapsed = time.monotonic() - t0
        got = [res for r, res in zip(reqs, results, strict=True) if r.abort is None]
        late = [r.adapter for r, res in zip(kept, got, strict=True) if res == "timeout"]
        failed = [res for res in got if isinstance(res, str) and res != "timeout"]
        assert not late and not failed, (
            f"{len(late)} of {len(kept)} requests did not finish within {REQUEST_TIMEOUT_S} s and "
            f"{len(failed)} failed (run took {elapsed:.0f} s; adapters of the late ones: "
            f"{sorted(set(late), key=str)}; errors: {failed[:5]})\n{server.snapshot()}"
        )
        wrong = [(r.adapter, r.prompt) for r, res in zip(kept, got, strict=True) if res != reference[key(r)]]
        assert not wrong, f"{len(wrong)} of {len(kept)} outputs differ from the offline engine's: {wrong[:5]}"
        # the sizes this test is about, as the server itself reports them
        assert server.metric("lorapipe_lora_pool_rows_capacity", "scheduler") == POOL_ADAPTERS * MAX_RANK
        assert 0 < host_cache_adapters(server, lambda state: state == "resident") <= host
        # the traffic went through the tiers: the pool copied adapters in again and again, and the tight
        # cache read adapters from disk again after evicting them
        assert server.metric("lorapipe_slot_loads_total", "scheduler") > len(used)
        evictions = sum(cache_samples(server, "lorapipe_host_cache_evictions_total").values())
        assert (evictions > 0) == evicts, evictions
        # once every request has ended nothing is held: no request, page, pool reference or host hold, and
        # no host block is being written or copied
        for name, stage in [
            ("lorapipe_running_requests", "scheduler"),
            ("lorapipe_waiting_requests", "scheduler"),
            ("lorapipe_kv_pages_used", "scheduler"),
            ("lorapipe_slot_refs", "scheduler"),
            ("lorapipe_host_holds", "scheduler"),
            ("lorapipe_requests_in_flight", "tokenizer"),
            ("lorapipe_loader_writes_in_flight", "loader"),
        ]:
            try:
                wait_until(lambda n=name, st=stage: server.metric(n, st) == 0, f"{name} back to 0")
            except AssertionError as exc:  # which state is stuck (e.g. copies or writes), and everything else
                raise AssertionError(f"{exc}\n{server.snapshot()}") from None
        wait_until(
            lambda: host_cache_adapters(server, lambda state: state != "resident") == 0,
            "no host block being loaded, written, copied or pinned",
        )
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert live_descendants(started) == []
