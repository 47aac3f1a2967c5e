"""Steps with prefill tokens (any mix of prefill chunks and decodes, up to --cuda-graph-max-tokens
tokens) replayed as CUDA graphs per token-count bucket, in the manner of vLLM V1's piecewise graphs.

A step of T tokens runs padded to the next bucket Tp with fixed-shape inputs in fixed device buffers
(`step_inputs.py`); the LoRA kernels' grids are sized for the bucket and stop at the tile count in
their device metadata, so one graph serves every adapter mix. Two modes:
- full: the whole forward is one graph per (Tp, attention key splits, adapters present). The Triton
  attention kernel reads its block plan from a device buffer; its grid is the bucket's block capacity,
  the rows past the step's own blocks empty (they return at once).
- piecewise (attention that reads each batch's extents on the host, the torch loop): per layer, the
  parts around attention (norms, QKV/O/MLP linears with LoRA, rotary, K/V write, residuals) are graph
  pieces, and attention runs eagerly between them over the real (padded) batch.
Graphs share one memory pool with the decode graphs (captured largest first, so every capture reuses
the largest's memory). Without capture (CPU, tests) the same padded forward runs eagerly.

A step whose adapter is still being copied layer by layer (an overlapped pool load) waits before each
layer for that layer's rows. Piecewise, the host makes those waits between pieces. Full graphs, with
`gated`, get a second graph per LoRA key whose layer i first waits on gate i, an external CUDA event:
`_arm` records gate i on a side stream once the step's layer-i copies are done, and the replay waits on
that record (a graph's wait node waits for the event's last record before the launch, as measured on an
H100). A wait node costs about 5 us of host launch and of device
time even when its event is complete, so steps without such copies replay the ungated graphs."""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import torch

from kernels.paged_attention import AttentionPlan, choose_splits, split_key_counts
from stages.worker.decode_graphs import DecodeSeq
from stages.worker.graph_capture import recording
from stages.worker.lora.backend import PADDED_BLOCK_M, LoraBackend, slot_segments
from stages.worker.model.forward_batch import ForwardBatch
from stages.worker.model.kv_cache import KVCache
from stages.worker.model.llama import LlamaModel
from stages.worker.seq_input import fill_pending
from stages.worker.step_inputs import StagedStep, StepInputs, token_buckets


