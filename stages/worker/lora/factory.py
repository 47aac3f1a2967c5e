"""Choose and build a LoRA backend by name. Apart from `backend.py` so that the interface module never
imports its own implementations (no import cycle)."""

from __future__ import annotations

from stages.worker.lora.backend import LoraBackend
from stages.worker.lora.pool import LoraPool
from stages.worker.lora.torch_backend import TorchLoraBackend

BACKENDS = ("torch", "triton")


def make_backend(name: str, pool: LoraPool, max_tokens: int, max_seqs: int | None = None) -> LoraBackend:
    if name == "torch":
        return TorchLoraBackend(pool, max_tokens, max_seqs)
    if name == "triton":
        from stages.worker.lora.triton_backend import TritonLoraBackend  # triton: a Linux-only dependency

        return TritonLoraBackend(pool, max_tokens, max_seqs)
    raise ValueError(f"unknown lora backend {name!r} (choose one of {', '.join(BACKENDS)})")
