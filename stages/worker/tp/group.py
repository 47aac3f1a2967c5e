"""A tensor-parallel group of worker processes: the collectives the sharded forward needs (the sum of
partial outputs, the gather of vocabulary shards, on the compute device: NCCL on CUDA, gloo on the CPU)
and a gloo group on the CPU for the host's agreements (the smallest capacity, the barrier after adapter
copies). Steps travel apart from it, on `tp/channel.py`."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stages.worker.tp.allreduce import PeerAllReduce, make_peer

# Set before the group is made, unless the caller set them:
# - NVLink multicast stays off, in NCCL (NVLS) and in the symmetric-memory buffers of the peer sums: on
#   shared multi-GPU hosts it can take the GPUs out of service;
# - a failed or aborted NCCL collective aborts its communicator and fails the waiting step (2), which the
#   engine turns into an error or the rank watchdog into a bounded exit; torch's default (3) instead kills
#   the whole process with SIGABRT from its own watchdog thread whenever the group is aborted: after a rank
#   died, or after a graceful leave that outlived its bound (a loaded host), even once the engine is closed.
NCCL_ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}


def leaving_key(rank: int) -> str:
    """The rendezvous store's key a rank sets once it has let go of its CUDA graphs and is about to
    tear the group down (`TPGroup.announce_leaving`)."""
    return f"lorapipe/leaving/{rank}"


@dataclass(frozen=True)
class TPSpec:
    """Where a rank joins its group: the rendezvous store rank 0 listens on at `host`:`port`."""

    rank: int
    size: int
    host: str
    port: int
    timeout_s: float = 300.0  # a collective that waits longer (a rank died or hangs) fails the group
    peer_all_reduce: bool = True  # small sums through NVLink peer memory where it can (allreduce.py)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside a group of {self.size}")


def rank_device(device: str, rank: int) -> str:
    """The device of `rank` when the group runs on `device` ("cuda" or "cuda:0": cuda:rank; cpu: cpu)."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def check_no_group() -> None:
    """A process belongs to one group at a time (torch's default process group); a second engine's
    ranks would otherwise fail deep inside torch."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a tensor-parallel group: close() the engine that made it "
            "(or leave its `with` block) before starting another"
        )


class TPGroup:
    def __init__(self, spec: TPSpec, device: torch.device, store: dist.Store | None = None):
        """Joins the group (blocks until every rank has). `store`: rank 0's rendezvous store, already
        listening; other ranks connect to it at the spec's address."""
        self.rank, self.size, self.device = spec.rank, spec.size, device
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        cuda = device.type == "cuda"
        check_no_group()
        if cuda:
            for k, v in NCCL_ENV_DEFAULTS.items():
                os.environ.setdefault(k, v)
            torch.cuda.set_device(device)
        if store is None:
            store = dist.TCPStore(spec.host, spec.port, spec.size, is_master=False, timeout=timeout)
        self.store = store
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=store,
            rank=spec.rank,
            world_size=spec.size,
            timeout=timeout,
            device_id=device if cuda else None,
        )
        self._gloo_compute = not cuda
        self.peer: PeerAllReduce | None = None
        try:
            # host-side agreements (and barriers) travel on the CPU, whatever the compute device
            self.control = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
            self.peer = make_peer(dist.group.WORLD, device, spec.size, disabled=not spec.peer_all_reduce)
        except BaseException:
            self.close()  # a group half made is left, so that this process can make another
            raise

    # -- collectives of the forward (compute device, CUDA-graph capturable) ----------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over ranks: through peer memory for a small message (a new tensor), else
        in place through NCCL/gloo (`t` itself). Callers use the returned tensor."""
        if self.peer is not None and self.peer.paths.path(t.nbytes) != "nccl":
            return self.peer(t)
        dist.all_reduce(t)
        return t

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """[B, C] on every rank → [B, size * C], rank k's columns at [k * C, (k + 1) * C)."""
        t = t.contiguous()
        if self._gloo_compute:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(parts, t)
            return torch.cat(parts, dim=1)
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t)
        return out.permute(1, 0, 2).reshape(t.shape[0], -1)

    # -- host agreement (CPU, gloo) ---------------------------------------------------------------------
    def min_int(self, value: int) -> int:
        """The smallest `value` over ranks (what every rank can hold: KV pages, pool rows)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def announce_leaving(self) -> None:
        """Tell rank 0 this rank is about to leave: NCCL's graceful teardown waits until every rank is in
        it, so rank 0 bounds the teardown itself only from there (`RankProcesses.close`)."""
        self.store.set(leaving_key(self.rank), "1")

    def close(self, graceful: bool = False) -> None:
        """Leave the group. `graceful` (every rank leaves together, nothing in flight, and no CUDA graph
        that captured a collective is alive: a graceful NCCL teardown waits on such graphs' work):
        destroy the group, so that this process can make another. Otherwise, on NCCL, abort it: the
        other ranks may be gone or stuck inside a collective, and only an abort returns then."""
        if not dist.is_initialized():
            return
        self.peer = None  # the symmetric buffer is the group's: it goes first
        if self._gloo_compute:
            dist.destroy_process_group()
        elif graceful:
            torch.cuda.synchronize(self.device)
            dist.destroy_process_group()
        else:
            dist.distributed_c10d._abort_process_group()