class StepGraphs:
    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        lora: LoraBackend | None,
        *,
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        piecewise: bool,
        capture: bool,
        pool: tuple | None = None,
        gated: bool = False,
    ):
        """`lora`: a graph-safe backend (Triton), or None when steps with adapters must run eagerly.
        `piecewise`: attention runs eagerly between graph pieces (required unless the model attends with
        the Triton kernel). `pool`: a graph memory pool to share (the decode graphs'). `gated`: full
        graphs with adapters get layer-gated twins, for steps on adapters still copying layer by layer
        (without them such steps run eagerly; piecewise steps wait between pieces either way)."""
        if not piecewise and model.attention_backend != "triton":
            raise ValueError("full step graphs need the Triton attention backend; use piecewise")
        cfg = model.cfg
        self.model, self.kv, self.lora = model, kv, lora
        self.device = kv.k.device
        self.piecewise, self.capture = piecewise, capture
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.num_layers = cfg.num_layers
        self.max_keys = -(-max_model_len // kv.page_size) * kv.page_size  # the page table's reach
        self.inputs = StepInputs(
            kv, max_tokens=max_tokens, max_seqs=max_seqs, max_pages=self.max_keys // kv.page_size,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        )  # fmt: skip
        self.buckets = token_buckets(max_tokens)
        dev, dtype, mt = self.device, model.w.embed.dtype, max_tokens
        self.out = torch.empty((self.inputs.out_rows(mt), cfg.vocab_size), dtype=torch.float32, device=dev)
        if piecewise:  # what crosses from one piece to the next, at fixed addresses
            self.h = torch.zeros((mt, cfg.hidden_size), dtype=dtype, device=dev)  # [T, H]
            self.q = torch.zeros((mt, cfg.num_heads, cfg.head_dim), dtype=dtype, device=dev)  # [T, heads, D]
            self.attn = torch.zeros((mt, cfg.num_heads * cfg.head_dim), dtype=dtype, device=dev)
            self.cos = torch.zeros((mt, 1, cfg.head_dim), dtype=dtype, device=dev)  # [T, 1, D]
            self.sin = torch.zeros((mt, 1, cfg.head_dim), dtype=dtype, device=dev)
        self.full: dict[tuple[int, int, bool, bool], torch.cuda.CUDAGraph] = {}
        self.pieces: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self.capture_seconds = 0.0
        self.runs = 0  # steps run on this path (replayed or, without capture, eager)
        self.replays = 0
        self.gated_runs = 0  # of them, steps that waited layer by layer for adapter copies
        self.gates: list[torch.cuda.Event] = []
        if gated and capture and not piecewise and lora is not None:
            self.gate_stream = torch.cuda.Stream(self.device)
            self.gates = [torch.cuda.Event(external=True) for _ in range(self.num_layers)]
            for gate in self.gates:  # created now: a wait on a never-recorded event is left out of a capture
                gate.record(self.gate_stream)

    @property
    def num_graphs(self) -> int:
        return len(self.full) + sum(len(p) for p in self.pieces.values())

    @property
    def num_gated(self) -> int:
        """Of them, the layer-gated full graphs."""
        return sum(key[3] for key in self.full)

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def padded_lora_configs(self) -> tuple[tuple[int, int], ...]:
        """(padded tokens, LoRA token tile) of every bucket whose graphs run LoRA kernels."""
        return tuple((b, PADDED_BLOCK_M) for b in self.buckets) if self.lora is not None else ()

    def supports(self, seqs: Sequence[DecodeSeq], layered: bool = False) -> bool:
        """True for 1..max_seqs sequences of together at most max_tokens tokens within the page table's
        reach, and (without a graph-safe LoRA backend) no adapters. `layered`: the step waits for adapter
        copies layer by layer, which full graphs can only do with gates."""
        if not 0 < len(seqs) <= self.max_seqs:
            return False
        if layered and self.capture and not self.piecewise and not self.gates:
            return False
        total = 0
        for s in seqs:
            n = len(s.token_ids)
            total += n
            if n < 1 or s.start_pos + n > self.max_keys or (s.slot >= 0 and self.lora is None):
                return False
        return total <= self.max_tokens

    @torch.inference_mode()
    def run(
        self,
        seqs: Sequence[DecodeSeq],
        pending: torch.Tensor | None = None,
        layer_waits: Sequence[Sequence[torch.cuda.Event]] | None = None,
    ) -> torch.Tensor:
        """Logits [len(seqs), V] float32 (a view of a buffer the next run overwrites). Sequences sharing
        an adapter must be adjacent. `pending`: what placeholder ids stand for (fill_pending).
        `layer_waits[i]`: events layer i waits on (copies in flight; `supports(seqs, layered=True)`)."""
        padded = self.bucket(sum(len(s.token_ids) for s in seqs))
        step = self.inputs.stage(seqs, padded)
        fill_pending(self.inputs.ids[:padded], pending)
        has_lora = any(s.slot >= 0 for s in seqs)
        if has_lora:
            self.lora.prepare(*slot_segments(seqs), pad_to=padded, block_m=PADDED_BLOCK_M)
        gated = layer_waits is not None
        if self.piecewise:
            self._run_pieces(step, has_lora, layer_waits)
        else:
            key = (padded, self._splits(step), has_lora, gated and self.capture)
            if key[3]:
                self._arm(layer_waits)
            graph = self.full.get(key) if self.capture else None
            if graph is None and self.capture:
                graph = self._capture_full(key)
            if graph is None:
                self._forward_full(key, layer_waits)
            else:
                graph.replay()
        self.runs += 1
        self.gated_runs += gated
        if self.capture:
            self.replays += 1
        return self.out[: len(seqs)]

    def capture_all(self) -> int:
        """Capture every bucket's graphs ahead of serving, largest first (later captures reuse the pool's
        memory). Returns graphs captured."""
        before = self.num_graphs
        for key in self.graph_keys():
            padded, _, has_lora, _ = key
            if self.piecewise:
                if (padded, has_lora) not in self.pieces:
                    self._capture_pieces(self._stage_padding(padded, has_lora), has_lora)
            elif key not in self.full:
                self._stage_padding(padded, has_lora)
                self._capture_full(key)
        return self.num_graphs - before

    def dry_run(self) -> None:
        """Stage and run each graph's step eagerly once, capturing nothing. Under the compile pool's
        `recording()` (the warm-up) this lists the kernel specializations capture will launch, so the
        pool compiles them with the rest rather than capture one by one; the launches are skipped."""
        for padded, splits, has_lora, gated in self.graph_keys():
            if gated:
                continue  # its twin's launches, behind waits
            step = self._stage_padding(padded, has_lora)
            if self.piecewise:
                self._run_pieces(step, has_lora)
            else:
                self._forward_full((padded, splits, has_lora, False))

    def graph_keys(self) -> list[tuple[int, int, bool, bool]]:
        """(bucket, key splits, adapters present, layer-gated) of every graph a step can need, largest
        bucket first: in full mode each split count a context up to the page table's reach can choose
        (piecewise graphs hold no attention: splits 0), and with gates a gated twin of each LoRA key."""
        kvh = self.model.cfg.num_kv_heads
        keys = split_key_counts(self.max_keys)
        out = []
        for padded in reversed(self.buckets):
            for has_lora in (False, True) if self.lora is not None else (False,):
                if self.piecewise:
                    out.append((padded, 0, has_lora, False))
                    continue
                cap = self.inputs.block_capacity(padded)
                splits = sorted({choose_splits(cap, kvh, n, self.device) for n in keys})
                for gated in (False, True) if has_lora and self.gates else (False,):
                    out.extend((padded, s, has_lora, gated) for s in splits)
        return out

    def _arm(self, layer_waits: Sequence[Sequence[torch.cuda.Event]]) -> None:
        """Record gate i on the gate stream once the copies of `layer_waits[i]` are done (in layer order,
        so gate i also follows every earlier layer's copies). The replay launched next waits on these."""
        stream = self.gate_stream
        for gate, events in zip(self.gates, layer_waits, strict=True):
            for event in events:
                stream.wait_event(event)
            gate.record(stream)

    def _stage_padding(self, padded: int, has_lora: bool) -> StagedStep:
        """An all-padding step (it touches only the scratch page), for capture."""
        step = self.inputs.stage([], padded)
        if has_lora:
            self.lora.prepare([0], [], pad_to=padded, block_m=PADDED_BLOCK_M)
        return step

    def _splits(self, step: StagedStep) -> int:
        cap = self.inputs.block_capacity(step.padded)
        return choose_splits(cap, self.model.cfg.num_kv_heads, step.most_keys, self.device)

    def _batch(self, padded: int, rows: int, plan: AttentionPlan | None, extents=()) -> ForwardBatch:
        inp = self.inputs
        return ForwardBatch(
            input_ids=inp.ids[:padded],
            positions=inp.positions[:padded],
            kv_rows=inp.rows[:padded],
            page_table=inp.page_table[:rows],
            logits_indices=inp.logits_indices[: inp.out_rows(padded)],
            seqs=tuple(extents),
            attn_plan=plan,
        )

    def _plan(self, padded: int, num_blocks: int, splits: int) -> AttentionPlan:
        cfg = self.model.cfg
        return AttentionPlan(
            meta=self.inputs.attn_meta[:num_blocks],
            num_tokens=padded,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            block_m=self.inputs.block_m(padded),
            num_splits=splits,
        )

    def _forward_full(self, key: tuple[int, int, bool, bool], layer_waits=None) -> None:
        """The padded forward of `key`; a gated key waits on the gates (what its graph captures), an
        uncaptured step on its own `layer_waits`."""
        padded, splits, has_lora, gated = key
        inp = self.inputs
        plan = self._plan(padded, inp.block_capacity(padded), splits)
        fb = self._batch(padded, inp.table_rows(padded), plan)
        waits = [[gate] for gate in self.gates] if gated else layer_waits
        logits = self.model.forward(fb, self.kv, self.lora if has_lora else None, waits)
        self.out[: inp.out_rows(padded)].copy_(logits)

    def _piece(self, i: int, padded: int, has_lora: bool) -> None:
        """Piece i: the embedding (i = 0) or layer i-1 after attention, then layer i up to attention (the
        last piece: the final norm and logits)."""
        m, inp, lora = self.model, self.inputs, self.lora if has_lora else None
        if i == 0:
            h, cos, sin = m.embed(inp.ids[:padded], inp.positions[:padded])
            self.cos[:padded].copy_(cos)
            self.sin[:padded].copy_(sin)
        else:
            h = m.post_attention(i - 1, self.h[:padded], self.attn[:padded], lora)
        if i < self.num_layers:
            cos, sin = self.cos[:padded], self.sin[:padded]
            self.q[:padded].copy_(m.pre_attention(i, h, inp.rows[:padded], self.kv, lora, cos, sin))
            self.h[:padded].copy_(h)
        else:
            rows = inp.out_rows(padded)
            self.out[:rows].copy_(m.logits(h, inp.logits_indices[:rows]))

    def _attend(self, i: int, step: StagedStep) -> None:
        """Layer i's attention, eagerly, with the plan of the step's own sequences (padding included)."""
        m, t = self.model, step.padded
        plan = None
        if m.attention_backend == "triton":
            splits = choose_splits(step.num_blocks, m.cfg.num_kv_heads, step.most_keys, self.device)
            plan = self._plan(t, step.num_blocks, splits)
        fb = self._batch(t, len(step.extents), plan, step.extents)
        self.attn[:t].copy_(m.attend(self.q[:t], self.kv, i, fb, m.scale, m.cfg.sliding_window))

    def _run_pieces(self, step: StagedStep, has_lora: bool, layer_waits=None) -> None:
        """The pieces in order, attention between them; piece i (whose second half is layer i up to
        attention) starts after `layer_waits[i]`."""
        graphs = self.pieces.get((step.padded, has_lora)) if self.capture else None
        stream = torch.cuda.current_stream(self.device) if layer_waits else None
        if graphs is None and self.capture:
            for event in (e for events in layer_waits or () for e in events):
                stream.wait_event(event)  # every layer's copy before the capture's eager pass
            self._capture_pieces(step, has_lora)  # computes this step too
            return
        for i in range(self.num_layers + 1):
            if stream is not None and i < self.num_layers:
                for event in layer_waits[i]:
                    stream.wait_event(event)
            if graphs is None:
                self._piece(i, step.padded, has_lora)
            else:
                graphs[i].replay()
            if i < self.num_layers:
                self._attend(i, step)

    def _capture_full(self, key: tuple[int, int, bool, bool]) -> torch.cuda.CUDAGraph:
        """Run the staged step once eagerly (compiles kernels; its results equal the replay's), then
        record it (`graph_capture.recording`)."""
        start = time.perf_counter()
        self._forward_full(key)
        graph = torch.cuda.CUDAGraph()
        with recording(graph, self.pool):
            self._forward_full(key)
        self.full[key] = graph
        self.capture_seconds += time.perf_counter() - start
        return graph

    def _capture_pieces(self, step: StagedStep, has_lora: bool) -> None:
        """Run the staged step eagerly, piece by piece (its results are the step's), then record each
        piece (recording computes nothing, so the buffers keep the eager results)."""
        start = time.perf_counter()
        for i in range(self.num_layers + 1):
            self._piece(i, step.padded, has_lora)
            if i < self.num_layers:
                self._attend(i, step)
        graphs = []
        for i in range(self.num_layers + 1):
            graph = torch.cuda.CUDAGraph()
            with recording(graph, self.pool):
                self._piece(i, step.padded, has_lora)
            graphs.append(graph)
        self.pieces[step.padded, has_lora] = graphs
        self.capture_seconds += time.perf_counter() - start
