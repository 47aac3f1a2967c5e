"""The paged KV cache tensors owned by the worker: fixed-size pages, addressed by flat row
(page * page_size + offset); page allocation itself is the scheduler's business. One extra page past
`num_pages` is never handed out: padding tokens of a fixed-size (graphed) batch write there."""

from __future__ import annotations

import torch


def pages_that_fit(device: torch.device, per_page: int, utilization: float, reserve: int) -> int:
    """Pages of `per_page` bytes that fit in what `device` has free now (other engines and processes
    count), less the share `utilization` leaves unused and `reserve` bytes kept for activations."""
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int((free - total * (1 - utilization) - reserve) // per_page)


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_pages = num_pages  # pages the scheduler may use
        self.page_size = page_size
        self.scratch_row = num_pages * page_size  # first row of the extra page
        shape = (num_layers, (num_pages + 1) * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, pages * page_size, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, pages * page_size, KVH, D]

    @staticmethod
    def bytes_per_page(*, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, KVH, D] stored at flat cache rows `rows` [T]."""
        self.k[layer].index_copy_(0, rows, k)
        self.v[layer].index_copy_(0, rows, v)
