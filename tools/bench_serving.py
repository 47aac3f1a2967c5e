"""Serving benchmark: drives a running `lorapipe serve` through the client SDK with a generated or
replayed workload (open loop at the workload's arrival times, optionally capped at --max-concurrency),
reads the server's counters from /metrics at start and end, prints one table and writes JSON."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.client import DEFAULT_ENDPOINT, AsyncClient
from tools import bench_metrics, roofline
from tools.bench_procs import drive_procs
from tools.bench_report import Progress, RequestRecord, emit_report, jsonable, make_report
from tools.workload import (
    WorkloadRequest,
    add_workload_arguments,
    generate_workload,
    read_workload,
    spec_from_args,
    workload_digest,
    write_workload,
)


async def run_request(
    client: AsyncClient, req: WorkloadRequest, rec: RequestRecord, t0: float, timeout: float
) -> None:
    """Stream one request into `rec`. Times come from the SDK's chunk clock (seconds since the send);
    a chunk of k tokens spreads its gap from the previous chunk evenly over its k tokens."""
    sampling = {"max_tokens": req.max_tokens, "ignore_eos": True, **req.sampling}
    rec.start = time.monotonic() - t0
    last = None
    try:
        async with contextlib.aclosing(
            client.stream(req.prompt_value(), req.adapter, timeout=timeout, **sampling)
        ) as chunks:
            async for chunk in chunks:
                rec.request_id = chunk.request_id
                n = len(chunk.token_ids)
                if n and rec.ttft is None:
                    rec.ttft = chunk.time
                    rec.itl.extend([0.0] * (n - 1))
                elif n:
                    rec.itl.extend([(chunk.time - last) / n] * n)
                if n:
                    last = chunk.time
                rec.token_ids.extend(chunk.token_ids)
                rec.prompt_tokens = chunk.prompt_tokens or rec.prompt_tokens
                if chunk.finished:
                    rec.finish_reason = chunk.finish_reason
                    rec.e2e = chunk.time
    except Exception as exc:  # a failed request is a result, not a crash of the benchmark
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.output_tokens = len(rec.token_ids)
    rec.end = time.monotonic() - t0
    if rec.error is None and rec.e2e is None:
        rec.error = "stream ended without a finished chunk"


class _SdkBackend:
    """The ZeroMQ SDK as a backend (the default)."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        self.client = AsyncClient(endpoint, timeout=timeout)

    async def __aenter__(self) -> _SdkBackend:
        await self.client.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    async def run(self, req: WorkloadRequest, rec: RequestRecord, t0: float, timeout: float) -> None:
        await run_request(self.client, req, rec, t0, timeout)


