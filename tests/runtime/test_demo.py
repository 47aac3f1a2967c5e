"""The demo's metrics summary: labelled series keep one entry per label set (a counter by outcome is
never summed into a total that counts a request twice)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from runtime.demo import summarize


def test_labelled_series_are_listed_per_label_not_summed():
    reg = CollectorRegistry()
    requests = Counter("lorapipe_requests", "by outcome", ["stage", "outcome"], registry=reg)
    requests.labels(stage="tokenizer", outcome="finished").inc(6)
    requests.labels(stage="tokenizer", outcome="aborted").inc(1)
    Gauge("lorapipe_requests_in_flight", "open", ["stage"], registry=reg).labels(stage="tokenizer").set(2)
    Counter("lorapipe_messages_in", "in", ["stage"], registry=reg).labels(stage="tokenizer").inc(9)
    text = summarize(generate_latest(reg).decode())
    assert "requests_total{finished}=6" in text and "requests_total{aborted}=1" in text
    assert "requests_total=" not in text
    assert "requests_in_flight=2" in text
    assert text.splitlines()[1].split()[:3] == ["tokenizer", "0", "9"]  # stage, up, messages in
