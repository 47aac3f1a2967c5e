"""The warm-up plan benchmark on a small configuration: it reports the plan that `lora_launches` makes for
its server shapes, for the GPU it names, and leaves the device settings as they were."""

from __future__ import annotations

import json

import torch

from benchmarks import bench_warmup_plan as bench
from kernels import device_info
from runtime.common.lora_layout import LoraLayout
from stages.worker.decode_graphs import batch_buckets
from stages.worker.lora.pool import LoraPool, pool_geometry
from stages.worker.lora.triton_backend import TritonLoraBackend
from stages.worker.step_inputs import token_buckets
from stages.worker.warmup_plan import lora_launches


def test_reports_the_plan_of_its_configurations(tmp_path, monkeypatch):
    args = ["--max-tokens", "200", "--max-seqs", "8", "--max-model-len", "256", "--pool-gb", "0.5"]
    bench.main([str(tmp_path), *args, "--sms", "8", "--pdl", "1", "--repeat", "1"])
    assert device_info.num_sms(torch.device("cpu")) == 4 and not device_info.pdl(torch.device("cpu"))
    out = json.loads((tmp_path / "warmup_plan.json").read_text())
    assert set(out) == set(bench.CONFIGS)
    monkeypatch.setattr(device_info, "num_sms", lambda device: 8)
    monkeypatch.setattr(device_info, "pdl", lambda device: True)
    for name, rank in bench.CONFIGS.items():
        layout = LoraLayout.build(**bench.MODEL, max_rank=rank)
        ids = pool_geometry(layout, torch.bfloat16, int(0.5 * 2**30))[1]
        backend = TritonLoraBackend(LoraPool(layout, rank, ids, torch.bfloat16, torch.device("cpu")), 200, 8)
        padded = (*batch_buckets(8), *((b, 16) for b in token_buckets(200)))
        assert out[name]["ids"] == ids and out[name]["lora_variants"] == len(lora_launches(backend, padded))
        assert out[name]["total_s"] >= out[name]["lora_s"] > 0
