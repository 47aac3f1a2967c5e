"""The sum over tensor-parallel ranks of a decode step's or a small prefill's activations, by the
cheapest path for its size: a message of a few hundred KiB spends most of NCCL's time in its protocol,
not on the wire, so small ones go through peer memory over NVLink instead (PyTorch's symmetric-memory
one-shot and two-shot kernels; never NVLink multicast), and large ones through NCCL.

- one-shot: each rank copies its part into its symmetric buffer, then reads every rank's buffer and
  adds them in rank order (one read of (N-1) peers' bytes; the lowest latency);
- two-shot: each rank reduces 1/N of the message and gathers the others' reduced slices (reduce-scatter
  then all-gather; less traffic for larger messages);
- NCCL above `two_shot_max` bytes, on the CPU (gloo), without peer access, or when asked
  (`--disable-custom-all-reduce`).

The choice depends only on the message's byte size and the group, so every rank takes the same path for
the same step (their kernels must meet) and a captured CUDA graph replays the path it captured. Every
rank gets the same bits: one-shot adds the ranks' parts in one fixed order, and two-shot's slices are
each reduced once and copied to every rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("lorapipe.tp")

# Crossovers on H100/H200 NVLink (benchmarks/bench_allreduce.py sweeps the sizes): one-shot reads every
# peer's whole message, which stops paying once a message takes longer to read than two-shot's extra
# synchronisation costs; NCCL's ring catches up with two-shot at a few MiB.
ONE_SHOT_MAX_BYTES = 1024 * 1024
TWO_SHOT_MAX_BYTES = 8 * 1024 * 1024
SYMM_MEM_WORLD_SIZES = (2, 4, 8)  # what the symmetric-memory kernels are built for
# Symmetric-memory rendezvous number their store exchanges with a counter of the process (torch 2.11),
# so a process that made a group's buffer before is out of step with fresh rank processes: a second
# engine in one process (rank 0's) sums through NCCL instead.
_made_in_this_process = False


def peer_made_here() -> bool:
    return _made_in_this_process


@dataclass(frozen=True)
class AllReducePaths:
    """Which path a message of each size takes (`path`); the thresholds are inclusive."""

    peer: bool  # peer memory is set up for this group (CUDA, every pair of ranks with P2P access)
    one_shot_max: int = ONE_SHOT_MAX_BYTES
    two_shot_max: int = TWO_SHOT_MAX_BYTES

    def path(self, nbytes: int) -> str:
        if not self.peer or nbytes > self.two_shot_max:
            return "nccl"
        return "one_shot" if nbytes <= self.one_shot_max else "two_shot"


def peer_capable(device: torch.device, world_size: int, disabled: bool) -> tuple[bool, str]:
    """Whether this group can use peer memory, and why not when it cannot (for the start-up log)."""
    if disabled:
        return False, "disabled (--disable-custom-all-reduce)"
    if device.type != "cuda":
        return False, "not on CUDA"
    if world_size not in SYMM_MEM_WORLD_SIZES:
        return False, f"a group of {world_size} ranks (peer kernels take {SYMM_MEM_WORLD_SIZES})"
    n = torch.cuda.device_count()
    if n < world_size:
        return False, f"{n} visible devices for {world_size} ranks"
    for a in range(world_size):
        for b in range(world_size):
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return False, f"cuda:{a} has no peer access to cuda:{b}"
    return True, ""


class PeerAllReduce:
    """The symmetric buffer of one group (`two_shot_max` bytes on every rank, mapped by every other)
    and the sum through it. Made collectively: every rank of the group constructs it, in the same
    order relative to the group's other collectives."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, paths: AllReducePaths):
        import torch.distributed._symmetric_memory as symm_mem

        global _made_in_this_process
        _made_in_this_process = True
        self.paths = paths
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(paths.two_shot_max, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group=self.group_name)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over ranks, as a new tensor (`t` is left as it was)."""
        path = self.paths.path(t.nbytes)
        assert path != "nccl", f"a {t.nbytes}-byte message is NCCL's"
        return self.sum(t.contiguous(), path)

    def sum(self, t: torch.Tensor, path: str) -> torch.Tensor:
        """The sum of contiguous `t` over ranks by `path` ("one_shot" or "two_shot"; every rank must
        name the same), as a new tensor: staged in this rank's symmetric buffer, read by every rank."""
        staged = self.buffer[: t.nbytes].view(t.dtype).view(t.shape)
        out = torch.empty_like(t)
        if path == "one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, t, "sum", self.group_name, out)
        elif path == "two_shot":
            staged.copy_(t)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)
        else:
            raise ValueError(f"no peer all-reduce path {path!r}")
        return out


def make_peer(
    group: dist.ProcessGroup, device: torch.device, world_size: int, disabled: bool
) -> PeerAllReduce | None:
    """The group's peer all-reduce, or None (with one log line saying why) where only NCCL/gloo runs.
    Every rank gets the same answer (the checks read only the host's devices and the arguments)."""
    ok, why = peer_capable(device, world_size, disabled)
    if not ok:
        if device.type == "cuda":
            log.info("tensor-parallel all-reduce: NCCL only (%s)", why)
        return None
    peer = PeerAllReduce(group, device, AllReducePaths(peer=True))
    log.info(
        "tensor-parallel all-reduce: peer one-shot up to %d KiB, two-shot up to %d KiB, NCCL above",
        peer.paths.one_shot_max // 1024,
        peer.paths.two_shot_max // 1024,
    )
    return peer