async def drive(
    endpoint: str,
    workload: Sequence[WorkloadRequest],
    *,
    max_concurrency: int | None = None,
    timeout: float = 600.0,
    progress: bool = True,
    backend: str = "lorapipe",
    base_url: str | None = None,
    api_key: str | None = None,
    start_barrier: Any = None,
) -> tuple[list[RequestRecord], float, float]:
    """Send every request at its arrival time (and when a concurrency slot is free); returns the
    records, the start time (time.monotonic) and the duration until the last request ended.
    `start_barrier`: a multiprocessing barrier to meet once connected (several client processes)."""
    records = [RequestRecord(i, r.adapter, r.arrival, r.max_tokens) for i, r in enumerate(workload)]
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    limit = asyncio.Semaphore(max_concurrency or len(workload) or 1)
    bar = Progress(len(workload), progress)

    async def one(i: int) -> None:
        try:
            await client.run(workload[i], records[i], t0, timeout)
        finally:
            limit.release()
            bar.in_flight -= 1
            bar.done += 1
            bar.failed += records[i].error is not None

    async def ticker() -> None:
        while True:
            bar.show()
            await asyncio.sleep(0.25)

    if backend == "openai":
        from tools.bench_http import OpenAIBackend

        assert base_url, "--backend openai needs --base-url"
        conn: Any = OpenAIBackend(base_url, timeout, api_key)
    else:
        conn = _SdkBackend(endpoint, timeout)
    async with conn as client:
        if start_barrier is not None:
            await asyncio.to_thread(start_barrier.wait)
        t0 = time.monotonic()
        tick = asyncio.ensure_future(ticker())
        async with asyncio.TaskGroup() as tg:
            for i in order:
                delay = t0 + workload[i].arrival - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await limit.acquire()
                bar.in_flight += 1
                tg.create_task(one(i))
        duration = time.monotonic() - t0
        tick.cancel()
        bar.show(final=True)
    return records, t0, duration


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by parsed arguments; returns the report (also written to --out)."""
    if ns.workload:
        workload, source = read_workload(ns.workload), str(ns.workload)
    else:
        workload, source = generate_workload(spec_from_args(ns)), "generated"
    if ns.save_workload:
        write_workload(ns.save_workload, workload)
    m_start = bench_metrics.scrape(ns.metrics_url) if ns.metrics_url else None
    sampler = None
    if ns.metrics_url and ns.metrics_interval > 0:
        sampler = bench_metrics.MetricsSampler(ns.metrics_url, ns.metrics_interval, time.monotonic()).start()
    kw = dict(
        endpoint=ns.endpoint,
        timeout=ns.request_timeout,
        backend=ns.backend,
        base_url=ns.base_url,
        api_key=os.environ.get("OPENAI_API_KEY"),
    )
    if ns.client_procs > 1:
        per_proc = -(-ns.max_concurrency // ns.client_procs) if ns.max_concurrency else None
        records, t0, duration = drive_procs(workload, ns.client_procs, max_concurrency=per_proc, **kw)
    else:
        records, t0, duration = asyncio.run(
            drive(workload=workload, max_concurrency=ns.max_concurrency, progress=not ns.quiet, **kw)
        )
    server = None
    if ns.metrics_url and m_start is not None:
        timeline = sampler.stop() if sampler else []
        shift = t0 - sampler.t0 if sampler else 0.0
        for point in timeline:  # re-base on the benchmark's own clock
            point["t"] = round(point["t"] - shift, 4)
        m_end = bench_metrics.scrape(ns.metrics_url)
        inside = [p for p in timeline if 0.0 < p["t"] < duration]
        timeline = [{"t": 0.0, **m_start}, *inside, {"t": round(duration, 4), **m_end}]
        adapter_requests = sum(1 for r in records if r.adapter is not None and r.ok)
        d = bench_metrics.delta(m_start, m_end)
        derived = bench_metrics.derive(d, adapter_requests)
        if ns.model:
            bandwidth = ns.device_bandwidth * 1e9 if ns.device_bandwidth else _probe()
            model = roofline.ModelBytes.from_dir(ns.model)
            derived["roofline"] = roofline.serving_roofline(model, d, records, duration, bandwidth)
        server = {"start": m_start, "end": m_end, "delta": d, "derived": derived, "timeline": timeline}
    config = jsonable(vars(ns))
    config["request_rate"] = _rate_of(workload) if ns.workload else config["request_rate"]
    meta = {"source": source, "num_requests": len(workload), "sha256": workload_digest(workload)}
    report = make_report("bench_serving", ns.label or "lorapipe", config, meta, records, duration, server)
    emit_report(report, ns)
    return report


def _probe() -> float | None:
    """The device's copy bandwidth (bytes/s) when this process sees a GPU, else None."""
    import torch

    return roofline.probe_bandwidth("cuda", 256 << 20) if torch.cuda.is_available() else None


def _rate_of(workload: Sequence[WorkloadRequest]) -> float | None:
    """The mean request rate of a replayed workload (None when all requests arrive at once)."""
    span = max(r.arrival for r in workload) - min(r.arrival for r in workload)
    return (len(workload) - 1) / span if span > 0 else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench_serving", description=__doc__)
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="the server's client endpoint")
    p.add_argument(
        "--backend",
        choices=("lorapipe", "openai"),
        default="lorapipe",
        help="lorapipe: the ZeroMQ SDK at --endpoint; openai: streaming /v1/completions at --base-url "
        "(key from $OPENAI_API_KEY)",
    )
    p.add_argument("--base-url", metavar="URL", help="e.g. http://127.0.0.1:8000/v1 (with --backend openai)")
    p.add_argument("--metrics-url", metavar="URL", help="e.g. http://127.0.0.1:8001/metrics")
    p.add_argument("--metrics-interval", type=float, default=1.0, metavar="S", help="timeline; 0: off")
    p.add_argument(
        "--model",
        metavar="DIR",
        help="the served model's directory: report the bytes the run's steps read and their time at "
        "the device's bandwidth (needs --metrics-url; tools/roofline.py)",
    )
    p.add_argument(
        "--device-bandwidth",
        type=float,
        metavar="GBPS",
        help="copy bandwidth for --model (GB/s, `python -m tools.roofline probe`); default: probed here",
    )
    p.add_argument("--workload", type=Path, metavar="FILE", help="replay this workload JSONL")
    p.add_argument("--save-workload", type=Path, metavar="FILE", help="write the workload that ran")
    p.add_argument("--max-concurrency", type=int, metavar="C", help="at most C requests in flight")
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        metavar="N",
        help="drive the workload from N client processes (requests dealt round-robin), so that the "
        "client's own event loop does not cap what is measured (one process parses SSE streams at about "
        "a third of what the server sends at saturation)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="per reply wait")
    p.add_argument("--label", default="", help="name of this run in tables")
    p.add_argument("--out", type=Path, metavar="FILE", help="full results JSON")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="latency CDFs and timeline (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    add_workload_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.client_procs < 1:
        parser.error(f"--client-procs must be at least 1, got {ns.client_procs}")
    return run(ns)


if __name__ == "__main__":
    main()
