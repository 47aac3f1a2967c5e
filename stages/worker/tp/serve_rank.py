"""A rank other than 0 of a tensor-parallel server worker: `python -m stages.worker.tp.serve_rank
CONFIG.json`, started by the worker stage (rank 0, `rank_zero.py`). Its config names the shared host
cache, which it maps as rank 0 does, copying each slot load's shard from the block the loader packed
(`follower.HostBlocks`)."""

from __future__ import annotations

import sys

from stages.worker.tp.follower import run_rank

if __name__ == "__main__":
    sys.exit(run_rank(sys.argv))
