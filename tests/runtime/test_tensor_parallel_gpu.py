"""Tensor parallelism on two GPUs (NCCL): the Triton LoRA kernels, CUDA graphs with the ranks'
collectives captured in them, every logit against transformers + PEFT and the one-GPU engine."""

from __future__ import annotations

import pytest
import torch

from tests.runtime import test_tensor_parallel as tp
from tests.stages.worker.graph_tolerances import TOL as GRAPH_TOL

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_two_gpus_match_peft_and_one_gpu(model, request, recorded_logits):
    model_dir = request.getfixturevalue(f"tiny_{model}")
    adapters = request.getfixturevalue(f"{model}_adapters")
    kw = dict(device="cuda", lora_backend="triton", num_pages=512, lora_gpu_memory_gb=0.05)
    tp._check(model_dir, adapters, recorded_logits, tol=GRAPH_TOL, **kw)
    assert tp._generate.last_replays > 0, "no decode step replayed a CUDA graph on two GPUs"
