"""Triton kernels, each file with its kernel, a checked wrapper and a plain torch reference: LoRA shrink and
expand (SGMV) over `batch_info` tiles, and paged attention."""
