"""How long rank 0 of a tensor-parallel group is blocked handing each step to rank 1, and how late the step
reaches rank 1, on the CPU (two processes): the gloo hand-over (LaunchStep, then a tag-only message as a
step's finish was: each a size broadcast and a payload broadcast) against the ZeroMQ channel
(`stages/worker/tp/channel.py`: one LaunchStep a step, never waiting on rank 1).

python -m benchmarks.bench_handover --out handover.json [--batch 64 128] [--steps 2000] [--work-us 500]

Each step carries a decode plan of `batch` requests. Both ranks spend `work-us` of busy host time per
step beside the hand-over (each rank's own launch), then meet in a one-element all-reduce (the step's
collectives, which keep the ranks in step as the forward's do), rank 0 between its launch and its
finish. Per mode
and batch: rank 0's blocked microseconds per step (median, p90, mean), its whole step (mean), and how long
after rank 0 began sending a step rank 1 had it (median, p90; one monotonic clock for both processes)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from proto.plan import BatchPlan, CachedRequestData
from proto.tensor_parallel import LaunchStep, SyncCopies
from runtime.base.endpoints import free_port
from stages.worker.tp.channel import StepReceiver, StepSender, rank_address, rank_codec
from stages.worker.tp.group import TPGroup, TPSpec

WARMUP = 50


def _spin(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def _plan(step: int, batch: int) -> LaunchStep:
    reqs = [CachedRequestData(request_id=f"req-{100_000 + k}", num_scheduled_tokens=1) for k in range(batch)]
    return LaunchStep(plan=BatchPlan(step=step, cached_requests=reqs), finished=max(0, step - 1))


def _broadcast(group: TPGroup, data: bytes | None) -> bytes:
    """The gloo hand-over: the size, then the bytes, broadcast from rank 0."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0, group=group.control)
    if data is not None:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=group.control)
        return data
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, 0, group=group.control)
    return bytes(buf.numpy())


def _step_work(work_us: float) -> None:
    """A rank's own part of a step: its launch on the host, then the step's collectives."""
    _spin(work_us)
    dist.all_reduce(torch.zeros(1))


def _rank0(group: TPGroup, mode: str, batch: int, steps: int, work_us: float, sender: StepSender) -> dict:
    codec = rank_codec()
    blocked, whole, sent_at = [], [], []
    for i in range(WARMUP + steps):
        msg = _plan(i, batch)
        start = time.perf_counter_ns()
        if mode == "gloo":
            _broadcast(group, bytes(codec.encode(msg)[0]))
        else:
            sender.send(msg, lambda: None)
        handed = time.perf_counter_ns()
        _step_work(work_us)
        finish = time.perf_counter_ns()
        if mode == "gloo":
            _broadcast(group, bytes(codec.encode(SyncCopies())[0]))
        end = time.perf_counter_ns()
        if i >= WARMUP:
            blocked.append((handed - start + end - finish) / 1000)
            whole.append((end - start) / 1000)
            sent_at.append(start)
    return {"blocked": blocked, "whole": whole, "sent_at": sent_at}


def _rank1(group: TPGroup, mode: str, steps: int, work_us: float, receiver: StepReceiver) -> list[int]:
    codec = rank_codec()
    got_at = []
    for i in range(WARMUP + steps):
        if mode == "gloo":
            msg = codec.decode([_broadcast(group, None)])
        else:
            msg = receiver.recv()
        at = time.perf_counter_ns()
        assert msg.plan.step == i
        _step_work(work_us)
        if mode == "gloo":
            codec.decode([_broadcast(group, None)])
        if i >= WARMUP:
            got_at.append(at)
    return got_at


def _run(rank: int, port: int, tmp: str, batches: list[int], steps: int, work_us: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True) if rank == 0 else None
    sender = StepSender(tmp, 2) if rank == 0 else None
    group = TPGroup(TPSpec(rank=rank, size=2, host="127.0.0.1", port=port), torch.device("cpu"), store)
    receiver = StepReceiver(rank_address(tmp, 1)) if rank == 1 else None
    out = {}
    for batch in batches:
        for mode in ("gloo", "zmq"):
            dist.barrier(group=group.control)
            if rank == 0:
                out[f"{mode}/{batch}"] = _rank0(group, mode, batch, steps, work_us, sender)
            else:
                out[f"{mode}/{batch}"] = _rank1(group, mode, steps, work_us, receiver)
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier(group=group.control)
    if receiver is not None:
        receiver.close()
    if sender is not None:
        sender.close()
    group.close()


def _q(xs: list[float], q: float) -> float:
    return round(statistics.quantiles(xs, n=100)[int(q * 100) - 1], 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--work-us", type=float, default=500.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lorapipe-handover-") as tmp:
        mp.spawn(_run, args=(free_port(), tmp, a.batch, a.steps, a.work_us), nprocs=2)
        r0, r1 = (json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in (0, 1))
    rows = []
    for key, t0 in r0.items():
        late = [(got - sent) / 1000 for got, sent in zip(r1[key], t0["sent_at"], strict=True)]
        mode, batch = key.split("/")
        rows.append({
            "mode": mode, "batch": int(batch), "steps": a.steps, "work_us": a.work_us,
            "rank0_blocked_us": {"median": _q(t0["blocked"], 0.5), "p90": _q(t0["blocked"], 0.9),
                                 "mean": round(statistics.fmean(t0["blocked"]), 1)},
            "rank0_step_us_mean": round(statistics.fmean(t0["whole"]), 1),
            "rank1_has_it_after_us": {"median": _q(late, 0.5), "p90": _q(late, 0.9)},
        })  # fmt: skip
    a.out.write_text(json.dumps(rows, indent=1))
    head = ("mode", "batch", "blocked us: median", "p90", "mean", "step us", "rank 1 has it: median", "p90")
    print(" | ".join(head))
    for r in rows:
        b, h = r["rank0_blocked_us"], r["rank1_has_it_after_us"]
        step = r["rank0_step_us_mean"]
        cells = (r["mode"], r["batch"], b["median"], b["p90"], b["mean"], step, h["median"], h["p90"])
        print(" | ".join(str(c) for c in cells))


if __name__ == "__main__":
    main()
