"""The fixed device inputs of a step padded to a token-count bucket (what the step CUDA graphs read):
token ids, positions, KV rows, logits rows, the page table and the attention block plan, staged in a
pinned host ring and uploaded by two small kernels (HostStaging.upload). Padding tokens form sequences of
at most one page on the KV cache's scratch page (they write and read only there) with no adapter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.paged_attention import META_COLS, decode_block_m, plan_blocks
from stages.worker.decode_graphs import DecodeSeq, HostStaging
from stages.worker.model.forward_batch import SeqExtent
from stages.worker.model.kv_cache import KVCache


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: 16, 32, 64, then steps of 128 to 1024, of 256 to 4096, of 512 beyond (at most
    1/8 of padding past 1024 tokens); max_tokens last."""
    sizes = [16, 32, 64, *range(128, 1024, 128), *range(1024, 4096, 256), *range(4096, max_tokens, 512)]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


@dataclass(frozen=True)
class StagedStep:
    """Host-known facts of one staged step: the graph key's inputs and the eager attention's extents."""

    padded: int  # tokens the step runs (real ones first)
    num_seqs: int  # real sequences: logits rows [0, num_seqs)
    extents: tuple[SeqExtent, ...]  # real then padding sequences (page-table rows in this order)
    num_blocks: int  # attention blocks of those extents (rows [0, num_blocks) of the block plan)
    most_keys: int  # keys of the heaviest block


class StepInputs:
    def __init__(
        self,
        kv: KVCache,
        *,
        max_tokens: int,
        max_seqs: int,
        max_pages: int,
        num_heads: int,
        num_kv_heads: int,
        ring: int = 3,
    ):
        """`max_tokens`: the largest bucket; `max_seqs`: real sequences one step may hold; `max_pages`:
        the page-table width (a sequence's context reaches max_pages * page_size tokens)."""
        self.kv, self.device = kv, kv.k.device
        self.max_tokens, self.max_seqs, self.max_pages = max_tokens, max_seqs, max_pages
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.group = num_heads // num_kv_heads
        self.meta_len = self.block_capacity(max_tokens) * META_COLS
        mt, rows = max_tokens, self.table_rows(max_tokens)
        n64, n32 = 3 * mt + self.out_rows(mt), self.meta_len + rows * max_pages
        self._i64 = torch.zeros(n64, dtype=torch.int64, device=self.device)  # ids|positions|KV rows|logits
        self._i32 = torch.zeros(n32, dtype=torch.int32, device=self.device)  # attention blocks|page table
        self.ids, self.positions, self.rows = self._i64[: 3 * mt].view(3, mt).unbind(0)
        self.logits_indices = self._i64[3 * mt :]
        self.attn_meta = self._i32[: self.meta_len].view(-1, META_COLS)
        self.page_table = self._i32[self.meta_len :].view(rows, max_pages)
        pin = self.device.type == "cuda"
        self._ring = [HostStaging(n64, n32, pin) for _ in range(ring)]
        self._next = 0

    def table_rows(self, padded: int) -> int:
        """Page-table rows of a bucket: real sequences plus padding ones (one page each)."""
        return min(padded, self.max_seqs + -(-padded // self.kv.page_size))

    def out_rows(self, padded: int) -> int:
        """Logits rows a bucket's graph computes: one per real sequence it can hold."""
        return min(padded, self.max_seqs)

    def block_m(self, padded: int) -> int:
        """Attention rows per block of a bucket: the eager choice for its longest possible query."""
        return decode_block_m(padded * self.group)

    def block_capacity(self, padded: int) -> int:
        """Blocks the bucket's graph launches: sum(ceil(q_len * group / block_m)) over its sequences is at
        most padded * group // block_m plus one partial block per sequence. Rows past a step's own
        blocks are all zero: blocks with no query rows, which return at once."""
        return padded * self.group // self.block_m(padded) + self.table_rows(padded)

    def stage(self, seqs: Sequence[DecodeSeq], padded: int) -> StagedStep:
        """Write the step into the next staging buffer and issue its upload. `seqs` are in token order
        (each adapter's tokens contiguous); together at most `padded` tokens."""
        n_seqs, mt, ps = len(seqs), self.max_tokens, self.kv.page_size
        st = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        st.wait_free()
        h64, h32 = st.i64.numpy(), st.i32.numpy()
        ids, pos, rows = h64[: 3 * mt].reshape(3, mt)
        logits = h64[3 * mt :]
        table = h32[self.meta_len :].reshape(-1, self.max_pages)
        total = sum(len(s.token_ids) for s in seqs)
        if total > padded or n_seqs > self.out_rows(padded):
            raise ValueError(f"{n_seqs} sequences of {total} tokens do not fit the {padded}-token bucket")
        q_starts, q_lens, ctx = [], [], []
        t = 0
        for b, s in enumerate(seqs):
            n, p = len(s.token_ids), s.start_pos
            if n == 1:  # decodes: scalar writes are cheaper than numpy calls
                ids[t], pos[t] = s.token_ids[0], p
                rows[t] = s.page_ids[p // ps] * ps + p % ps
            else:
                ids[t : t + n] = s.token_ids
                pp = np.arange(p, p + n)
                pos[t : t + n] = pp
                first = p // ps
                pages = np.asarray(s.page_ids[first : (p + n - 1) // ps + 1], dtype=np.int64)
                rows[t : t + n] = pages[pp // ps - first] * ps + pp % ps
            used = (p + n - 1) // ps + 1
            table[b, :used] = s.page_ids[:used]
            logits[b] = t + n - 1
            q_starts.append(t)
            q_lens.append(n)
            ctx.append(p + n)
            t += n
        # Padding: sequences of up to one page on the scratch page, positions from 0; every padding row
        # is computed (attention included), so nothing reads uninitialised memory.
        n_pad = padded - t
        j = np.arange(n_pad)
        ids[t:padded], pos[t:padded], rows[t:padded] = 0, j % ps, self.kv.scratch_row + j % ps
        logits[n_seqs : self.out_rows(padded)] = 0
        for k, start in enumerate(range(0, n_pad, ps)):
            n = min(ps, n_pad - start)
            table[n_seqs + k, 0] = self.kv.num_pages  # the scratch page
            q_starts.append(t + start)
            q_lens.append(n)
            ctx.append(n)
        meta, _, most_keys = plan_blocks(
            q_starts, q_lens, ctx, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            block_m=self.block_m(padded),
        )  # fmt: skip
        nb, cap = meta.shape[0], self.block_capacity(padded)
        assert nb <= cap, (nb, cap)
        h32[: nb * META_COLS] = meta.reshape(-1)
        h32[nb * META_COLS : cap * META_COLS] = 0  # empty blocks: no query rows
        st.upload(self._i64, self._i32, self.meta_len + len(q_starts) * self.max_pages)
        extents = tuple(SeqExtent(q, n, c) for q, n, c in zip(q_starts, q_lens, ctx, strict=True))
        return StagedStep(padded, n_seqs, extents, nb, most_keys)
