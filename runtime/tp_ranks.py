"""The other ranks of a tensor-parallel offline engine, seen from rank 0 (the caller's process):
`RankProcesses` starts ranks 1..N-1 as `python -m runtime.tp_ranks CONFIG.json`, joins the group with
them, hands them each message (`proto/tensor_parallel.py`) and stops them. A rank that exits before the
group is formed, or while rank 0 waits for a collective it started, fails the engine with its exit."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec
import torch
import torch.distributed as dist

from proto.tensor_parallel import AddAdapter, StopRanks
from runtime.base.parent_death import arm
from runtime.common.packed import PackedAdapter
from stages.loader.adapter_reader import read_adapter
from stages.worker.runner import ModelRunner, RunnerConfig
from stages.worker.tp.follower import Follower, FollowerConfig, rank_codec
from stages.worker.tp.group import TPGroup, TPSpec, rank_device

log = logging.getLogger("lorapipe.tp")
ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")
STOP_TIMEOUT_S = 10.0


class RankFailed(RuntimeError):
    pass


def read_for(runner: ModelRunner, msg: AddAdapter) -> PackedAdapter:
    """An adapter as every rank packs it: the whole model's layout, pinned on CUDA."""
    pin = runner.device.type == "cuda"
    return read_adapter(msg.name, msg.path, runner.full_cfg, runner.host_layout, runner.dtype, pin_memory=pin)


class RankProcesses:
    def __init__(self, runner_cfg: RunnerConfig, size: int, timeout_s: float = 300.0):
        """Starts ranks 1..size-1 (each on its own device: cuda:k, or the CPU) and joins the group as
        rank 0; returns once every rank has joined. The ranks die with this process; the calling
        thread must live as long as the engine (the kernel's parent-death signal follows it)."""
        self.size = size
        self.codec = rank_codec()
        self.store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=_delta(timeout_s), wait_for_workers=False
        )
        where = {"host": "127.0.0.1", "port": self.store.port}
        self._dir = tempfile.TemporaryDirectory(prefix="lorapipe-tp-")
        self.procs: list[subprocess.Popen] = []
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        for rank in range(1, size):
            cfg = FollowerConfig(
                runner=dataclasses.replace(runner_cfg, device=rank_device(runner_cfg.device, rank)),
                spec=TPSpec(rank=rank, size=size, **where, timeout_s=timeout_s),
                parent_pid=os.getpid(),
            )
            path = Path(self._dir.name) / f"rank{rank}.json"
            path.write_bytes(msgspec.json.encode(cfg))
            self.procs.append(
                subprocess.Popen([sys.executable, "-m", "runtime.tp_ranks", str(path)], env=env)
            )
        spec = TPSpec(rank=0, size=size, **where, timeout_s=timeout_s)
        device = torch.device(rank_device(runner_cfg.device, 0))
        try:
            self.group = self.watch(lambda: TPGroup(spec, device, self.store))
        except BaseException:
            self.kill()
            raise

    def watch(self, fn: Callable[[], T]) -> T:
        """`fn()` (which meets the other ranks in collectives), failing with `RankFailed` if a rank
        exits meanwhile instead of waiting for the group's timeout."""
        out: dict[str, object] = {}

        def run() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                out["error"] = e

        t = threading.Thread(target=run, name="tp-rank0", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
            self.check()
        if "error" in out:
            raise out["error"]  # type: ignore[misc]
        return out["value"]  # type: ignore[return-value]

    def check(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                raise RankFailed(f"tensor-parallel rank {rank} exited ({code}); its log is above")

    def send(self, msg) -> None:
        """Hand every other rank `msg` (they act on it in the order sent)."""
        (frame,) = self.codec.encode(msg)
        self.group.broadcast_bytes(bytes(frame))

    def close(self) -> None:
        """Stop the other ranks, leave the group and reap them; a rank that does not stop in time is
        killed."""
        try:
            if all(p.poll() is None for p in self.procs):
                self.send(StopRanks())
            if not _within(self.group.close, STOP_TIMEOUT_S):
                log.warning("leaving the tensor-parallel group took over %g s; going on", STOP_TIMEOUT_S)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in self.procs:
                p.wait(max(0.0, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, RuntimeError) as e:
            log.warning("a tensor-parallel rank did not stop cleanly (%s); killing it", e)
        finally:
            self.kill()
            self._dir.cleanup()

    def abandon(self) -> None:
        """After a failure on rank 0: kill the other ranks (they may wait in a collective rank 0 will
        never join) and leave the group."""
        self.kill()
        if not _within(self.group.close, STOP_TIMEOUT_S):
            log.warning("leaving the tensor-parallel group took over %g s; going on", STOP_TIMEOUT_S)
        self._dir.cleanup()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _within(fn: Callable[[], None], seconds: float) -> bool:
    """Run `fn` on a daemon thread; False if it has not returned within `seconds` (it is left there)."""
    t = threading.Thread(target=fn, name="tp-close", daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def _delta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def main(argv: list[str]) -> int:
    cfg = msgspec.json.decode(Path(argv[1]).read_bytes(), type=FollowerConfig)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank{cfg.spec.rank} %(levelname)s %(message)s"
    )
    # This rank dies with rank 0's process, even blocked in a collective (the thread that made the
    # engine must outlive it, as PR_SET_PDEATHSIG follows the spawning thread).
    if not arm(signal.SIGKILL, cfg.parent_pid):
        log.error("rank 0 (pid %d) exited before rank %d started", cfg.parent_pid, cfg.spec.rank)
        return 1
    follower = Follower(cfg, read_for)
    follower.run()  # an error propagates: the rank exits non-zero and rank 0 reports it
    follower.close()
    # Stopped by rank 0: leave now, without the interpreter's teardown, whose CUDA and NCCL destructors
    # can wait on ranks that have already gone.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
