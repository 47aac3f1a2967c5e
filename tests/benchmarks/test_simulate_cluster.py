"""The routing simulator: its curve inputs are the numbers docs/benchmarks.md reports; every request
completes exactly once; a one-replica case matches the time computed by hand from the curves; bounded-load
affinity obeys its bound and keeps each adapter on one replica while no replica is full; the endpoint
picker's scorer prefers a replica where the adapter is active."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from benchmarks.cluster_sim.curves import DEFAULT_FILE, CurveError, Curves
from benchmarks.cluster_sim.engine import Cluster
from benchmarks.cluster_sim.replica import Request
from benchmarks.cluster_sim.routers import POLICIES, AffinityRouter, EndpointPickerRouter, make_router
from benchmarks.simulate_cluster import best_within, fresh, main, make_requests, simulate

BENCHMARKS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


@pytest.fixture(scope="module")
def curves() -> Curves:
    return Curves.load()


def _numbers(entry) -> list[float]:
    if isinstance(entry, dict):
        return [x for k, v in entry.items() if k not in ("source", "provisional") for x in _numbers(v)]
    if isinstance(entry, list):
        return [x for v in entry for x in _numbers(v)]
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        return [float(entry)]
    return []


def test_every_curve_value_is_a_number_docs_benchmarks_reports():
    text = BENCHMARKS.read_text().replace(",", "")
    reported = {float(m) for m in re.findall(r"\d+(?:\.\d+)?", text)}
    raw = json.loads(DEFAULT_FILE.read_text())
    for key, entry in raw.items():
        if not isinstance(entry, dict):
            continue
        assert entry["source"].startswith("docs/benchmarks.md"), key
        for x in _numbers({k: v for k, v in entry.items() if k not in ("points",)}) + [
            p["ms"] for p in entry.get("points", [])
        ]:
            if x in (0.0, 2048.0) or (key == "decode_step_ms" and x in (64, 256, 32)):
                continue
            assert x in reported, f"{key}: {x} is not a number docs/benchmarks.md reports"


def test_a_curve_without_a_citation_is_refused(tmp_path):
    raw = json.loads(DEFAULT_FILE.read_text())
    raw["gpu_pool"]["source"] = "measured somewhere"
    bad = tmp_path / "curves.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(CurveError, match="'gpu_pool' cites no docs/benchmarks.md section"):
        Curves.load(bad)


def test_decode_curve_passes_through_the_measured_points(curves):
    points = json.loads(DEFAULT_FILE.read_text())["decode_step_ms"]["points"]
    at = {(p["batch"], p["distinct_adapters"]): p["ms"] for p in points}
    for (b, k), ms in at.items():
        assert curves.decode_ms(b, k) == pytest.approx(ms), (b, k)
    batches = sorted({b for b, _ in at})
    small, large = batches[0], batches[-1]
    assert curves.decode_ms(1, 0) == pytest.approx(at[(small, 0)])  # below the smallest batch: its time
    counts = sorted(k for b, k in at if b == large)
    k0, k1 = counts[-3], counts[-2]
    mid = (k0 + k1) // 2  # between two measured counts: on the line through them
    want = at[(large, k0)] + (at[(large, k1)] - at[(large, k0)]) * (mid - k0) / (k1 - k0)
    assert curves.decode_ms(large, mid) == pytest.approx(want)
    assert curves.decode_ms(large, counts[-1] * 2) == pytest.approx(at[(large, counts[-1])])  # flat beyond
    half = (small + large) // 2  # between batch sizes: linear in batch at the same count
    frac = (half - small) / (large - small)
    want = at[(small, 0)] + (at[(large, 0)] - at[(small, 0)]) * frac
    assert curves.decode_ms(half, 0) == pytest.approx(want)


def run(curves, policy, n, requests, n_adapters, drain=60.0, router=None, window=(0.0, 1e9)):
    router = router or make_router(policy, n, 0, 182, curves.max_running)
    cluster = Cluster(curves, n, router, [16] * n_adapters, window)
    cluster.run(requests, drain)
    return cluster


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_completes_exactly_once(curves, policy):
    reqs = make_requests(400, "zipf:1.0", 400.0, 3.0, (16, 300), (1, 40), seed=3)
    c = run(curves, policy, 4, reqs, 400, drain=120.0)
    ids = [r.rid for r in c.done]
    assert sorted(ids) == list(range(len(reqs)))
    for r in reqs:
        assert r.arrival <= r.first_token <= r.done, r
    for rep in c.replicas:
        assert (rep.outstanding, rep.running, rep.refs, rep.blocked, rep.active) == (0, 0, {}, {}, {})
        assert not rep.ready and not rep.completions
        assert rep.gpu_used <= curves.gpu_pool_bytes and rep.host_used <= curves.host_cache_bytes
    assert int(c.outstanding.sum()) == c.total_outstanding == 0


def test_one_replica_times_by_hand(curves):
    raw = json.loads(DEFAULT_FILE.read_text())  # the file's own numbers, worked through by hand
    at = {(p["batch"], p["distinct_adapters"]): p["ms"] for p in raw["decode_step_ms"]["points"]}
    prefill = raw["prefill_ms_per_2048_tokens"]
    size = raw["adapter_bytes"]["mb_by_rank"]["16"] * 1e6
    disk = size / (raw["disk_to_host"]["gb_s"] * 1e9)
    h2d = size / (raw["host_to_gpu"]["peak_gb_s"] * 1e9 * raw["host_to_gpu"]["ratio"])
    reqs = [Request(0, 0.0, None, 2048, 1), Request(1, 10.0, 0, 2048, 3)]
    c = run(curves, "random", 1, reqs, 1)
    base, lora = reqs
    first = (at[(64, 0)] + prefill["base_only"]) / 1000  # batch 1 takes the batch-64 time
    assert base.first_token == pytest.approx(first) and base.done == base.first_token
    step = at[(64, 1)]  # batch 1 (flat below 64), one distinct adapter
    first = 10.0 + disk + h2d + (step + prefill["with_adapters"]) / 1000
    assert lora.first_token == pytest.approx(first)
    assert lora.done == pytest.approx(first + 2 * step / 1000)
    stats = c.replicas[0].stats
    assert (stats.disk_loads, stats.gpu_loads) == (1, 1)
    assert stats.idle_s == pytest.approx(c.now - (base.done - 0.0) - (lora.done - 10.0 - disk - h2d))
    assert stats.stalled_s == pytest.approx(disk + h2d)


def test_affinity_obeys_the_bound_and_keeps_adapters_on_one_replica_while_none_is_full(curves):
    light = make_requests(200, "zipf:1.0", 100.0, 5.0, (64, 64), (8, 8), seed=1)
    router = AffinityRouter(8, 0)
    c = run(curves, "affinity", 8, light, 200, router=router)
    assert c.result("affinity", 100.0, light).max_replicas_per_adapter == 1
    for rep in c.replicas:  # no replica was ever full: each adapter lives where its hash points
        for a in rep.stats.adapters_loaded:
            assert router.walk(a)[0] == rep.idx

    heavy = make_requests(50, "zipf:1.2", 4000.0, 2.0, (256, 256), (64, 64), seed=2)
    router = AffinityRouter(8, 0, c=1.25, record=True)
    c = run(curves, "affinity", 8, heavy, 50, router=router)
    spilled = 0
    assert router.decisions
    for adapter, chosen, cap, loads in router.decisions:
        assert cap == max(32, math.ceil(1.25 * (sum(loads) + 1) / 8))
        walk = router.walk(adapter)
        position = walk.index(chosen)
        assert loads[chosen] + 1 <= cap, "a replica over the bound was chosen"
        assert all(loads[i] + 1 > cap for i in walk[:position]), "a replica with room was skipped"
        spilled += position > 0
    assert spilled > 0, "the heavy run never reached the bound: it tests nothing"
    farthest: dict[int, int] = {}
    for adapter, chosen, _, _ in router.decisions:
        farthest[adapter] = max(farthest.get(adapter, 0), router.walk(adapter).index(chosen))
    for rep in c.replicas:  # an adapter is only ever loaded where the bound sent one of its requests
        for a in rep.stats.adapters_loaded:
            assert router.walk(a).index(rep.idx) <= farthest[a]


def test_the_endpoint_picker_prefers_where_the_adapter_runs_unless_a_queue_outweighs_it(curves):
    router = EndpointPickerRouter(4, 0, max_lora=182, max_running=256)
    running = [Request(0, 0.0, 7, 16, 200), Request(1, 0.2, 7, 16, 5)]  # the first runs when the second comes
    run(curves, "epp", 4, running, 8, router=router)
    assert running[0].replica == running[1].replica
    # The first still waits for its adapter (a queue of 1 there): the queue score (weight 1, normalised
    # 0..1) outweighs the LoRA affinity's 1.0 against 0.8 (weight 2), so the picker goes elsewhere.
    waiting = [Request(0, 0.0, 7, 16, 200), Request(1, 0.001, 7, 16, 5)]
    run(curves, "epp", 4, waiting, 8, router=EndpointPickerRouter(4, 0, max_lora=182, max_running=256))
    assert waiting[0].replica != waiting[1].replica


def test_best_within_takes_the_fastest_run_inside_the_bound(curves):
    reqs = make_requests(50, "zipf:1.0", 200.0, 4.0, (64, 64), (16, 16), seed=0)
    results = [
        simulate(curves, p, 2, fresh(reqs), [16], 1.0, 4.0, 30.0, 0, 200.0, 50)
        for p in ("random", "affinity")
    ]
    best = best_within(results, math.inf)
    assert set(best) == {"random", "affinity"} and all(best.values())
    assert best_within(results, 0.0) == {"random": None, "affinity": None}


def test_the_command_line_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    main(["--replicas", "2", "--adapters", "20", "--rates-per-replica", "5", "--duration", "3",
          "--warmup", "1", "--policies", "random,affinity", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "| random | 10 |" in printed and "| affinity | 10 |" in printed
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["results"]] == ["random", "affinity"]
    assert data["curves"]["gpu_pool"]["gb"] == 4
