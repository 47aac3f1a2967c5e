"""Rank 0's view of the other ranks of a tensor-parallel worker: `RankProcesses` starts ranks 1..N-1 as
processes, joins the group with them, hands them each message (`proto/tensor_parallel.py`, over
`tp/channel.py`: a step is one message, sent without waiting on them), makes sure their adapter copies
are done before rank 0 reports a slot ready, and stops them. A rank that exits
before the group is formed, or while rank 0 waits on it, fails rank 0 with `RankFailed`; one that exits
while rank 0 is inside a step's collectives (on CUDA, where they wait on the device) makes the watchdog
abort the group, which fails the step, and end this process if the step still does not return."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
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

from proto.plan import BatchPlan
from proto.tensor_parallel import STOP_RANKS_TIMEOUT_S, BeginRun, LaunchStep, StopRanks, SyncCopies
from stages.worker.runner import ModelRunner, RunnerConfig
from stages.worker.tp.allreduce import peer_made_here
from stages.worker.tp.channel import StepSender, rank_address
from stages.worker.tp.follower import FollowerConfig, release_graphs, sync_copies
from stages.worker.tp.group import TPGroup, TPSpec, check_no_group, leaving_key, rank_device

log = logging.getLogger("lorapipe.tp")
ROOT = Path(__file__).resolve().parents[3]  # so `python -m MODULE` imports this tree from any cwd
T = TypeVar("T")
# The group's graceful teardown, once every rank is in it (NCCL's waits until they all are; on a loaded
# host another rank's release of its CUDA graphs alone can take seconds, which StopRanks' bound covers).
# One that takes longer is aborted instead.
LEAVE_TIMEOUT_S = 3.0
WATCH_S = 0.2  # how often the watchdog looks at the other ranks
STUCK_EXIT_S = 5.0  # after a rank died and the group was aborted, how long a step may still block


class RankFailed(RuntimeError):
    pass


class RankProcesses:
    def __init__(
        self,
        runner_cfg: RunnerConfig,
        size: int,
        module: str,
        host_pool_name: str | None = None,
        timeout_s: float = 300.0,
    ):
        """Starts ranks 1..size-1 as `python -m MODULE CONFIG.json` (each on its own device: cuda:k, or
        the CPU) and joins the group as rank 0; returns once every rank has joined. The ranks die with
        this process; the calling thread must live as long as the engine (the kernel's parent-death
        signal follows it). `host_pool_name`: the shared host cache the ranks copy adapters from."""
        check_no_teardown()
        check_no_group()
        self.size = size
        self.finished = 0  # steps rank 0 finished since the last BeginRun (told with the next launch)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=_delta(timeout_s), wait_for_workers=False
        )
        where = {
            "host": "127.0.0.1",
            "port": self.store.port,
            "peer_all_reduce": not (runner_cfg.disable_custom_all_reduce or peer_made_here()),
        }
        self._dir = tempfile.TemporaryDirectory(prefix="lorapipe-tp-")
        self.channel = StepSender(self._dir.name, size)
        self.procs: list[subprocess.Popen] = []
        self._stopping = threading.Event()  # set once this side stops the ranks (or gives up on them)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        for rank in range(1, size):
            cfg = FollowerConfig(
                runner=dataclasses.replace(runner_cfg, device=rank_device(runner_cfg.device, rank)),
                spec=TPSpec(rank=rank, size=size, **where, timeout_s=timeout_s),
                parent_pid=os.getpid(),
                channel=rank_address(self._dir.name, rank),
                host_pool_name=host_pool_name,
            )
            path = Path(self._dir.name) / f"rank{rank}.json"
            path.write_bytes(msgspec.json.encode(cfg))
            self.procs.append(subprocess.Popen([sys.executable, "-m", module, str(path)], env=env))
        spec = TPSpec(rank=0, size=size, **where, timeout_s=timeout_s)
        device = torch.device(rank_device(runner_cfg.device, 0))
        try:
            self.group = self.watch(lambda: TPGroup(spec, device, self.store))
        except BaseException:
            self.kill()
            self._release()
            raise
        if device.type == "cuda":
            threading.Thread(target=self._watchdog, name="tp-watchdog", daemon=True).start()

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
        """Hand every other rank `msg` (they act on it in the order sent) without waiting for them;
        `RankFailed` if one has exited. A BeginRun starts the count of finished steps again, as it
        does on every rank."""
        self.check()
        if isinstance(msg, BeginRun):
            self.finished = 0
        self.channel.send(msg, self.check)

    def launch(self, plan: BatchPlan) -> None:
        """Before rank 0 launches `plan`: the one message of its step."""
        self.send(LaunchStep(plan=plan, finished=self.finished))

    def step_finished(self) -> None:
        """Rank 0 finished its oldest step: the other ranks hear of it with the next launch."""
        self.finished += 1

    def sync_copies(self) -> None:
        """Return once every rank's adapter copies issued so far are done (rank 0's included)."""
        self.send(SyncCopies())
        sync_copies(self.group)

    def close(self, runner: ModelRunner | None = None) -> None:
        """Stop the other ranks, leave the group with them (rank 0's `runner` drops its CUDA graphs
        first, as each other rank does) and reap them; a rank that does not stop in time is killed."""
        self._stopping.set()
        try:
            alive = all(p.poll() is None for p in self.procs)
            if alive:
                self.send(StopRanks())
                if runner is not None:
                    release_graphs(runner)
            deadline = time.monotonic() + STOP_RANKS_TIMEOUT_S
            self._leave(graceful=alive and self._all_leaving(deadline - LEAVE_TIMEOUT_S))
            for p in self.procs:
                p.wait(max(0.0, deadline - time.monotonic()))
        except (subprocess.TimeoutExpired, RuntimeError) as e:
            log.warning("a tensor-parallel rank did not stop cleanly (%s); killing it", e)
        finally:
            self.kill()
            self._release()

    def abandon(self) -> None:
        """After a failure on rank 0: kill the other ranks (they may wait in a collective rank 0 will
        never join) and leave the group."""
        self._stopping.set()
        self.kill()
        self._leave(graceful=False)
        self._release()

    def _release(self) -> None:
        """Once the other ranks are gone: their channel (nothing left to deliver) and its directory."""
        self.channel.close()
        self._dir.cleanup()

    def _all_leaving(self, deadline: float) -> bool:
        """Wait until every other rank has announced that it is leaving (`TPGroup.announce_leaving`):
        False at `deadline`, or at once when one has exited."""
        keys = [leaving_key(rank) for rank in range(1, self.size)]
        while True:
            try:
                self.store.wait(keys, _delta(WATCH_S))
                return True
            except RuntimeError:  # not yet (a DistStoreError, after WATCH_S)
                if time.monotonic() >= deadline or any(p.poll() is not None for p in self.procs):
                    log.warning("a tensor-parallel rank did not reach the group's teardown in time")
                    return False

    def _leave(self, graceful: bool) -> None:
        """Leave the group: together with the other ranks, all in the teardown (`graceful`), aborting if
        it takes over LEAVE_TIMEOUT_S; or alone, giving up after STOP_RANKS_TIMEOUT_S. A teardown given up on
        stays on its thread, and this process makes no other group until it ends (`_teardowns`)."""
        t0 = time.monotonic()
        if graceful and _within(lambda: self.group.close(graceful=True), LEAVE_TIMEOUT_S):
            log.info("left the tensor-parallel group in %.2f s", time.monotonic() - t0)
            return
        if graceful:
            log.warning("leaving the tensor-parallel group took over %g s; aborting it", LEAVE_TIMEOUT_S)
        if not _within(self.group.close, STOP_RANKS_TIMEOUT_S):
            log.warning("leaving the tensor-parallel group took over %g s; going on", STOP_RANKS_TIMEOUT_S)

    def _watchdog(self) -> None:
        """A rank that exits while this side has not stopped it: kill the others and abort the group, so
        that a collective waiting for the dead rank fails instead of waiting out the group's timeout. A
        step still blocked STUCK_EXIT_S later (a peer-memory kernel waits on the device for the dead
        rank's signal, which no abort reaches) ends this process: it could never return."""
        while not self._stopping.wait(WATCH_S):
            dead = [(rank, p.returncode) for rank, p in enumerate(self.procs, 1) if p.poll() is not None]
            if not dead:
                continue
            if self._stopping.is_set():
                return
            log.error("tensor-parallel rank %d exited (%s) while serving; aborting the group", *dead[0])
            self.kill()
            _within(self.group.close, STOP_RANKS_TIMEOUT_S)
            if not self._stopping.wait(STUCK_EXIT_S):
                log.critical("a step is still blocked on the dead rank after %g s; exiting", STUCK_EXIT_S)
                logging.shutdown()
                os._exit(70)
            return

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


_teardowns: list[threading.Thread] = []  # group teardowns given up on, maybe still running


def check_no_teardown() -> None:
    """A teardown still running would destroy torch's process-group state under a new group."""
    _teardowns[:] = [t for t in _teardowns if t.is_alive()]
    if _teardowns:
        raise RuntimeError(
            "the last tensor-parallel group of this process is still being torn down (its teardown "
            "outlived its bound); start another engine in a new process"
        )


def _within(fn: Callable[[], None], seconds: float) -> bool:
    """Run `fn` on a daemon thread; False if it has not returned within `seconds` (it is left there,
    in `_teardowns`)."""
    t = threading.Thread(target=fn, name="tp-close", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        _teardowns.append(t)
        return False
    return True


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
