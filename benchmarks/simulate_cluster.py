"""Routing simulator for many lorapipe replicas and many adapters: a discrete-event model of N replicas,
each following the curves measured on one H100 (benchmarks/cluster_curves.json, every value cited from
docs/benchmarks.md), under Zipf or bursty popularity, comparing routing policies over a sweep of request
rates. Prints one table and the best throughput each policy reaches within a P99 TTFT bound; --out
writes everything as JSON.
    python -m benchmarks.simulate_cluster --replicas 128 --adapters 10000 --popularity zipf:1.0"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.cluster_sim.curves import DEFAULT_FILE, Curves
from benchmarks.cluster_sim.engine import Cluster, Result
from benchmarks.cluster_sim.replica import Request
from benchmarks.cluster_sim.routers import POLICIES, make_router
from tools.workload import _adapters, _arrivals, _draw, parse_span, sub_seed


def make_requests(
    n_adapters: int,
    popularity: str,
    rate: float,
    duration_s: float,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
) -> list[Request]:
    """Poisson arrivals at `rate` for `duration_s`; adapters drawn as tools/workload.py draws them
    (zipf:ALPHA in index order, bursty:PHASES, uniform)."""
    n = max(1, round(rate * duration_s))
    arrivals = _arrivals(n, rate, random.Random(sub_seed(seed, "arrivals")))
    adapters = _adapters(n, list(range(n_adapters)), popularity, random.Random(sub_seed(seed, "adapters")))
    lengths = random.Random(sub_seed(seed, "lengths"))
    return [
        Request(i, t, a, _draw(lengths, input_len), _draw(lengths, output_len))
        for i, (t, a) in enumerate(zip(arrivals, adapters, strict=True))
    ]


def simulate(
    curves: Curves,
    policy: str,
    replicas: int,
    requests: list[Request],
    ranks: list[int],
    warmup_s: float,
    duration_s: float,
    drain_s: float,
    seed: int,
    offered: float,
    n_adapters: int,
    prewarm: list[Request] | None = None,
) -> Result:
    max_lora = int(curves.gpu_pool_bytes // curves.adapter_bytes(min(ranks)))
    router = make_router(policy, replicas, seed, max_lora, curves.max_running)
    cluster = Cluster(curves, replicas, router, [ranks[a % len(ranks)] for a in range(n_adapters)],
                      (warmup_s, duration_s))  # fmt: skip
    if prewarm:
        cluster.prewarm(prewarm)
    cluster.run(requests, drain_s)
    return cluster.result(policy, offered, requests)


def fresh(requests: list[Request]) -> list[Request]:
    return [Request(r.rid, r.arrival, r.adapter, r.prompt, r.output) for r in requests]


def best_within(results: list[Result], slo_s: float) -> dict[str, Result | None]:
    """Per policy, the run with the highest throughput whose P99 TTFT is within `slo_s`."""
    out: dict[str, Result | None] = {}
    for r in results:
        ok = r.ttft_p99_s <= slo_s and r.completed == r.requests
        cur = out.get(r.policy)
        if ok and (cur is None or r.output_tok_s > cur.output_tok_s):
            out[r.policy] = r
        else:
            out.setdefault(r.policy, None)
    return out


def _ms(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x * 1000:.0f}"


def table(results: list[Result]) -> str:
    head = ("| policy | offered req/s | done/arrived | out tok/s | TTFT P50 / P99 (ms) | disk loads/s "
            "| GPU idle (stalled) | max replicas per adapter |")  # fmt: skip
    rows = [head, "|" + " --- |" * 8]
    for r in results:
        rows.append(
            f"| {r.policy} | {r.offered_req_s:,.0f} | {r.completed}/{r.requests} | {r.output_tok_s:,.0f} "
            f"| {_ms(r.ttft_p50_s)} / {_ms(r.ttft_p99_s)} | {r.disk_loads_s:,.0f} "
            f"| {r.gpu_idle_share:.2f} ({r.gpu_stalled_share:.2f}) | {r.max_replicas_per_adapter} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--replicas", type=int, default=128)
    p.add_argument("--adapters", type=int, default=10_000)
    p.add_argument("--popularity", default="zipf:1.0", help="zipf:ALPHA | bursty:PHASES | uniform")
    p.add_argument("--ranks", default="16", help="adapter ranks, cycled over adapter indexes (16, 64)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rates-per-replica", default="20,40,60,80,100,120", help="req/s per replica")
    p.add_argument("--input-len", default="256", help="N or LO:HI")
    p.add_argument("--output-len", default="128", help="N or LO:HI")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds before measuring (caches fill)")
    p.add_argument("--drain", type=float, default=30.0, help="seconds after the last arrival to finish")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="P99 TTFT bound for the summary, seconds")
    p.add_argument("--prewarm", type=int, default=2, help="cache fills routed before the run (0: cold)")
    p.add_argument("--loader", choices=("serving", "bench"), default="serving", help="disk→host rate")
    p.add_argument("--curves", type=Path, default=DEFAULT_FILE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    policies = a.policies.split(",")
    bad = [x for x in policies if x not in POLICIES]
    if bad or a.replicas < 1 or a.adapters < 1 or not 0 <= a.warmup < a.duration:
        p.error(f"policies {bad} unknown (have {POLICIES}), or --replicas/--adapters < 1, or not "
                "0 <= --warmup < --duration")  # fmt: skip
    ranks = [int(r) for r in a.ranks.split(",")]
    curves = Curves.load(a.curves, a.loader)
    host_slots = int(curves.host_cache_bytes // curves.adapter_bytes(min(ranks)))
    sample = make_requests(a.adapters, a.popularity, 1.0, a.prewarm * host_slots * a.replicas, (1, 1), (1, 1),
                           a.seed + 1) if a.prewarm else None  # fmt: skip
    results: list[Result] = []
    for per in [float(x) for x in a.rates_per_replica.split(",")]:
        rate = per * a.replicas
        reqs = make_requests(a.adapters, a.popularity, rate, a.duration, parse_span(a.input_len),
                             parse_span(a.output_len), a.seed)  # fmt: skip
        for policy in policies:
            t0 = time.perf_counter()
            r = simulate(curves, policy, a.replicas, fresh(reqs), ranks, a.warmup, a.duration, a.drain,
                         a.seed, rate, a.adapters, sample)  # fmt: skip
            results.append(r)
            took = time.perf_counter() - t0
            print(f"{policy:>13} @ {rate:,.0f} req/s: {r.output_tok_s:,.0f} tok/s, P99 TTFT "
                  f"{_ms(r.ttft_p99_s)} ms ({took:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    print(table(results))
    best = best_within(results, a.ttft_slo)
    print(f"\nBest throughput with P99 TTFT <= {a.ttft_slo:g} s and every request done:")
    for policy, r in best.items():
        print(
            f"- {policy}: "
            + (f"{r.output_tok_s:,.0f} tok/s at {r.offered_req_s:,.0f} req/s" if r else "none")
        )
    if best.get("affinity") and best.get("random"):
        print(f"affinity / random: {best['affinity'].output_tok_s / best['random'].output_tok_s:.2f}x")
    if a.out:
        a.out.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "curves": json.loads(a.curves.read_text()),
            "results": [asdict(r) for r in results],
            "best_within_slo": {k: asdict(v) if v else None for k, v in best.items()},
        }, indent=1, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
