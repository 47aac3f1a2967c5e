"""The loader over ipc:// with several loads at once: a small adapter is staged while a large one's write
is held in its thread (the actor's loop never waits for a load's threads), parallel loads land bit for
bit in the ranges they were given, a block takes only its own rank's bytes and writes nothing past
them, a range too small for its block is refused unwritten, a load failing while packing is answered
so that its range serves the next write, and a loader stopped mid-write keeps the pool mapped for it."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from proto.loader import AdapterFailed, AdapterStaged, LoaderStarted
from runtime.common.host_pool import ALIGN
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.model import build_config
from stages.loader import actor as loader_actor
from stages.loader.actor import LoaderActor
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


def test_a_small_write_is_staged_while_a_large_one_is_held(run_dir, wide, monkeypatch):
    """big0's first part is held in its thread until the small adapter is staged: the actor's loop must
    not wait for a load's threads. The five other loads run as they are, and everything lands bit for
    bit at the ranges the scheduler gave."""
    model_dir, paths = wide
    cfg = ModelConfig.from_dir(model_dir)
    layout = LoraLayout.for_model(cfg, 16)
    small = make_adapters(model_dir, run_dir, n=1, ranks=(1,), targets=("q_proj",), prefix="small")[0]
    want = {n: read_adapter(n, p, cfg, layout, DTYPE).block for n, p in paths.items()}
    want["small"] = read_adapter("small", small, cfg, layout, DTYPE).block
    started, gate = threading.Event(), threading.Event()

    def held_part(plan, s, i, buf, block):
        if plan.name == "big0" and (s, i) == (0, 0):
            started.set()
            gate.wait(20)  # a loop that waited for this thread would stall here for 20 s
        write_part(plan, s, i, buf, block)

    monkeypatch.setattr(loader_actor, "write_part", held_part)

    async def body(s: Scheduler, actor) -> None:
        await s.send(*[s.request(n, p) for n, p in paths.items()])
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 20)
        await s.send(s.request("small", small))
        before = []
        while (m := await s.recv(AdapterStaged)).name != "small":
            before.append(m)
        assert not gate.is_set() and "big0" not in {b.name for b in before}
        # one load loop holds big0; the other took big1..big5 and then small, in order: only big0 is left
        assert metric(actor, "lorapipe_loader_writes_in_flight") == 1
        gate.set()
        staged = [m, *before] + [await s.recv(AdapterStaged) for _ in range(len(paths) - len(before))]
        assert sorted(m.name for m in staged) == sorted(want)
        for m in staged:  # checked once all are written: no write spilled into a neighbour's range
            assert torch.equal(s.block(m), want[m.name]), m.name
        assert metric(actor, "lorapipe_adapter_loads_total", result="staged") == len(want)
        assert metric(actor, "lorapipe_loader_writes_in_flight") == 0

    try:
        run_loader(run_dir, model_dir, (cfg, layout), body, blocks=len(want))
    finally:
        gate.set()


def test_a_block_takes_its_own_ranks_bytes_and_nothing_past_its_range(
    run_dir, tiny_llama, model, llama_adapters
):
    """A pool of exactly one rank-16 block. full8, staged first into all of it, writes only its own
    rank's bytes; a range too small for qv5's block is refused before anything is written; then, their
    sizes known, rank 5 and rank 1 blocks fit after it, and all three hold bit for bit."""
    cfg, layout = model
    names = ("full8", "qv5", "mlp1")
    want = {n: read_adapter(n, llama_adapters[n], cfg, layout, DTYPE) for n in names}
    pool = _aligned(layout.block_bytes(16, DTYPE))
    assert sum(_aligned(w.nbytes) for w in want.values()) <= pool

    async def body(s: Scheduler, actor) -> None:
        filled = s.fill()
        full8 = await s.stage("full8", llama_adapters["full8"])
        assert isinstance(full8, AdapterStaged) and full8.nbytes == want["full8"].nbytes
        assert bytes(s.pool.buf[full8.nbytes :]) == filled[full8.nbytes :]  # nothing past its bytes

        start, short = _aligned(full8.nbytes), want["qv5"].nbytes - 1
        before = bytes(s.pool.buf)
        await s.send(s.unplaced_request("qv5", llama_adapters["qv5"], start, short))
        refused = await s.recv(AdapterFailed)
        assert f"needs {want['qv5'].nbytes} bytes; its host range holds {short}" in refused.message
        assert bytes(s.pool.buf) == before

        staged = [full8]
        for name in names[1:]:
            staged.append(await s.stage(name, llama_adapters[name], want[name].nbytes))
            assert isinstance(staged[-1], AdapterStaged) and staged[-1].nbytes == want[name].nbytes
        for m in staged:
            assert torch.equal(s.block(m), want[m.name].block), m.name
        end = staged[-1].offset + staged[-1].nbytes
        assert bytes(s.pool.buf[end:]) == filled[end:]

    run_loader(run_dir, tiny_llama, model, body, blocks=None, pool_bytes=pool)


def test_a_load_failing_while_packing_is_answered_and_its_range_serves_again(
    run_dir, tiny_llama, model, llama_adapters, tmp_path
):
    """NaN in a tensor: found only while packing (its header is sound), after the range was reserved. The
    failure is the adapter's, and once the scheduler frees the range the next write there lands bit for
    bit over whatever was in it."""
    bad = tmp_path / "bad"
    shutil.copytree(llama_adapters["full8"], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[key] = tensors[key].clone().fill_(float("nan"))
    save_file(tensors, bad / "adapter_model.safetensors")

    async def body(s: Scheduler, actor) -> None:
        s.fill()  # whatever the failed write left, the next one must leave none of it
        failed = await s.stage("bad", bad)
        assert isinstance(failed, AdapterFailed) and failed.name == "bad"
        assert "up_proj of layer 1 holds NaN" in failed.message and not failed.stage_fault
        again = await s.stage("full8", llama_adapters["full8"])  # the table gives it the freed range
        assert isinstance(again, AdapterStaged) and again.offset == 0
        want = read_adapter("full8", llama_adapters["full8"], *model, DTYPE)
        assert torch.equal(s.block(again), want.block)
        assert metric(actor, "lorapipe_adapter_loads_total", result="failed") == 1
        assert metric(actor, "lorapipe_loader_writes_in_flight") == 0

    run_loader(run_dir, tiny_llama, model, body, blocks=1)  # one block: the second write reuses the range


def test_a_loader_stopped_mid_write_leaves_the_pool_mapped_for_it(
    run_dir, tiny_llama, model, llama_adapters, monkeypatch
):
    """Stopped at once (a second SIGTERM, a drain past its deadline) while a write's threads still pack
    into the pool: a thread cannot be stopped, so the loader must not unmap the pool under it (the
    process would die of SIGSEGV instead of exiting with its code); the thread then ends harmlessly."""
    started, gate, ended = threading.Event(), threading.Event(), threading.Event()
    actors: list[LoaderActor] = []

    def held_part(plan, s, i, buf, block):
        if plan.name == "qv5":
            started.set()
            gate.wait(20)  # released only once the actor has stopped
            try:
                if actors[0].pool.buf is None:
                    return  # unmapped under this thread: writing now would kill the test process
                write_part(plan, s, i, buf, block)  # may fail: the cancelled load closed its file
            finally:
                ended.set()
        else:
            write_part(plan, s, i, buf, block)

    monkeypatch.setattr(loader_actor, "write_part", held_part)
    s = Scheduler(run_dir, tiny_llama, model[1])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        actors.append(LoaderActor(s.cfg))
        task = asyncio.create_task(actors[0].run())
        await s.recv(LoaderStarted)
        await s.send(s.request("qv5", llama_adapters["qv5"]))
        assert await loop.run_in_executor(None, started.wait, 20)
        actors[0].request_drain()
        actors[0].request_drain()  # the second: stop without waiting for the write
        assert await asyncio.wait_for(task, 20) == 0
        assert actors[0].pool.buf is not None, "the pool was unmapped under a write in flight"
        gate.set()
        assert await loop.run_in_executor(None, ended.wait, 20)  # its thread ended, the process alive

    try:
        asyncio.run(main())
    finally:
        gate.set()
        s.close()
