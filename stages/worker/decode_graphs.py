"""Decode steps (one new token per sequence) at fixed batch sizes, replayed as CUDA graphs.

A decode batch of B sequences runs padded to the next bucket size Bp. Its inputs are staged on the host
(a pinned ring) and uploaded by two small kernels (kernels/host_copy) into fixed device buffers that the
graph of that bucket reads: token ids, positions, KV rows, the attention block plan and a narrow page
table. Padding tokens are one-token sequences on the cache's scratch page (they write and read only
there) with no adapter. Graphs are keyed by (Bp, attention key splits, LoRA tile class: 0 without
adapters); the LoRA kernels' configs follow the class and their grids cover the most tiles a batch of
the class can have (`TritonLoraBackend.prepare`), stopping at the tile count in their device metadata, so
one graph serves every adapter mix of its class.
Without capture (CPU, tests) the same padded forward runs eagerly."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from kernels.host_copy import PinnedBuffer
from kernels.paged_attention import (
    META_COLS,
    AttentionPlan,
    choose_splits,
    decode_block_m,
    plan_blocks,
    split_key_counts,
)
from stages.worker.graph_capture import recording
from stages.worker.lora.backend import LoraBackend, slot_segments
from stages.worker.model.forward_batch import ForwardBatch
from stages.worker.model.kv_cache import KVCache
from stages.worker.model.llama import LlamaModel
from stages.worker.seq_input import fill_pending


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, then steps of 8 to 64, of 16 to 256, of 32 beyond; max_batch last."""
    sizes = [1, 2, 4, *range(8, 64, 8), *range(64, 256, 16), *range(256, max_batch, 32)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeSeq(Protocol):
    """What a decode sequence offers (the runner's SeqInput): one new token at position start_pos."""

    token_ids: Sequence[int]
    start_pos: int  # tokens of the sequence already in the KV cache
    page_ids: Sequence[int]
    slot: int  # LoRA slot, -1 for none


class HostStaging:
    """One pinned host copy of the fixed device inputs (int64 and int32 parts), each with the event of its
    last upload."""

    def __init__(self, n64: int, n32: int, pin: bool):
        self._b64 = PinnedBuffer(n64, torch.int64, pin)
        self._b32 = PinnedBuffer(n32, torch.int32, pin)
        self.i64, self.i32 = self._b64.host, self._b32.host

    def wait_free(self) -> None:
        self._b64.wait_free()
        self._b32.wait_free()

    def upload(self, d64: torch.Tensor, d32: torch.Tensor, end32: int) -> None:
        """d64 ← i64 and d32[:end32] ← i32[:end32] by kernels reading this pinned copy (kernels/host_copy:
        a copy engine would queue them behind the adapter copies in flight)."""
        self._b64.upload(d64)
        self._b32.upload(d32[:end32], end32)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        lora: LoraBackend | None,
        *,
        max_batch: int,
        max_model_len: int,
        capture: bool,
        ring: int = 3,
    ):
        """`lora`: the Triton backend, or None when batches with adapters must run eagerly. The model
        must attend with the Triton kernel: the torch loop depends on each batch's extents."""
        if model.attention_backend != "triton":
            raise ValueError("decode graphs need the Triton attention backend")
        cfg = model.cfg
        self.model, self.kv, self.lora = model, kv, lora
        self.device = kv.k.device
        self.capture = capture
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.block_m = decode_block_m(cfg.num_heads // cfg.num_kv_heads)
        self.blocks_per_seq = -(-(cfg.num_heads // cfg.num_kv_heads) // self.block_m)
        self.max_batch = max_batch
        self.max_pages = -(-max_model_len // kv.page_size)  # page-table width
        self.buckets = batch_buckets(max_batch)
        self._init_buffers(cfg.vocab_size, ring)
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # shared with the step graphs
        self.capture_seconds = 0.0
        self.replays = 0

    def _init_buffers(self, vocab: int, ring: int) -> None:
        mb, dev = self.max_batch, self.device
        self._meta_len = mb * self.blocks_per_seq * META_COLS
        n64, n32 = 3 * mb, self._meta_len + mb * self.max_pages
        self._i64 = torch.zeros(n64, dtype=torch.int64, device=dev)  # ids | positions | KV rows
        self._i32 = torch.zeros(n32, dtype=torch.int32, device=dev)  # attention blocks | page table
        self.ids, self.positions, self.rows = self._i64.view(3, mb).unbind(0)
        self.attn_meta = self._i32[: self._meta_len].view(-1, META_COLS)
        self.page_table = self._i32[self._meta_len :].view(mb, self.max_pages)
        self.logits_indices = torch.arange(mb, dtype=torch.int64, device=dev)
        self.out = torch.empty((mb, vocab), dtype=torch.float32, device=dev)  # every graph's logits
        pin = dev.type == "cuda"
        self._ring = [HostStaging(n64, n32, pin) for _ in range(ring)]
        self._next = 0

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def supports(self, seqs: Sequence[DecodeSeq]) -> bool:
        """True for 1..max_batch sequences of one new token each within the page table's reach, and
        (without a graph-safe LoRA backend) no adapters."""
        if not 0 < len(seqs) <= self.max_batch:
            return False
        reach = self.max_pages * self.kv.page_size
        for s in seqs:
            if len(s.token_ids) != 1 or s.start_pos >= reach or (s.slot >= 0 and self.lora is None):
                return False
        return True

    @torch.inference_mode()
    def run(self, seqs: Sequence[DecodeSeq], pending: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(seqs), V] float32 (a view of a buffer the next run overwrites). Sequences sharing
        an adapter slot must be adjacent. `pending`: what placeholder ids stand for (fill_pending)."""
        padded = self.bucket(len(seqs))
        key = self._stage(seqs, padded)
        fill_pending(self.ids[:padded], pending)
        if not self.capture:
            self._forward(key)
        else:
            graph = self.graphs.get(key)
            if graph is None:
                graph = self._capture(key)
            graph.replay()
            self.replays += 1
        return self.out[: len(seqs)]

    def capture_all(self) -> int:
        """Capture every bucket's graphs ahead of serving (largest first, so the pool's memory is reused).
        Returns graphs captured."""
        before = len(self.graphs)
        for key in self.graph_keys():
            if key not in self.graphs:
                padded, s, lora = key
                self._stage([], padded, splits=s, lora_class=lora)  # all padding: touches only scratch
                self._capture(key)
        return len(self.graphs) - before

    def dry_run(self) -> None:
        """Stage and run each graph's batch eagerly once, capturing nothing (see StepGraphs.dry_run)."""
        for key in self.graph_keys():
            padded, s, lora = key
            self._stage([], padded, splits=s, lora_class=lora)
            self._forward(key)

    def graph_keys(self) -> list[tuple[int, int, int]]:
        """(bucket, key splits, LoRA tile class or 0) of every graph a batch can need, largest bucket
        first: each split count a context up to max_model_len can choose, each tile class of the bucket."""
        keys = split_key_counts(self.max_pages * self.kv.page_size)
        out = []
        for padded in reversed(self.buckets):
            blocks = padded * self.blocks_per_seq
            splits = {choose_splits(blocks, self.num_kv_heads, n, self.device) for n in keys}
            loras = (0, *self.lora.tile_classes(padded)) if self.lora is not None else (0,)
            out.extend((padded, s, lora) for s in sorted(splits) for lora in loras)
        return out

    def _stage(
        self, seqs: Sequence[DecodeSeq], padded: int, splits: int | None = None, lora_class: int | None = None
    ) -> tuple[int, int, int]:
        """Write the batch into the next staging buffer, upload it, prepare the LoRA metadata; returns the
        graph key. `splits`/`lora_class` force the key (warm-up capture of an all-padding batch)."""
        n, mb, ps = len(seqs), self.max_batch, self.kv.page_size
        st = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        st.wait_free()
        h64 = st.i64.numpy().reshape(3, mb)
        h32 = st.i32.numpy()
        table = h32[self._meta_len :].reshape(mb, self.max_pages)
        ctx = np.empty(n, dtype=np.int64)
        for i, s in enumerate(seqs):
            p = s.start_pos
            h64[0, i], h64[1, i], ctx[i] = s.token_ids[0], p, p + 1
            h64[2, i] = s.page_ids[p // ps] * ps + p % ps
            used = p // ps + 1
            table[i, :used] = s.page_ids[:used]
        # Padding tokens are one-token sequences on the scratch page: each writes its K/V there and
        # attends to it, so every row of the step (attention output, hidden state, K/V of later layers)
        # is computed. Without an attention block, a padding row's attention output was whatever the
        # fresh buffer held, and NaN from it reached the scratch page through the next layers.
        h64[0, n:padded], h64[1, n:padded], h64[2, n:padded] = 0, 0, self.kv.scratch_row
        table[n:padded, 0] = self.kv.num_pages  # the scratch page
        ctx = np.concatenate([ctx, np.ones(padded - n, dtype=np.int64)])
        meta, _, most_keys = plan_blocks(
            np.arange(padded), np.ones(padded, dtype=np.int64), ctx,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, block_m=self.block_m,
        )  # fmt: skip
        blocks = padded * self.blocks_per_seq
        assert meta.shape[0] == blocks, (meta.shape, blocks)
        h32[: blocks * META_COLS] = meta.reshape(-1)
        if splits is None:
            splits = choose_splits(blocks, self.num_kv_heads, most_keys, self.device)
        st.upload(self._i64, self._i32, self._meta_len + padded * self.max_pages)
        # the forced class, else that of this batch's own tiles; 0 without adapters
        want = lora_class if lora_class is not None else "auto" if any(s.slot >= 0 for s in seqs) else 0
        if not want:
            return padded, splits, 0
        self.lora.prepare(*slot_segments(seqs), pad_to=padded, tile_class=want)
        return padded, splits, self.lora.tile_class

    def _forward(self, key: tuple[int, int, int]) -> None:
        padded, splits, lora_class = key
        plan = AttentionPlan(
            meta=self.attn_meta[: padded * self.blocks_per_seq],
            num_tokens=padded,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            block_m=self.block_m,
            num_splits=splits,
        )
        fb = ForwardBatch(
            input_ids=self.ids[:padded],
            positions=self.positions[:padded],
            kv_rows=self.rows[:padded],
            page_table=self.page_table[:padded],
            logits_indices=self.logits_indices[:padded],
            seqs=(),  # the attention kernel reads the plan below, never the extents
            attn_plan=plan,
        )
        self.out[:padded].copy_(self.model.forward(fb, self.kv, self.lora if lora_class else None))

    def _capture(self, key: tuple[int, int, int]) -> torch.cuda.CUDAGraph:
        """Run the staged batch once eagerly (compiles kernels; its results equal the replay's), then
        record it (`graph_capture.recording`)."""
        start = time.perf_counter()
        self._forward(key)
        graph = torch.cuda.CUDAGraph()
        with recording(graph, self.pool):
            self._forward(key)
        self.graphs[key] = graph
        self.capture_seconds += time.perf_counter() - start
        return graph
