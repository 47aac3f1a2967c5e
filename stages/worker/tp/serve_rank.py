"""A rank other than 0 of a tensor-parallel server worker: `python -m stages.worker.tp.serve_rank
CONFIG.json`, started by the worker stage (rank 0, `rank_zero.py`). It maps the shared host cache as
rank 0 does and copies each slot load's shard from the block the loader packed."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from proto.plan import SlotLoad
from runtime.common.host_pool import attach_pool, packed_from_pool, register_pinned
from runtime.common.packed import PackedAdapter
from stages.worker.runner import ModelRunner
from stages.worker.tp.follower import FollowerConfig, run_rank


class HostCache:
    """The shared host pool, mapped (and pinned on CUDA) at the first load, as the worker maps it."""

    def __init__(self, name: str):
        self.name = name
        self.pool = None

    def __call__(self, runner: ModelRunner, load: SlotLoad) -> PackedAdapter:
        if self.pool is None:
            self.pool = attach_pool(self.name)
            if runner.device.type == "cuda":
                register_pinned(self.pool)
        return packed_from_pool(self.pool, load, runner.host_layout, runner.dtype)


def main(argv: list[str]) -> int:
    cfg = msgspec.json.decode(Path(argv[1]).read_bytes(), type=FollowerConfig)
    if cfg.host_pool_name is None:
        raise SystemExit("a server rank needs the host cache's name (host_pool_name)")
    return run_rank(argv, from_host=HostCache(cfg.host_pool_name))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
