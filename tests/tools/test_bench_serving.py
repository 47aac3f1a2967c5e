"""The benchmarks: workload files (same seed, same bytes; replay sends the same requests), bench_serving
against `lorapipe serve` on the tiny model (zipf and bursty adapters, open and closed loop) and
bench_peft on the same workload, checking every report's invariants and that both give the same tokens."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from benchmarks import bench_peft
from tests.integration.serving import serve
from tools import bench_serving, roofline
from tools import workload as wl
from tools.bench_report import format_table, markdown_table, percentiles

ADAPTERS = "full8,qv5,mlp1,rs12"  # the llama_adapters fixture's names
FLAGS = ("--max-loras-per-batch", "2", "--max-lora-rank", "16", "--log-level", "warning")


@pytest.fixture(scope="module")
def server(tiny_llama, llama_adapters):
    with serve(tiny_llama, llama_adapters, *FLAGS) as s:
        yield s


def bench(server, *args: str) -> dict:
    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    base = ["--endpoint", server.endpoint, "--metrics-url", metrics, "--metrics-interval", "0.2", "--quiet"]
    return bench_serving.main([*base, "--request-timeout", "60", *args])


def check_report(report: dict, workload: list[wl.WorkloadRequest]) -> None:
    """Invariants every report must satisfy when all requests succeed with ignore_eos."""
    reqs, s = report["requests"], report["summary"]
    assert [r["index"] for r in reqs] == list(range(len(workload)))  # each request exactly once
    assert s["num_requests"] == s["completed"] == len(workload) and s["failed"] == 0
    assert report["workload"]["sha256"] == wl.workload_digest(workload)
    for r, w in zip(reqs, workload, strict=True):
        assert r["error"] is None and r["adapter"] == w.adapter and r["arrival"] == w.arrival
        assert 0 < r["ttft"] <= r["e2e"], r
        assert r["output_tokens"] == len(r["token_ids"]) == w.max_tokens
        assert len(r["itl"]) == r["output_tokens"] - 1 and min(r["itl"], default=0) >= 0
        assert r["ttft"] + sum(r["itl"]) <= r["e2e"] + 1e-6
        assert r["start"] <= r["end"] and r["prompt_tokens"] == len(w.prompt_value())
    assert s["output_tokens"] == sum(r["output_tokens"] for r in reqs)
    assert s["ttft"]["p50"] <= s["ttft"]["p99"] and s["output_throughput"] > 0
    for key in ("host_cache_hit_rate", "gpu_slot_hit_rate"):
        assert s.get(key) is None or 0.0 <= s[key] <= 1.0
    assert "TTFT" in format_table(report)


def check_server_counters(report: dict) -> None:
    s = report["summary"]
    assert s["server_output_tokens"] == s["output_tokens"]  # what we counted = what the server streamed
    assert len({r["request_id"] for r in report["requests"]}) == s["num_requests"]
    if any(r["adapter"] for r in report["requests"]):
        assert s["gpu_slot_hit_rate"] is not None
    timeline = report["server_metrics"]["timeline"]
    assert len(timeline) >= 2 and all(a["t"] <= b["t"] for a, b in zip(timeline, timeline[1:], strict=False))


# --- workload files (no server) -------------------------------------------------------------------
@pytest.mark.timeout(30)
def check_roofline(report: dict, model) -> None:
    """The bytes of the run: the server's plans times the weights, every completed request's KV, and
    adapter rows only when requests used adapters (each plan's distinct adapters, at most every adapter
    of the workload in every plan)."""
    rf, d = report["summary"]["roofline"], report["server_metrics"]["delta"]
    per_step = roofline.ModelBytes.from_dir(model)
    assert rf["steps"] == d["plans"] > 0 and rf["weight_bytes"] == d["plans"] * per_step.weight_bytes
    kv = sum(roofline.kv_tokens_read(r["prompt_tokens"], r["output_tokens"]) for r in report["requests"])
    assert rf["kv_bytes"] == kv * per_step.kv_token_bytes
    used = any(r["adapter"] for r in report["requests"])
    assert rf["adapter_bytes_counted"] and (rf["adapter_bytes"] > 0) == used
    assert rf["floor_s"] == pytest.approx(rf["total_bytes"] / 100e9)
    assert "Bytes floor at 100 GB/s" in format_table(report)


def test_same_seed_same_file_and_round_trip(tmp_path):
    args = ["--num-prompts", "40", "--request-rate", "8", "--input-len", "4:32", "--output-len", "2:9"]
    args += ["--adapters", ADAPTERS, "--adapter-distribution", "zipf:1.2", "--base-share", "0.2"]
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        wl.main(["--out", str(tmp_path / f"{name}.jsonl"), *args, "--seed", seed])
    a, b, c = ((tmp_path / f"{n}.jsonl").read_bytes() for n in "abc")
    assert a == b and a != c
    reqs = wl.read_workload(tmp_path / "a.jsonl")
    assert wl.dumps(reqs) == a and len(reqs) == 40
    assert [r.prompt_value() for r in reqs] == [
        r.prompt_value() for r in wl.read_workload(tmp_path / "b.jsonl")
    ]
    # the rate only moves arrivals: the same requests arrive at other times
    spec = wl.spec_from_args(bench_serving.build_parser().parse_args([*args, "--seed", "7"]))
    saturated = wl.generate_workload(spec.__class__(**{**spec.__dict__, "request_rate": math.inf}))
    assert all(s.arrival == 0.0 for s in saturated)
    assert [(s.adapter, s.max_tokens, s.input_len, s.prompt_seed) for s in saturated] == [
        (r.adapter, r.max_tokens, r.input_len, r.prompt_seed) for r in reqs
    ]


@pytest.mark.timeout(30)
def test_distributions(tmp_path):
    names = tuple(f"a{i}" for i in range(6))

    def gen(dist: str, n: int = 600, **kw) -> list[wl.WorkloadRequest]:
        return wl.generate_workload(wl.WorkloadSpec(num_prompts=n, adapters=names, distribution=dist, **kw))

    assert [r.adapter for r in gen("distinct", 12)] == list(names) * 2
    zipf = [r.adapter for r in gen("zipf:1.5")]
    counts = [zipf.count(a) for a in names]
    assert counts == sorted(counts, reverse=True) and counts[0] > 3 * counts[-1]
    bursty = [r.adapter for r in gen("bursty:3")]
    phases = [set(bursty[i * 200 : (i + 1) * 200]) for i in range(3)]
    assert phases == [{"a0", "a1"}, {"a2", "a3"}, {"a4", "a5"}]
    uniform = gen("uniform", base_share=0.25)
    base = sum(r.adapter is None for r in uniform) / len(uniform)
    assert 0.18 < base < 0.32 and {r.adapter for r in uniform} == {*names, None}
    poisson = gen("uniform", request_rate=20.0)
    assert poisson[0].arrival == 0.0 and 20 < poisson[-1].arrival < 40  # 600 requests at ~20/s
    with pytest.raises(ValueError):
        gen("zipfian")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "The river", "output_len": 3}\n{"prompt_ids": [5, 6, 7]}\n')
    from_file = gen("uniform", 4, prompt_file=str(prompts), output_len=(5, 5))
    assert [r.prompt_value() for r in from_file] == ["The river", [5, 6, 7]] * 2
    assert [r.max_tokens for r in from_file] == [3, 5, 3, 5]
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {"mean": 3.0, "p50": 3.0, "p95": 4.8, "p99": 4.96}


# --- bench_serving against a running pipeline -------------------------------------------------------
@pytest.mark.timeout(120)
def test_zipf_open_loop_report_and_replay(server, tiny_llama, tmp_path):
    saved, out = tmp_path / "zipf.jsonl", tmp_path / "zipf.json"
    gen = ["--num-prompts", "24", "--request-rate", "60", "--input-len", "4:16", "--output-len", "3:8"]
    gen += ["--adapters", ADAPTERS, "--adapter-distribution", "zipf:1.1", "--base-share", "0.25"]
    first = bench(server, *gen, "--seed", "3", "--save-workload", str(saved), "--out", str(out))
    workload = wl.read_workload(saved)
    check_report(first, workload)
    check_server_counters(first)
    assert json.loads(out.read_text()) == json.loads(json.dumps(first))
    assert first["summary"]["adapter_loads"] is not None and first["summary"]["bytes_loaded"] is not None

    wl.main(["--out", str(tmp_path / "again.jsonl"), *gen, "--seed", "3"])
    assert (tmp_path / "again.jsonl").read_bytes() == saved.read_bytes()
    replay = bench(server, "--workload", str(saved), "--model", str(tiny_llama), "--device-bandwidth", "100")
    check_report(replay, workload)
    check_server_counters(replay)
    check_roofline(replay, tiny_llama)
    for a, b in zip(first["requests"], replay["requests"], strict=True):
        assert (a["adapter"], a["max_tokens"], a["prompt_tokens"]) == (
            b["adapter"],
            b["max_tokens"],
            b["prompt_tokens"],
        )
        assert a["token_ids"] == b["token_ids"]  # greedy on the same weights
    table = markdown_table([first, replay], baseline=first)
    assert table.count("\n") == 3 and "1.00×" in table


@pytest.mark.timeout(120)
def test_openai_backend_runs_the_same_workload_over_http(server, tmp_path):
    saved = tmp_path / "http.jsonl"
    gen = ["--num-prompts", "12", "--input-len", "4:16", "--output-len", "3:8", "--seed", "21"]
    gen += ["--adapters", ADAPTERS, "--adapter-distribution", "uniform", "--base-share", "0.25"]
    sdk = bench(server, *gen, "--save-workload", str(saved))
    workload = wl.read_workload(saved)
    http = bench(server, "--workload", str(saved), "--backend", "openai", "--base-url", server.base_url)
    assert [r["error"] for r in http["requests"]] == [None] * len(workload)
    check_report(http, workload)
    check_server_counters(http)
    for a, b in zip(sdk["requests"], http["requests"], strict=True):
        assert a["token_ids"] == b["token_ids"]  # greedy: the same tokens through either front door
    # the same workload from 3 client processes: every request once, in workload order, same tokens,
    # its times on one clock (each starts after the earliest start and ends within the run)
    multi = bench(
        server, "--workload", str(saved), "--backend", "openai", "--base-url", server.base_url,
        "--client-procs", "3",
    )  # fmt: skip
    check_report(multi, workload)
    check_server_counters(multi)
    duration = multi["summary"]["duration_s"]
    for a, b in zip(sdk["requests"], multi["requests"], strict=True):
        assert a["token_ids"] == b["token_ids"]
        assert 0.0 <= b["start"] <= b["end"] <= duration + 1e-6


@pytest.mark.timeout(120)
def test_bursty_closed_loop(server, tmp_path):
    plot = tmp_path / "bursty.png" if importlib.util.find_spec("matplotlib") else None
    saved = tmp_path / "bursty.jsonl"
    report = bench(
        server,
        *("--num-prompts", "24", "--max-concurrency", "4", "--input-len", "6", "--output-len", "4"),
        *("--adapters", ADAPTERS, "--adapter-distribution", "bursty:2", "--seed", "5"),
        *("--save-workload", str(saved), *(["--plot", str(plot)] if plot else [])),
    )
    workload = wl.read_workload(saved)
    assert {w.arrival for w in workload} == {0.0}
    assert {w.adapter for w in workload[:12]} <= {"full8", "qv5"} and {w.adapter for w in workload[12:]} <= {
        "mlp1",
        "rs12",
    }
    check_report(report, workload)
    check_server_counters(report)
    starts = sorted(
        [(r["start"], 1) for r in report["requests"]] + [(r["end"], -1) for r in report["requests"]]
    )
    running = [sum(d for _, d in starts[: i + 1]) for i in range(len(starts))]
    assert max(running) <= 4  # the concurrency cap held
    assert plot is None or plot.stat().st_size > 10_000


@pytest.mark.timeout(60)
def test_failed_requests_are_counted_once(server, tmp_path):
    path = tmp_path / "bad.jsonl"
    reqs = [
        wl.WorkloadRequest(arrival=0.0, adapter=a, max_tokens=3, input_len=5) for a in ("qv5", "nope") * 2
    ]
    wl.write_workload(path, reqs)
    report = bench(server, "--workload", str(path))
    s = report["summary"]
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 2, 2)
    assert [r["error"] is None for r in report["requests"]] == [True, False, True, False]
    assert all("UnknownAdapter" in r["error"] for r in report["requests"][1::2])
    assert s["output_tokens"] == s["server_output_tokens"] == 6


# --- the PEFT baseline on the same workload ----------------------------------------------------------
@pytest.mark.timeout(120)
def test_peft_baseline_matches_serving(server, tiny_llama, llama_adapters, tmp_path):
    pytest.importorskip("peft")
    saved = tmp_path / "peft.jsonl"
    gen = ["--num-prompts", "6", "--request-rate", "30", "--input-len", "12", "--output-len", "6"]
    gen += ["--adapters", ADAPTERS, "--adapter-distribution", "distinct", "--base-share", "0.3"]
    served = bench(server, *gen, "--seed", "11", "--save-workload", str(saved))
    workload = wl.read_workload(saved)
    adapters = [f"--adapter={name}={path}" for name, path in llama_adapters.items()]
    common = ["--workload", str(saved), "--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32"]
    peft = bench_peft.main(
        [*common, *adapters, "--batch-size", "3", "--quiet", "--out", str(tmp_path / "p.json")]
    )
    check_report(served, workload)
    check_report(peft, workload)
    assert peft["config"]["batch_size"] == 3 and peft["summary"].get("gpu_slot_hit_rate") is None
    for r in peft["requests"]:
        assert r["start"] >= r["arrival"] - 1e-9  # no request starts before it arrives
    # Both run greedy on the same float32 weights; with random weights, ties in the top logit do not occur.
    assert [r["token_ids"] for r in peft["requests"]] == [r["token_ids"] for r in served["requests"]]
    base = bench_peft.main(
        [*common, "--no-adapters", "--batch-size", "auto", "--auto-sizes", "2,4", "--quiet"]
    )
    check_report(base, workload)
    assert set(base["config"]["batch_size_probe"]) == {2, 4}
