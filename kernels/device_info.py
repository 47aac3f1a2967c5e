"""What the kernels' launch heuristics ask of the device, in one place (tests patch `num_sms` here)."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from kernels.batch_info import interpreting

# Set to 0 to launch every kernel in plain stream order (programmatic dependent launch off), for A/B runs.
PDL_ENV = "LORAPIPE_PDL"
# Launches over more tiles than this keep plain stream order: on the H100 a 31 x 256-token prefill step
# (768 tiles) takes 1.1 % longer with its LoRA kernels as dependents, while steps of up to 320 tiles take
# 0.4-7 % less.
PDL_MAX_TILES = 512
# Shared memory one program may take on an H100 or H200 (cudaDevAttrMaxSharedMemoryPerBlockOptin, 227
# KiB): the CPU interpreter's stand-in, so that it picks the configs a Hopper GPU would.
HOPPER_MAX_SHARED = 232448


@lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the CPU interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@lru_cache(maxsize=8)
def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on `device` (the opt-in limit Triton checks a compiled
    kernel against at load); HOPPER_MAX_SHARED elsewhere."""
    if device.type != "cuda":
        return HOPPER_MAX_SHARED
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", HOPPER_MAX_SHARED))


def pdl_for(device: torch.device, tiles: int) -> bool:
    """`pdl` for the configs of a batch of `tiles` token tiles (`ShrinkConfig.pdl`, `ExpandConfig.pdl`:
    the configs carry it, so that the warm-up, which plans variants by their configs, compiles both)."""
    return tiles <= PDL_MAX_TILES and pdl(device)


@lru_cache(maxsize=8)
def pdl(device: torch.device) -> bool:
    """Whether the LoRA kernels launch as programmatic dependents of the kernel before them (Hopper and
    later, compiled kernels only; LORAPIPE_PDL=0 turns it off). A dependent may start while its
    predecessor's last programs run: it reads the step's constant data (batch metadata, adapter rows)
    first and waits (`gdc_wait`) before anything a kernel of the step wrote, and before it exits."""
    if device.type != "cuda" or interpreting() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
