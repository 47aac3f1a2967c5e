"""One workload driven from several client processes, so that the client's own event loop is not what a
benchmark measures (one Python process parsing hundreds of SSE streams tops out well below the server:
measured on the H100, 6k output tok/s from one httpx process against 17k from four). Requests are dealt
round-robin in arrival order; the processes connect, meet at a barrier, then each replays its share
on the shared monotonic clock; their records come back as JSON and are re-based on the earliest start."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
from collections.abc import Sequence
from typing import Any

from tools.bench_report import RequestRecord
from tools.workload import WorkloadRequest, dumps, loads


def _child(share: bytes, kw: dict[str, Any], barrier: Any, conn: Any) -> None:
    """Runs in a client process: replays `share` (workload JSONL), sends back (t0, duration, records)."""
    from tools.bench_serving import drive

    workload = loads(share, "a client process's share")
    records, t0, duration = asyncio.run(drive(workload=workload, start_barrier=barrier, **kw))
    conn.send_bytes(json.dumps([t0, duration, [dataclasses.asdict(r) for r in records]]).encode())
    conn.close()


def drive_procs(
    workload: Sequence[WorkloadRequest], procs: int, **kw: Any
) -> tuple[list[RequestRecord], float, float]:
    """`drive` (tools/bench_serving.py) over `procs` processes: the records in workload order, the
    earliest start (time.monotonic, shared by all processes on Linux) and the duration until the last
    request ended."""
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    shares = [order[k::procs] for k in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(procs)
    kw = {**kw, "progress": False}
    children, pipes = [], []
    for idx in shares:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(dumps(workload[i] for i in idx), kw, barrier, send), daemon=True)
        p.start()
        send.close()
        children.append(p)
        pipes.append(recv)
    try:
        results = [json.loads(r.recv_bytes()) for r in pipes]
    except EOFError:
        raise RuntimeError("a client process died; see its traceback above") from None
    finally:
        for p in children:
            p.join(timeout=30)
    t0 = min(t for t, _, _ in results)
    end = max(t + d for t, d, _ in results)
    records: list[RequestRecord | None] = [None] * len(workload)
    for idx, (t, _, recs) in zip(shares, results, strict=True):
        for i, r in zip(idx, recs, strict=True):
            rec = RequestRecord(**r)
            rec.index, rec.start, rec.end = i, rec.start + t - t0, rec.end + t - t0
            records[i] = rec
    assert all(r is not None for r in records)
    return records, t0, end - t0  # type: ignore[return-value]
