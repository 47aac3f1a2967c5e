"""`lorapipe serve --tensor-parallel-size 2` end to end (CPU: gloo, tiny model): the worker stage is rank
0 and starts rank 1. Greedy outputs equal the one-process offline engine's with more adapters than
host-cache entries and a pool of 16 rank rows for adapters of 26 (requests in queue order), so
adapters move through the loader, the host cache and both ranks' pools while requests run; and a rank
that dies fails the server cleanly, leaving no process behind."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from proto.sampling import SamplingParams
from runtime.base.endpoints import Endpoints
from runtime.client import AsyncClient
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, parse_dtype
from runtime.offline import LLM
from runtime.serve_args import ServeArgsError
from runtime.serve_checks import parse_serve_args
from runtime.stage_configs import stage_configs
from stages.worker.lora.pool import row_bytes
from stages.worker.tp.rank_zero import RankZero
from stages.worker.tp.shard import shard_config
from tests.conftest import NO_FIXED_PORTS
from tests.integration.hostile import descendants, live_descendants, wait_until
from tests.integration.serving import serve
from tests.integration.test_pipeline import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.timeout(300)

FLAGS = (
    "--tensor-parallel-size", "2", "--max-loras-per-batch", "2", "--max-cpu-loras", "3",
    "--max-lora-rank", "16", "--num-pages", "256",
)  # fmt: skip


def _rank_pids(server) -> list[int]:
    """Processes under the server whose command line runs a tensor-parallel rank."""
    out = []
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"stages.worker.tp.serve_rank" in f.read():
                    out.append(pid)
        except OSError:
            continue
    return out


def test_two_ranks_serve_the_offline_engines_greedy_outputs(tiny_llama, llama_adapters):
    serve_like_offline(tiny_llama, llama_adapters)


def serve_like_offline(model, adapters, *flags: str, **offline_kw) -> None:
    """The server at TP=2 (`flags` added) against the offline engine (`offline_kw` added), then a
    SIGTERM that must end the server with status 0."""
    names = [*adapters, None]
    workload = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS * 2)]
    kw = dict(device="cpu", adapters=adapters, max_loras_per_batch=2, max_lora_rank=16) | offline_kw
    with LLM(model, **kw) as llm:
        want = llm.generate(
            [p for p, _ in workload],
            adapters=[a for _, a in workload],
            sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )

    async def run(endpoint):
        async with AsyncClient(endpoint, timeout=120) as c:
            return await asyncio.gather(
                *(c.generate(p, a, max_tokens=MAX_TOKENS, ignore_eos=True) for p, a in workload)
            )

    # a pool of 16 rank rows (of a rank's shard) for adapters of 26: they swap in both ranks' pools
    cfg = ModelConfig.from_dir(model)
    dtype = parse_dtype(offline_kw.get("dtype"), cfg.dtype)
    shard_row = row_bytes(LoraLayout.for_model(shard_config(cfg, 2), 16), dtype)
    pool = ("--lora-gpu-memory-gb", repr(16 * shard_row / 2**30), "--adapter-affinity-steps", "0")
    with serve(model, adapters, *FLAGS, *pool, *flags) as s:
        assert len(_rank_pids(s)) == 1, "the worker did not start rank 1"
        outs = asyncio.run(run(s.endpoint))
        loads = s.metric("lorapipe_slot_copies_total", "worker")
        capacity = s.metric("lorapipe_lora_pool_rows_capacity", "scheduler")
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0, "the server at TP=2 did not exit cleanly on SIGTERM"
    for (p, a), out, ref in zip(workload, outs, want, strict=True):
        assert out.token_ids == ref.token_ids, f"adapter {a} prompt {p!r}"
        assert out.finish_reason == "length"
    # every adapter was copied into both ranks' pools, and some into rows another had held
    assert capacity == 16 and loads >= len(adapters), (capacity, loads)


def test_a_dead_rank_fails_the_server_and_leaves_no_process(tiny_llama):
    with serve(tiny_llama, {}, *FLAGS) as s:
        (rank,) = _rank_pids(s)
        everything = descendants(s.proc.pid)
        os.kill(rank, signal.SIGKILL)
        wait_until(lambda: s.proc.poll() is not None, "the server to exit after its rank 1 died")
        assert s.proc.returncode != 0
    wait_until(lambda: not live_descendants(everything), "every process of the server to exit")


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("0", "--tensor-parallel-size must be positive, got 0"),
        ("3", "--tensor-parallel-size 3: .* does not divide the model's num_attention_heads"),
    ],
)
def test_a_size_the_model_cannot_split_is_refused_before_start(tiny_llama, size, message):
    with pytest.raises(ServeArgsError, match=message):
        parse_serve_args(
            ["--model", str(tiny_llama), "--device", "cpu", "--tensor-parallel-size", size, *NO_FIXED_PORTS]
        )


def test_the_worker_config_carries_the_size(tiny_llama, tmp_path):
    args = parse_serve_args(
        ["--model", str(tiny_llama), "--device", "cpu", "--tensor-parallel-size", "2", *NO_FIXED_PORTS]
    )
    cfg = ModelConfig.from_dir(tiny_llama)
    worker = stage_configs(args, cfg, Endpoints.in_run_dir(tmp_path), "pool", 1 << 20)["worker"]
    assert worker.tensor_parallel_size == 2
    # no rank copies layer by layer, so that every rank's steps take the same path (and collectives)
    assert worker.runner.layered_min_bytes is not None
    assert RankZero(worker).runner_config().layered_min_bytes is None
