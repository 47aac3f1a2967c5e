"""Per-stage registries carry the stage label; the launcher's merge is valid exposition text, served
over HTTP by prometheus_client."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.base.metrics import StageMetrics, merge_expositions, serve_metrics


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _stage(name: str) -> StageMetrics:
    m = StageMetrics(name)
    m.messages_in.labels(socket="client", type="GenerateRequest").inc(3)
    m.service_seconds.labels(queue="requests").observe(0.002)
    m.track_queue("requests", lambda: 5, 1024)
    return m


def test_stage_exposition_parses_and_every_sample_has_the_stage_label():
    m = _stage("scheduler")
    pages = m.gauge("lorapipe_kv_pages_used", "KV pages in use")
    pages.set(12)
    loads = m.counter("lorapipe_adapter_loads", "Adapter loads", ["result"])
    loads.labels(result="ok").inc()
    lat = m.histogram("lorapipe_load_seconds", "Load latency", (), [0.01, 0.1, 1])
    lat.observe(0.05)
    fams = _families(m.exposition())
    samples = [s for f in fams.values() for s in f.samples]
    assert samples and all(s.labels["stage"] == "scheduler" for s in samples)
    assert fams["lorapipe_kv_pages_used"].samples[0].value == 12
    assert fams["lorapipe_queue_depth"].samples[0].labels == {"stage": "scheduler", "queue": "requests"}
    assert fams["lorapipe_queue_depth"].samples[0].value == 5
    assert fams["lorapipe_adapter_loads"].type == "counter"
    assert not any(name.endswith("_created") for name in fams)


def test_merged_exposition_has_one_family_per_metric_and_stage_up():
    text = merge_expositions(
        {
            "tokenizer": _stage("tokenizer").exposition(),
            "worker": _stage("worker").exposition(),
            "loader": None,
        }
    ).decode()
    assert text.count("# TYPE lorapipe_messages_in_total counter") == 1
    fams = _families(text)
    stages = {s.labels["stage"] for s in fams["lorapipe_messages_in"].samples}
    assert stages == {"tokenizer", "worker"}
    up = {s.labels["stage"]: s.value for s in fams["lorapipe_stage_up"].samples}
    assert up == {"tokenizer": 1.0, "worker": 1.0, "loader": 0.0}


@pytest.mark.timeout(30)
def test_launcher_serves_merged_metrics_over_http():
    stage = _stage("tokenizer")
    server, thread = serve_metrics(0, lambda: {"tokenizer": stage.exposition()})
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        assert (
            'lorapipe_messages_in_total{socket="client",stage="tokenizer",type="GenerateRequest"} 3.0' in text
        )
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_gauge_map_reads_its_values_once_per_scrape():
    m = StageMetrics("scheduler")
    calls = []

    def counts() -> dict[str, int]:
        calls.append(1)
        return {"gpu": 2, "host": 5, "disk": 0}

    m.gauge_map("lorapipe_test_by_tier", "test", "tier", ("gpu", "host", "disk"), counts)
    (fam,) = [f for f in text_string_to_metric_families(m.exposition()) if f.name == "lorapipe_test_by_tier"]
    got = {(s.labels["stage"], s.labels["tier"]): s.value for s in fam.samples}
    assert got == {("scheduler", "gpu"): 2, ("scheduler", "host"): 5, ("scheduler", "disk"): 0}
    assert fam.type == "gauge" and len(calls) == 1
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        m.gauge_map("lorapipe_test_by_tier", "again", "tier", ("gpu",), counts)
