"""Hostile adapters: FIFOs and devices never block a read, oversized files
are refused unread, scalings out of range (NaN or infinite alpha, negative or NaN alpha_pattern, a
zero rank) and effective deltas that could overflow are refused at load, loads stay inside the
adapter root, and a loader whose read hangs says so in its health while it keeps serving."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from proto.loader import AdapterFailed, AdapterStaged, LoaderHealth, LoaderStarted
from stages.loader.actor import LoaderActor
from stages.loader.adapter_config import MAX_CONFIG_BYTES, AdapterError
from stages.loader.adapter_reader import read_adapter
from stages.loader.files import FileRefused, inside_root
from tests.stages.loader.test_loader_actor import Scheduler

pytestmark = pytest.mark.timeout(60)
MAX_RANK = 16


def copy_of(src: Path, dst: Path, config: dict | None = None, scale: float = 1.0) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        c = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**c, **config}))  # NaN/Infinity as JSON allows
    if scale != 1.0:
        tensors = {k: v * scale for k, v in load_file(dst / "adapter_model.safetensors").items()}
        save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def refused_quickly(model, path: Path, *words: str, dtype=torch.float32) -> str:
    t0 = time.monotonic()
    with pytest.raises(AdapterError) as info:
        read_adapter("bad", path, *model, dtype)
    assert time.monotonic() - t0 < 5, "the read blocked"
    for word in words:
        assert word in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "config,words",
    [
        ({"lora_alpha": math.nan}, ["lora_alpha", "finite positive"]),
        ({"lora_alpha": math.inf}, ["lora_alpha", "finite positive"]),
        ({"lora_alpha": -8}, ["lora_alpha"]),
        ({"lora_alpha": True}, ["lora_alpha"]),
        ({"alpha_pattern": {"q_proj": math.nan}}, ["alpha_pattern", "q_proj"]),
        ({"alpha_pattern": {"q_proj": -4.0}}, ["alpha_pattern", "q_proj"]),
        ({"rank_pattern": {"q_proj": 0}}, ["rank_pattern", "q_proj", "positive integer"]),
        ({"rank_pattern": {"(": 4}}, ["rank_pattern", "invalid"]),
        ({"r": 0}, ["r=0"]),
    ],
)
def test_scalings_out_of_range_are_refused(model, llama_adapters, tmp_path, config, words):
    refused_quickly(model, copy_of(llama_adapters["full8"], tmp_path / "a", config), *words)


def test_huge_effective_delta_is_refused(model, llama_adapters, tmp_path):
    refused_quickly(model, copy_of(llama_adapters["full8"], tmp_path / "w", scale=1e20), "effective delta")
    refused_quickly(model, copy_of(llama_adapters["full8"], tmp_path / "a", {"lora_alpha": 1e30}), "delta")
    # weights that overflow float16 itself are refused for a float16 model
    msg = refused_quickly(
        model, copy_of(llama_adapters["full8"], tmp_path / "h", scale=1e6), "float16", dtype=torch.float16
    )
    assert "range" in msg
    assert read_adapter("ok", llama_adapters["full8"], *model, torch.float16).name == "ok"


def test_fifo_and_device_configs_never_block(model, llama_adapters, tmp_path):
    for i, make in enumerate((lambda p: os.mkfifo(p), lambda p: os.symlink("/dev/zero", p))):
        bad = copy_of(llama_adapters["full8"], tmp_path / f"d{i}")
        (bad / "adapter_config.json").unlink()
        make(bad / "adapter_config.json")
        refused_quickly(model, bad, "adapter_config.json is not a regular file")
        refused_quickly(model, bad, "not a regular file")  # twice: nothing left waiting
    bad = copy_of(llama_adapters["full8"], tmp_path / "t")
    (bad / "adapter_model.safetensors").unlink()
    os.mkfifo(bad / "adapter_model.safetensors")
    refused_quickly(model, bad, "adapter_model.safetensors is not a regular file")


def test_oversized_files_are_refused_unread(model, llama_adapters, tmp_path):
    big = copy_of(llama_adapters["full8"], tmp_path / "big")
    with open(big / "adapter_config.json", "r+b") as f:  # sparse: 96 MiB that cost nothing to write
        f.truncate(96 << 20)
    msg = refused_quickly(model, big, "adapter_config.json is", str(MAX_CONFIG_BYTES))
    assert str(96 << 20) in msg
    huge = copy_of(llama_adapters["full8"], tmp_path / "huge")
    with open(huge / "adapter_model.safetensors", "r+b") as f:
        f.truncate(8 << 30)
    refused_quickly(model, huge, "adapter_model.safetensors is", "more than")


def test_root_confinement_follows_symlinks_and_reveals_nothing(tmp_path, llama_adapters):
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(llama_adapters["full8"], root / "ok")
    (root / "link").symlink_to(llama_adapters["qv5"])  # inside by name, outside in fact
    real_root = os.path.realpath(root)
    assert inside_root(root / "ok", real_root) == os.path.realpath(root / "ok")
    messages = set()
    for path in (root / "link", root / ".." / "root" / ".." / "x", Path("/etc"), Path("/nonexistent/zz")):
        with pytest.raises(FileRefused) as info:
            inside_root(path, real_root)
        messages.add(str(info.value))
    assert len(messages) == 1 and "/" not in messages.pop().split("(")[0]  # one text, no path in it
    trusted = (os.path.realpath(llama_adapters["qv5"]),)
    assert inside_root(llama_adapters["qv5"], real_root, trusted) == trusted[0]


class HungReadLoader(LoaderActor):
    """A loader whose reads of adapters named "hang*" block until released, as a read on a hung
    network file system does (the disk is what this test plays, not the loader)."""

    release = threading.Event()

    def _read(self, job, limits):
        if job.name.startswith("hang"):
            self.release.wait(30)
        return super()._read(job, limits)


def test_a_hung_read_fails_its_load_and_shows_in_health(tmp_path, tiny_llama, model, llama_adapters):
    from runtime.base.endpoints import make_run_dir

    run_dir = make_run_dir("lph-")
    s = Scheduler(run_dir, tiny_llama, model[1], 4)
    s.cfg = s.cfg.__class__(
        **{**{f: getattr(s.cfg, f) for f in s.cfg.__struct_fields__}, "read_timeout_s": 1.0}
    )

    async def main() -> None:
        actor = HungReadLoader(s.cfg)
        task = asyncio.create_task(actor.run())
        try:
            await s.recv(LoaderStarted)
            hang = s.request("hang", llama_adapters["full8"])
            await s.send(hang)
            health = await s.recv(LoaderHealth)
            assert health.stuck_reads == 1 and "'hang'" in health.detail and health.handler_failures == 0
            failed = await s.recv(AdapterFailed)
            assert failed.name == "hang" and "longer than 1s" in failed.message
            assert failed.stage_fault  # a hung file system is not the adapter's fault: it may be retried
            assert failed.write_id == hang.write_id
            # the other threads keep loading
            assert isinstance(await s.stage("qv5", llama_adapters["qv5"]), AdapterStaged)
            HungReadLoader.release.set()
            assert (await s.recv(LoaderHealth)).stuck_reads == 0
        finally:
            HungReadLoader.release.set()
            actor.request_drain()
            actor.request_drain()
            assert await asyncio.wait_for(task, 20) == 0

    try:
        asyncio.run(main())
    finally:
        s.close()
        shutil.rmtree(run_dir, ignore_errors=True)
