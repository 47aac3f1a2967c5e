"""On a GPU: after the warm-up (and the capture of the decode and step graphs), no serving step compiles a
Triton kernel. A compile hook records every compile while random mixed batches run: prefills and decodes,
base-only and adapters of every rank class, sizes from one token to the step limit, each batch once on
its graphs (decode graphs, step graphs per token bucket) and once eagerly (as a step with in-flight
adapter copies runs); with bf16 weights and with fp8 weights.
Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import random
import traceback
from pathlib import Path

import pytest
import torch

from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.model import make_model
from stages.loader.adapter_reader import read_adapter
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PAGE = 16
MAX_TOKENS = 512


def _batches(rng: random.Random, slots: int):
    """Fixed edge cases first, then random mixes: lists of (new tokens, context before them, slot)."""
    yield [(1, 0, 0)]
    yield [(MAX_TOKENS, 0, slots - 1)]
    yield [(1, 100 + i, i % slots) for i in range(32)]  # a graphed decode batch with adapters
    yield [(1, 700 + i, i % slots - 1) for i in range(33)]  # one past the decode graphs: step graphs
    yield [(120, 0, 1), *((1, 50 + i, i % slots - 1) for i in range(8))]  # exactly the 128-token bucket
    yield [(121, 0, 2), *((1, 50 + i, i % slots - 1) for i in range(8))]  # one past it: bucket 256
    yield [(MAX_TOKENS - 40, 0, 0), *((1, 90 + i, i % slots - 1) for i in range(40))]  # the largest
    for _ in range(80):
        seqs, budget = [], rng.randint(1, MAX_TOKENS)
        while budget > 0 and len(seqs) < 64:
            n = 1 if rng.random() < 0.6 else rng.randint(1, budget)
            seqs.append((n, rng.choice([0, rng.randint(1, 1500)]), rng.randint(-1, slots - 1)))
            budget -= n
        yield seqs


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The tiny model with room for 2,048 positions (the batches below reach contexts of ~2,000)."""
    return make_model(
        tmp_path_factory.mktemp("models") / "llama2k", arch="llama", preset="tiny", seed=1,
        overrides={"max_position_embeddings": 2048},
    )  # fmt: skip


@pytest.mark.parametrize("quantization", [None, "fp8"])  # fp8: the weight-only GEMM's variants too
def test_no_kernel_compiles_after_warm_up(long_llama, tmp_path, monkeypatch, quantization):
    import triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # empty: the pool compiles it all

    cfg = RunnerConfig(
        model_dir=str(long_llama), device="cuda", dtype="bfloat16", max_lora_rank=64, lora_backend="triton",
        page_size=PAGE, num_pages=4096, max_tokens_per_step=MAX_TOKENS, max_model_len=2048,
        cuda_graph_max_batch=32, cuda_graph_max_tokens=MAX_TOKENS, max_running_requests=64, warmup=True,
        lora_gpu_memory_gb=0.05, quantization=quantization,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    assert runner.warmup.lora > 0 and runner.warmup.attention > 0
    assert (runner.warmup.fp8 > 0) == (quantization == "fp8")
    # graph capture launches only what the warm-up's pool compiled (kernels this process had loaded
    # before, from earlier tests, are not seen either way)
    assert not runner.capture_compiled, f"graph capture compiled {runner.capture_compiled}"
    assert runner.step_graphs is not None and runner.step_graphs.num_graphs > 0
    paths = make_adapters(long_llama, tmp_path, n=4, ranks=(8, 24, 40, 64), seed=5)  # every rank class
    row = 0
    for slot, path in enumerate(paths):
        packed = read_adapter(path.name, path, runner.model_cfg, runner.lora_layout, runner.dtype)
        runner.load_adapter(slot, packed, [(row, packed.rank)])
        row += packed.rank
    compiled: list[str] = []

    def hook(**kw) -> None:  # returns None: the compile goes on; recorded with the path that launched it
        ours = [f for f in traceback.extract_stack() if "/stages/" in f.filename or "/kernels/" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(ours[-6:]))
        compiled.append(f"{kw['repr']}\n    launched by {where}\n    key {str(kw.get('key'))[:600]}")

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        rng, next_page = random.Random(0), 0
        for batch in _batches(rng, slots=4):
            seqs = []
            for n, ctx, slot in batch:
                pages = -(-(ctx + n) // PAGE)
                if next_page + pages > runner.num_pages:
                    next_page = 0  # the cache's contents do not matter here, only the kernels run
                seqs.append(SeqInput([7] * n, ctx, list(range(next_page, next_page + pages)), slot))
                next_page += pages
            runner.execute(seqs)  # on the graphs where they serve the batch
            runner.execute(seqs, [[] for _ in range(runner.model_cfg.num_layers)])  # eagerly
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert not compiled, f"{len(compiled)} kernels compiled after the warm-up:\n" + "\n".join(compiled[:10])
