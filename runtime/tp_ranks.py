"""A rank other than 0 of a tensor-parallel offline engine (`runtime.offline.LLM`), started by rank 0's
`stages.worker.tp.ranks.RankProcesses` as `python -m runtime.tp_ranks CONFIG.json`: it reads each adapter
rank 0 added from its files, as rank 0 did."""

from __future__ import annotations

import sys

from proto.tensor_parallel import AddAdapter
from runtime.common.packed import PackedAdapter
from stages.loader.adapter_reader import read_adapter
from stages.worker.runner import ModelRunner
from stages.worker.tp.follower import run_rank


def read_for(runner: ModelRunner, msg: AddAdapter) -> PackedAdapter:
    """An adapter as every rank packs it: the whole model's layout, pinned on CUDA."""
    pin = runner.device.type == "cuda"
    return read_adapter(msg.name, msg.path, runner.full_cfg, runner.host_layout, runner.dtype, pin_memory=pin)


if __name__ == "__main__":
    sys.exit(run_rank(sys.argv, read=read_for))
