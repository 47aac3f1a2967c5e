"""On a GPU: steps with prefill tokens replay real CUDA graphs (captured at start-up, sharing the decode
graphs' pool) and give the plain path's float32 logits, in full mode (Triton attention) and piecewise
mode (the torch attention loop between graph pieces), with no host-device sync in a replayed step;
and a decode-sized batch replays a decode graph of the same runner with the same logits. Runs only
where CUDA is available (the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from stages.loader.adapter_reader import read_adapter
from stages.worker.lora.torch_backend import TorchLoraBackend
from stages.worker.model.llama import LlamaModel
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput
from tests.stages.worker.test_step_graphs import BATCHES, PAGE, _batch, _reference, _rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The graphed path's Triton LoRA kernels compute float32 dots in TF32; the reference's torch LoRA does
# not: about 1e-3 of relative difference in the logits (1e-4 holds on the CPU, where both are float32).
TOL = 2e-3


@pytest.fixture(scope="module", params=["triton", "torch"], ids=["full", "piecewise"])
def engine(request, tiny_llama, llama_adapters):
    cfg = RunnerConfig(
        model_dir=str(tiny_llama), device="cuda", dtype="float32", max_lora_rank=16, lora_backend="triton",
        attention_backend=request.param, page_size=PAGE, num_pages=400, max_tokens_per_step=128,
        max_model_len=96, max_running_requests=12, cuda_graph_max_batch=8, cuda_graph_max_tokens=64,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    steps = runner.step_graphs
    assert steps is not None and steps.piecewise == (request.param == "torch")
    assert steps.num_graphs > 0 and steps.capture_seconds > 0 and runner.graph_memory_bytes > 0
    if request.param == "triton":
        assert runner.graphs is not None and runner.graphs.pool is steps.pool  # one shared pool
    for slot, (name, path) in enumerate(llama_adapters.items()):
        packed = read_adapter(name, path, runner.model_cfg, runner.lora_layout, runner.dtype)
        runner.load_adapter(slot, packed, [(16 * slot, packed.rank)])
    torch.cuda.synchronize()
    model = LlamaModel(runner.model_cfg, runner.model.w, runner.lora_layout, attention_backend="torch")
    return runner, TorchLoraBackend(runner.pool, cfg.max_tokens_per_step), model


@pytest.mark.parametrize("name", list(BATCHES))  # "decode": 12 sequences, past the decode graphs' 8
def test_replayed_step_equals_plain_path(engine, name):
    runner, torch_lora, torch_model = engine
    seqs = _batch(runner, BATCHES[name], seed=len(name))
    want = _reference(runner, torch_model, torch_lora, seqs)
    replays = runner.step_graphs.replays
    got = runner.execute(seqs)
    assert runner.step_graphs.replays == replays + 1, "the step did not replay a graph"
    err = _rel_err(got, want)
    assert err < TOL, f"relative error {err:.2e}"


def test_replayed_decode_graph_equals_plain_path(engine):
    runner, torch_lora, torch_model = engine
    if runner.graphs is None:
        pytest.skip("decode graphs need the Triton attention")
    seqs = _batch(runner, [(6 + i, 1, i % 5 - 1) for i in range(7)], seed=11)  # 7 decodes: a decode graph
    want = _reference(runner, torch_model, torch_lora, seqs)
    replays = runner.graphs.replays
    got = runner.execute(seqs)
    assert runner.graphs.replays == replays + 1, "the step did not replay a decode graph"
    err = _rel_err(got, want)
    assert err < TOL, f"relative error {err:.2e}"


def test_replayed_step_has_no_host_device_sync(engine):
    runner, _, _ = engine
    if runner.step_graphs.piecewise:
        pytest.skip("the torch attention loop between the pieces reads the page table on the host")
    seqs = [
        SeqInput([5] * (1 + 9 * (i % 2)), 3 + i, list(range(8 * i, 8 * i + 8)), i % 5 - 1) for i in range(9)
    ]
    seqs.sort(key=lambda s: s.slot)  # prefill chunks of 10 tokens and decodes, every adapter and none
    runner.execute(seqs)
    replays = runner.step_graphs.replays
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.execute(seqs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert runner.step_graphs.replays == replays + 1
    assert torch.isfinite(logits).all()
