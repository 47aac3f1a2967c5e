"""The loader over ipc:// with several loads at once: the actor answers a cache hit while large adapters
are read and packed on its threads, parallel loads land bit for bit in disjoint rank-sized blocks of a
byte-sized cache, and a load that fails after its block was reserved gives every byte back."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from proto.loader import AdapterFailed, AdapterStaged, Evicted, ReleaseAdapter, StageAdapter
from runtime.common.host_pool import ALIGN
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.model import build_config
from stages.loader import actor as loader_actor
from stages.loader.adapter_reader import read_adapter
from stages.loader.block_writer import write_part
from tests.stages.loader.test_loader_actor import DTYPE, Scheduler, metric, run_loader

pytestmark = pytest.mark.timeout(120)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A 1B-wide, 2-layer model config (the loader reads only config.json) and six rank-16 float32
    adapters of about 5.6 MB each (2.8 MB packed in bfloat16): copies of one, so generating stays cheap."""
    root = tmp_path_factory.mktemp("wide")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(build_config("llama", "1b", overrides={"num_hidden_layers": 2}))
    )
    (first,) = make_adapters(model, root, n=1, ranks=(16,), prefix="big")
    paths = {"big0": first}
    for i in range(1, 6):
        paths[f"big{i}"] = root / f"big{i}"
        shutil.copytree(first, paths[f"big{i}"])
    return model, paths


def test_a_hit_is_answered_while_large_loads_run(run_dir, wide, monkeypatch):
    """big0's first part is held in its thread until the hit is answered: the actor's loop must not wait
    for a load's threads. The five other loads run as they are, and everything lands bit for bit."""
    model_dir, paths = wide
    cfg = ModelConfig.from_dir(model_dir)
    layout = LoraLayout.for_model(cfg, 16)
    small = make_adapters(model_dir, run_dir, n=1, ranks=(1,), targets=("q_proj",), prefix="small")[0]
    want = {n: read_adapter(n, p, cfg, layout, DTYPE).block for n, p in paths.items()}
    started, gate = threading.Event(), threading.Event()

    def held_part(plan, s, i, buf, block):
        if plan.name == "big0" and (s, i) == (0, 0):
            started.set()
            gate.wait(20)  # a loop that waited for this thread would stall here for 20 s
        write_part(plan, s, i, buf, block)

    monkeypatch.setattr(loader_actor, "write_part", held_part)

    async def body(s: Scheduler, actor) -> None:
        hit = await s.stage("small", small)
        assert isinstance(hit, AdapterStaged)
        await s.send(*[StageAdapter(name=n, path=str(p)) for n, p in paths.items()])
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 20)
        await s.send(StageAdapter(name="small", path=str(small)))
        before = []
        while (m := await s.recv(AdapterStaged)).name != "small":
            before.append(m)
        assert m.cache_hit and not gate.is_set() and "big0" not in {b.name for b in before}
        gate.set()
        staged = before + [await s.recv(AdapterStaged) for _ in range(len(paths) - len(before))]
        assert sorted(m.name for m in staged) == sorted(paths)
        spans = sorted((m.offset, m.offset + m.nbytes) for m in [hit, *staged])
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans  # disjoint
        for m in staged:
            assert torch.equal(s.block(m), want[m.name]), m.name
        assert metric(actor, "lorapipe_adapter_loads_total", result="staged") == len(paths) + 1

    pool = sum(_aligned(w.numel() * w.element_size()) for w in want.values()) + 64 * ALIGN
    try:
        run_loader(run_dir, model_dir, (cfg, layout), body, max_cpu_loras=None, pool_bytes=pool)
    finally:
        gate.set()


def test_blocks_take_their_own_ranks_share(run_dir, tiny_llama, model, llama_adapters):
    """A pool of exactly one rank-16 block, no adapter cap: rank 8, 5 and 1 adapters fit in it together
    (a max-rank slot each would hold one)."""
    cfg, layout = model
    sizes = {
        n: read_adapter(n, llama_adapters[n], cfg, layout, DTYPE).nbytes for n in ("full8", "qv5", "mlp1")
    }
    pool = _aligned(layout.block_bytes(16, DTYPE))
    assert sum(_aligned(n) for n in sizes.values()) <= pool

    async def body(s: Scheduler, actor) -> None:
        for name in sizes:
            staged = await s.stage(name, llama_adapters[name])
            assert isinstance(staged, AdapterStaged) and staged.nbytes == sizes[name]
        assert metric(actor, "lorapipe_host_cache_adapters", state="resident") == 3
        assert metric(actor, "lorapipe_host_cache_bytes_used") == sum(sizes.values())
        assert metric(actor, "lorapipe_host_cache_capacity_bytes") == pool

    run_loader(run_dir, tiny_llama, model, body, max_cpu_loras=None, pool_bytes=pool)


def test_a_load_failing_after_its_reservation_frees_it(run_dir, tiny_llama, model, llama_adapters, tmp_path):
    """NaN in a tensor: found only while packing, after eviction and reservation; the block is freed,
    the evicted adapter stays evicted, and the freed room serves the next load."""
    bad = tmp_path / "bad"
    shutil.copytree(llama_adapters["full8"], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[key] = tensors[key].clone().fill_(float("nan"))
    save_file(tensors, bad / "adapter_model.safetensors")

    async def body(s: Scheduler, actor) -> None:
        first = await s.stage("qv5", llama_adapters["qv5"])
        await s.send(ReleaseAdapter(name="qv5"))
        assert await s.stage("bad", bad) == Evicted(name="qv5")  # room for rank 8, before any data is read
        failed = await s.recv(AdapterFailed)
        assert "up_proj of layer 1 holds NaN" in failed.message and not failed.retryable
        assert metric(actor, "lorapipe_host_cache_bytes_used") == 0
        assert metric(actor, "lorapipe_host_cache_largest_free_bytes") == s.cfg.host_pool_bytes
        again = await s.stage("full8", llama_adapters["full8"])
        assert isinstance(again, AdapterStaged) and again.offset == first.offset == 0

    pool = _aligned(model[1].block_bytes(8, DTYPE))  # one rank-8 block: the bad load must evict qv5
    run_loader(run_dir, tiny_llama, model, body, max_cpu_loras=None, pool_bytes=pool)
