"""Process-wide settings for a process whose threads read and pack adapters (the adapter-loader stage,
and tools that measure it): the parallelism comes from those threads, and the GIL must change hands fast."""

from __future__ import annotations

import gc
import sys

import torch

SWITCH_INTERVAL_S = 1e-4  # Python's default is 5 ms


def tune_for_loads(switch_interval_s: float = SWITCH_INTERVAL_S) -> None:
    """One intra-op thread (loads run on their own threads: more would only oversubscribe the cores); a
    short GIL switch interval (a thread back from a GIL-free copy waits at most this long while another
    thread runs Python, e.g. a header's planning); start-up objects (torch's) frozen out of the
    collector's scans (a full scan stalls every load for milliseconds)."""
    torch.set_num_threads(1)
    sys.setswitchinterval(switch_interval_s)
    gc.freeze()
