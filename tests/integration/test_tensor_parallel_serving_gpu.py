"""`lorapipe serve --tensor-parallel-size 2` on two GPUs: greedy outputs equal the offline engine's at
TP=2 while adapters move through the host cache and both ranks' pools (float32, so that the two
engines' different batch shapes cannot flip a greedy token), and SIGTERM ends it with status 0."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_tensor_parallel_serving import serve_like_offline

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    pytest.mark.timeout(600),
]


def test_two_gpus_serve_the_offline_engines_greedy_outputs(tiny_llama, llama_adapters):
    serve_like_offline(
        tiny_llama,
        llama_adapters,
        "--device", "cuda", "--dtype", "float32",
        device="cuda", dtype="float32", tensor_parallel_size=2, num_pages=256,
    )  # fmt: skip
