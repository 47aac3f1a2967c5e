"""On a GPU: the start-up timeline of a real `lorapipe serve` on CUDA (warm-up on an empty compile cache,
its compile pool, graph capture, the host cache page-locked beside the runner) attributes every second
from launch to the first ok health reply. Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_startup_timeline import RUNNER_PARTS, check_timeline, start_up

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_PARTS = [*RUNNER_PARTS, "compile pool exit", "graph capture", "cache marker"]


def test_every_second_to_ready_is_attributed_on_cuda(tiny_llama, llama_adapters, tmp_path):
    flags = ("--max-lora-rank", "16", "--max-tokens-per-step", "256", "--max-running-requests", "32")
    log, ready_s = start_up(tiny_llama, llama_adapters, tmp_path, "cuda", *flags)
    parts = dict(check_timeline(log, ready_s, CUDA_PARTS))
    assert parts["worker: graph capture"] > 0 and parts["worker: warm-up"] > 0
