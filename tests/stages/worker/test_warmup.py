"""The warm-up's launches (CPU: under the Triton interpreter; GPU: where there is one): they go through
the serving code (the LoRA backend's `apply`, the model's attention entry point) with empty device
metadata, so they run and leave the KV cache, the adapter slots and the prepared batch as they were."""

from __future__ import annotations

import torch

from stages.worker.runner import ModelRunner, RunnerConfig
from stages.worker.warmup import _attention, _forward, _lora, _Progress
from stages.worker.warmup_plan import lora_launches

# Triton kernels run on CUDA tensors, or on CPU tensors only under the interpreter (set without a GPU).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_launches_compute_nothing(tiny_llama):
    runner = ModelRunner(
        RunnerConfig(
            model_dir=str(tiny_llama), dtype="float32", num_pages=16, lora_backend="triton",
            attention_backend="triton", max_lora_rank=32, max_tokens_per_step=64, device=DEVICE,
        )
    )  # fmt: skip
    torch.manual_seed(0)
    runner.pool.mem.normal_()
    runner.pool.ranks.fill_(8)
    runner.kv.k.normal_()
    runner.kv.v.normal_()
    before = [t.clone() for t in (runner.pool.mem, runner.kv.k, runner.kv.v)]
    launches = lora_launches(runner.lora)
    small = [launch for launch in launches if launch.num_tiles <= 2]  # the interpreter runs every program
    assert {launch.group for launch in small} == {"qkv", "o", "gate_up", "down"}
    assert {launch.block_rank for launch in small} == {16, 32}
    lines: list[str] = []
    progress = _Progress(len(small) + 2, lines.append)
    with torch.inference_mode():
        _lora(runner, small, progress)
        _attention(runner, [(16, 1), (16, 2)], progress)
    for old, new in zip(before, (runner.pool.mem, runner.kv.k, runner.kv.v), strict=True):
        assert torch.equal(old, new)
    assert runner.lora.batch_info.num_tiles == 0  # the empty batch lora_launches prepared is still there
    assert lines[0].startswith(f"warm-up: 1/{len(small) + 2} kernel variants") and lines[-1].startswith(
        f"warm-up: {len(small) + 2}/{len(small) + 2}"
    )


def test_the_step_sized_forward_fills_a_step_with_sequences_of_the_context_length(tiny_llama, monkeypatch):
    runner = ModelRunner(
        RunnerConfig(
            model_dir=str(tiny_llama), dtype="float32", num_pages=16, max_tokens_per_step=40, max_model_len=16
        )
    )
    seen = []
    monkeypatch.setattr(runner, "_forward_eager", lambda seqs: seen.append(seqs))
    _forward(runner)
    (seqs,) = seen
    assert [len(s.token_ids) for s in seqs] == [16, 16, 8]
    assert [s.page_ids for s in seqs] == [[0], [1], [2]] and all(s.slot == -1 for s in seqs)
