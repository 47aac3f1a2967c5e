"""What the kernels' launch heuristics ask of the device, in one place (tests patch `num_sms` here)."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the CPU interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
