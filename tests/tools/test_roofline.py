"""The roofline arithmetic of the benchmarks: a model's per-step bytes against its checkpoint's tensors,
KV tokens against an enumeration of the steps, and the bound and fraction against a hand computation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from tools import roofline
from tools.bench_report import markdown_table


def test_weight_and_kv_bytes_match_the_checkpoint(tiny_llama):
    """Every step reads each decoder linear and the LM head (the embedding is only gathered; tied, the
    LM head is that tensor); KV is K and V of every layer."""
    cfg = roofline.ModelConfig.from_dir(tiny_llama)
    linear = 0
    with safe_open(str(next(tiny_llama.glob("*.safetensors"))), "pt") as f:
        names = list(f.keys())
        for name in names:
            t = f.get_tensor(name)
            if name.endswith("proj.weight") or name == "lm_head.weight":
                linear += t.numel() * t.element_size()
        if "lm_head.weight" not in names:
            t = f.get_tensor("model.embed_tokens.weight")
            linear += t.numel() * t.element_size()
    got = roofline.ModelBytes.from_config(cfg)
    assert got.weight_bytes == linear
    elt = getattr(torch, cfg.dtype).itemsize  # torch's own size, against the names' table
    assert got.kv_token_bytes == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elt


@pytest.mark.parametrize(("prompt", "output"), [(5, 1), (5, 4), (1, 9), (12, 0)])
def test_kv_tokens_read_enumerates_the_steps(prompt, output):
    steps = [prompt] if output else []  # the prefill reads its own KV once and makes token 0
    steps += [prompt + t - 1 for t in range(1, output)]  # the step making token t sees prompt + t - 1
    assert roofline.kv_tokens_read(prompt, output) == sum(steps)


def test_bound_and_fraction_by_hand():
    """Model of 1,000 bytes of weights a step and 10 bytes of KV a token, at 1,000 bytes/s.
    Baseline: 10 steps, 40 KV tokens, 20 output tokens in 30 s: 10,000 + 400 = 10,400 bytes, 520 a token.
    Run: 12 steps, 300 bytes of adapter rows, the same KV and tokens: 12,000 + 300 + 400 = 12,700 bytes,
    635 a token, 115 more than the baseline: 0.115 s a token at 1,000 bytes/s over the baseline's 1.5 s.
    Bound 1.5 / 1.615; measured 0.8 is 0.8 x 1.615 / 1.5 of it."""
    model = roofline.ModelBytes(weight_bytes=1000, kv_token_bytes=10)
    base = roofline.run_bytes(model, steps=10, adapter_bytes=0, kv_tokens=40, bandwidth=1000.0)
    run = roofline.run_bytes(model, steps=12, adapter_bytes=300, kv_tokens=40, bandwidth=1000.0)
    assert (base["total_bytes"], run["total_bytes"]) == (10_400, 12_700)
    assert (base["floor_s"], run["floor_s"]) == (10.4, 12.7)
    bound = roofline.bound_ratio(run, 20, base, 20, 30.0)
    assert bound == pytest.approx(1.5 / 1.615)
    assert roofline.fraction_of_bound(0.8, bound) == pytest.approx(0.8 * 1.615 / 1.5)
    # a run reading fewer bytes a token than its baseline is bounded by the baseline's own pace
    assert roofline.bound_ratio(base, 20, run, 20, 30.0) == 1.0
    assert roofline.bound_ratio(run, 20, {**base, "bandwidth_Bps": None}, 20, 30.0) is not None
    assert (
        roofline.bound_ratio({**run, "bandwidth_Bps": None}, 20, {**base, "bandwidth_Bps": None}, 20, 30.0)
        is None
    )


def test_serving_roofline_from_counters_and_records():
    """Plans and adapter bytes from the server's counters, KV from the completed requests only."""
    model = roofline.ModelBytes(weight_bytes=1000, kv_token_bytes=10)
    ok = SimpleNamespace(ok=True, prompt_tokens=3, output_tokens=4)  # 3 + 3 + 4 + 5 = 15 KV tokens
    failed = SimpleNamespace(ok=False, prompt_tokens=50, output_tokens=2)
    got = roofline.serving_roofline(model, {"plans": 7, "step_adapter_bytes": 90}, [ok, failed], 20.0, 500.0)
    assert got["total_bytes"] == 7 * 1000 + 90 + 15 * 10
    assert got["floor_fraction"] == pytest.approx(7240 / 500 / 20.0)
    assert roofline.serving_roofline(model, {"plans": None}, [ok], 20.0, 500.0) is None


def test_markdown_table_prints_the_bound_beside_the_ratio():
    model = roofline.ModelBytes(weight_bytes=1000, kv_token_bytes=10)

    def report(label, seconds, rf):
        tokens = 20
        lat = {"p50": 0.1, "p95": 0.2}
        summary = {
            "completed": 5,
            "failed": 0,
            "request_throughput": 1.0,
            "output_throughput": tokens / seconds,
        }
        summary.update(output_tokens=tokens, duration_s=seconds, roofline=rf, ttft=lat, itl=lat, e2e=lat)
        return {"label": label, "config": {}, "summary": summary}

    base = report("base", 30.0, roofline.run_bytes(model, 10, 0, 40, 1000.0))
    run = report("run", 37.5, roofline.run_bytes(model, 12, 300, 40, 1000.0))  # 0.8x the baseline
    table = markdown_table([base, run], baseline=base)
    row = table.splitlines()[-1].split(" | ")
    assert row[5:8] == ["0.80×", f"{1.5 / 1.615:.2f}×", f"{0.8 * 1.615 / 1.5:.2f}"]


def test_bench_tp_bytes_by_hand():
    """bench_tp: a batch of 2 prompts of 3 tokens, 4 tokens out, one step a token; adapters of 50 bytes of
    rows a step; per GPU over tp=2. KV tokens a sequence: 3 + 3 * 3 + 3 = 15."""
    from benchmarks import bench_tp

    a = SimpleNamespace(prompt_len=3, output_len=4, tp=2)
    model = roofline.ModelBytes(weight_bytes=1000, kv_token_bytes=10)
    got = bench_tp._bytes_read(a, 2, model, step_adapter_bytes=50, bandwidth=100.0)
    base = (4 * 1000 + 2 * 15 * 10) / 2
    assert got["base"]["total_bytes"] == base and got["base"]["floor_s"] == base / 100.0
    assert got["lora"]["adapter_bytes"] == 4 * 50 / 2 and got["lora"]["total_bytes"] == base + 100
