"""The scheduler's gateway series: KV usage, the vLLM-format LoRA info gauge and the resident adapters,
read through a real planner and parsed back from the exposition text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from proto.sampling import SamplingParams
from runtime.base.metrics import StageMetrics
from stages.scheduler.gateway_metrics import add_gateway_metrics
from stages.scheduler.planner import Planner, PlannerConfig
from tests.stages.scheduler.pool_worker import PLANNER_ALONE


def _scrape(m: StageMetrics) -> dict:
    return {f.name: f.samples for f in text_string_to_metric_families(m.exposition())}


def test_gateway_series_follow_the_planner():
    cfg = PlannerConfig(
        num_pages=32,
        page_size=4,
        pool_rows=16,
        pool_ids=4,
        max_lora_rank=8,
        max_loras_per_batch=1,
        max_running_requests=8,
        max_tokens_per_step=256,
        max_model_len=64,
        **PLANNER_ALONE,
    )
    planner = Planner(cfg, adapter_rows=lambda name: 8)
    early = ["x", None]
    m = StageMetrics("scheduler")
    state = {"p": None}
    add_gateway_metrics(
        m,
        lambda: state["p"],
        lambda: early,
        max_lora=lambda: state["p"].cfg.max_loras_per_batch if state["p"] else 0,
    )
    s = _scrape(m)  # before the worker started: waiting adapters come from the held requests
    assert s["lorapipe_lora_requests_info"][0].labels["waiting_lora_adapters"] == "x"
    assert s["lorapipe_kv_cache_usage"][0].value == 0.0
    state["p"] = planner
    for rid, adapter in [("1", "a"), ("2", "a"), ("3", "b"), ("4", None)]:
        planner.add(rid, list(range(10)), adapter, SamplingParams(max_tokens=4))
    planner.schedule()  # one adapter per step: "a" runs (twice), "b" waits
    s = _scrape(m)
    (info,) = s["lorapipe_lora_requests_info"]
    assert info.labels["running_lora_adapters"] == "a"
    assert info.labels["waiting_lora_adapters"] == "b"
    assert info.labels["max_lora"] == "1" and info.labels["stage"] == "scheduler"
    (resident,) = s["lorapipe_lora_resident_info"]
    assert resident.labels["resident_lora_adapters"] + resident.labels["loading_lora_adapters"] == "a"
    used = sum(len(r.pages) for r in planner.running)
    assert used > 0
    assert s["lorapipe_kv_cache_usage"][0].value == used / 32
