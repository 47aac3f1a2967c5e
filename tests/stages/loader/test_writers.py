"""The adapter-loader with part-writer processes (--loader-writers): every adapter's parts written by other
processes land bit for bit as the in-process reader packs them, bad values are still refused with their
module named, a writer killed in the middle of a part fails that load clearly and is replaced (the next
load succeeds on the new one), a writer refuses a file other than the one planned, and no writer process
outlives the loader."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import shutil
import signal

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from proto.loader import AdapterFailed, AdapterStaged
from proto.loader_parts import FileId, WritePart
from runtime.common.host_pool import create_pool, dtype_name, unlink_pool
from stages.loader.adapter_reader import plan_adapter
from stages.loader.block_writer import SegmentBuffer
from stages.loader.writer import file_id, write
from tests.stages.loader.test_loader_actor import DTYPE, Scheduler, packed, run_loader

pytestmark = pytest.mark.timeout(120)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _with_nan(src, dst, key: str):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "adapter_model.safetensors")
    tensors[key] = tensors[key].clone().index_fill_(0, torch.tensor([1]), math.nan)
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def test_parts_written_by_processes_equal_the_reader(run_dir, tiny_llama, model, llama_adapters, tmp_path):
    bad = _with_nan(
        llama_adapters["full8"], tmp_path / "bad", "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    )
    pids: list[int] = []

    async def body(s: Scheduler, actor) -> None:
        assert actor.writers is not None and len(actor.writers.pids()) == 3
        pids.extend(actor.writers.pids())
        actor.limits = dataclasses.replace(actor.limits, min_part_bytes=1)  # several parts per adapter
        names = sorted(llama_adapters)
        for name in names:
            staged = await s.stage(name, llama_adapters[name])
            assert isinstance(staged, AdapterStaged), staged
            assert torch.equal(s.block(staged), packed(model, llama_adapters, name).block), name
        failed = await s.stage("bad", bad)
        assert isinstance(failed, AdapterFailed) and not failed.stage_fault  # the adapter's own fault
        assert failed.message == "adapter 'bad': up_proj of layer 1 holds NaN or infinite values"
        again = await s.stage("full8b", llama_adapters["full8"])  # the writers go on after a refusal
        assert torch.equal(s.block(again), packed(model, llama_adapters, "full8").block)
        assert actor.writers.restarts == 0

    run_loader(run_dir, tiny_llama, model, body, blocks=len(llama_adapters) + 2, writers=3)
    assert pids and all(map(_gone, pids))  # killed and reaped with the loader


def test_a_writer_killed_in_its_part_fails_that_load_and_is_replaced(
    run_dir, tiny_llama, model, llama_adapters
):
    async def body(s: Scheduler, actor) -> None:
        writers = actor.writers
        (old,) = writers.pids()
        sent = asyncio.Event()
        send = writers.sock.send

        async def spy(identity, msg):
            await send(identity, msg)
            if isinstance(msg, WritePart):
                sent.set()

        writers.sock.send = spy
        os.kill(old, signal.SIGSTOP)  # it takes the part and never answers
        await s.send(s.request("qv5", llama_adapters["qv5"]))
        await asyncio.wait_for(sent.wait(), 20)
        os.kill(old, signal.SIGKILL)
        failed = await s.recv(AdapterFailed)
        assert failed.name == "qv5" and failed.stage_fault  # the loader's fault: qv5 may be tried again
        assert "its load was cut short: the adapter writer process exited (code -9)" in failed.message
        staged = await s.stage("qv5", llama_adapters["qv5"])  # on the writer that replaced it
        assert isinstance(staged, AdapterStaged), staged
        assert torch.equal(s.block(staged), packed(model, llama_adapters, "qv5").block)
        (new,) = writers.pids()
        assert new != old and writers.restarts == 1 and _gone(old)

    run_loader(run_dir, tiny_llama, model, body, writers=1)


def test_a_writer_refuses_a_file_other_than_the_planned_one(model, llama_adapters):
    cfg, layout = model
    pool = create_pool("lptest-w-", layout.block_bytes(layout.max_rank, DTYPE))
    try:
        with plan_adapter("full8", llama_adapters["full8"], cfg, layout, DTYPE) as plan:
            seen = file_id(plan.fd)
            msg = WritePart(
                job=1,
                name="full8",
                path=plan.path,
                file=FileId(seen.dev, seen.ino, seen.size, seen.mtime_ns + 1),  # touched since planning
                offset=0,
                dtype=dtype_name(DTYPE),
                rank=plan.rank,
                num_layers=plan.num_layers,
                row_elems=plan.row_elems,
                deadline=plan.deadline,
                part=plan.segments[0].parts[0],
                gaps=plan.gaps,
            )
            done = write(msg, pool, SegmentBuffer())
            assert (
                done.adapter_fault
                and done.error == "adapter_model.safetensors changed while it was being loaded"
            )
            ok = write(msgspec.structs.replace(msg, file=seen), pool, SegmentBuffer())
            assert ok.error == "" and ok.peaks
    finally:
        unlink_pool(pool)
