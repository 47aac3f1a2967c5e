"""The worker's model runner: owns base weights, the GPU adapter pool and the KV cache, and turns a list
of per-sequence inputs into one forward pass (tokens grouped by adapter id) and its last-token logits."""

from __future__ import annotations

import time

import torch

from kernels.host_copy import IndexUploads
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig, parse_dtype
from runtime.common.packed import PackedAdapter
from runtime.common.quant_config import check_quantization
from stages.worker.decode_graphs import DecodeGraphs
from stages.worker.graph_capture import graph_pool_bytes
from stages.worker.lora.backend import slot_segments
from stages.worker.lora.factory import make_backend
from stages.worker.lora.pool import LoraPool, Runs, default_pool_bytes, pool_geometry
from stages.worker.model.attention import plan_for, resolve_backend
from stages.worker.model.forward_batch import ForwardBatch, SeqExtent
from stages.worker.model.kv_cache import KVCache, pages_that_fit
from stages.worker.model.linear import check_fp8_device
from stages.worker.model.llama import LlamaModel
from stages.worker.model.pointwise import resolve_pointwise
from stages.worker.model.weights import load_weights
from stages.worker.runner_config import RunnerConfig
from stages.worker.seq_input import SeqInput, fill_pending
from stages.worker.startup import Phases
from stages.worker.step_graphs import StepGraphs
from stages.worker.tp.group import TPGroup
from stages.worker.tp.lora_shard import AdapterSharder
from stages.worker.tp.shard import shard_config, shard_weights, to_device
from stages.worker.tp.transform import tensor_parallel
from stages.worker.warm_marker import WarmMarker
from stages.worker.warmup import Report, start_compiling, warm_up

__all__ = ["ModelRunner", "RunnerConfig", "SeqInput"]


def whole_copy_waits(layer_waits: list[list] | None) -> list | None:
    """The events of `layer_waits` when all of them are due before layer 0 (copies without per-layer
    events): the stream can wait on them before the step, graphed or not. None otherwise."""
    if layer_waits is None or not layer_waits[0] or any(layer_waits[1:]):
        return None  # nothing before layer 0, or per-layer waits
    return layer_waits[0]


def inverse_of(order: list[int]) -> list[int]:
    """The permutation that undoes `order`: inverse[order[j]] = j."""
    inverse = [0] * len(order)
    for pos, i in enumerate(order):
        inverse[i] = pos
    return inverse


class ModelRunner:
    def __init__(self, cfg: RunnerConfig, model_cfg: ModelConfig | None = None, tp: TPGroup | None = None,
                 on_warmup: Report | None = None):  # fmt: skip
        """`model_cfg`: the model's config.json as the caller already parsed it (else read here). `tp`:
        this process is one rank of a tensor-parallel group; it holds that rank's shard of the weights,
        KV heads and adapter pool (`model_cfg` is then the rank's view, `full_cfg` the model's).
        `on_warmup`: hears the warm-up's progress (steps done, total)."""
        # what each part of the start-up took (the worker logs it at ready); together they are the
        # constructor's whole wall time
        self.phases = Phases()
        init_start = time.perf_counter()
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.tp = tp
        self.model_cfg = model_cfg if model_cfg is not None else ModelConfig.from_dir(cfg.model_dir)
        self.full_cfg = self.model_cfg
        if cfg.max_model_len is not None and cfg.max_model_len > self.model_cfg.max_position_embeddings:
            # the rotary tables hold max_position_embeddings positions; past them a gather reads out of bounds
            raise ValueError(
                f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.model_cfg.max_position_embeddings}"
            )
        self.dtype = parse_dtype(cfg.dtype, self.model_cfg.dtype)
        self.attention_backend = resolve_backend(cfg.attention_backend, self.device)
        self.pointwise_backend = resolve_pointwise(cfg.pointwise_backend, self.device)
        self.phases.add("runner init", time.perf_counter() - init_start)  # the config, the backends
        # gather indices of a step's logits rows, uploaded without queueing behind adapter copies (the
        # process's first device memory: torch's CUDA state is set up here)
        self.phases.run("device init", self._init_index_uploads)
        # whether the compile cache holds every kernel of this start-up already (then no compile pool)
        cuda_warmup = cfg.warmup and self.device.type == "cuda"
        mark = time.perf_counter()
        marker = WarmMarker(cfg, self.model_cfg, self.device) if cuda_warmup else None
        # the pool's processes start while the weights load
        compile_pool = start_compiling(self.device, cfg.warmup, marker)
        self.phases.add("compile cache setup", time.perf_counter() - mark)  # Triton's driver, namespace
        try:
            inits = (self._init_model, self._init_lora, self._init_kv_cache, self._init_graphs)
            for name, init in zip(("weights", "adapter pool", "KV cache", "graph setup"), inits, strict=True):
                self.phases.run(name, init)
            if cfg.warmup:
                self.warmup = self.phases.run(
                    "warm-up", warm_up, self, pool=compile_pool, report=on_warmup, marker=marker
                )
        finally:
            if compile_pool is not None:
                self.phases.run("compile pool exit", compile_pool.close)
        self.capture_compiled: list[str] = []  # kernels capture compiled (the warm-up plan should hold them)
        self.phases.run("graph capture", self._capture_graphs)
        if marker is not None and self.warmup.plan:
            clean = not self.warmup.compiled_here and not self.capture_compiled
            self.phases.run("cache marker", marker.settle, self.warmup.plan, clean)

    def _init_index_uploads(self) -> None:
        self.index_uploads = IndexUploads(self.max_seqs, self.device)

    def _init_model(self) -> None:
        # `host_layout`: how the loader packs adapters (the whole model's); `lora_layout`: this pool's
        self.host_layout = LoraLayout.for_model(self.full_cfg, self.cfg.max_lora_rank)
        self.shard_adapter = None
        quantize = check_quantization(self.cfg.quantization) == "fp8"
        if quantize or self.model_cfg.quantization is not None:
            check_fp8_device(self.device, self.dtype)
        if self.tp is None:
            weights = load_weights(self.cfg.model_dir, self.model_cfg, self.dtype, self.device, quantize)
        else:  # read on the host, then only this rank's shard goes to the device
            tp = self.tp
            cpu = torch.device("cpu")
            whole = load_weights(self.cfg.model_dir, self.full_cfg, self.dtype, cpu, quantize)
            weights = to_device(shard_weights(whole, self.full_cfg, tp.rank, tp.size), self.device)
            del whole
            self.model_cfg = shard_config(self.full_cfg, tp.size)
        self.lora_layout = LoraLayout.for_model(self.model_cfg, self.cfg.max_lora_rank)
        self.model = LlamaModel(
            self.model_cfg, weights, self.lora_layout, self.attention_backend, self.pointwise_backend
        )
        if self.tp is not None:
            tensor_parallel(self.model, self.tp)
            self.shard_adapter = AdapterSharder(
                self.host_layout, self.lora_layout, self.tp.rank, self.tp.size, self.device, self.dtype
            )

    def _init_lora(self) -> None:
        """The adapter pool, sized before the KV cache (which takes what is left)."""
        gb, lora_dtype = self.cfg.lora_gpu_memory_gb, self.cfg.lora_dtype  # LoraPool checks lora_dtype
        nbytes = (
            int(gb * 2**30)
            if gb is not None
            else default_pool_bytes(self.lora_layout, self.dtype, self.device, lora_dtype)
        )
        rows, ids = pool_geometry(self.lora_layout, self.dtype, nbytes, lora_dtype)
        if self.tp is not None:  # every rank holds the same rank rows and ids
            rows, ids = self.tp.min_int(rows), self.tp.min_int(ids)
        self.pool = LoraPool(self.lora_layout, rows, ids, self.dtype, self.device, lora_dtype)
        name = self.cfg.lora_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.lora = make_backend(name, self.pool, self.cfg.max_tokens_per_step, self.max_seqs)

    def _init_kv_cache(self) -> None:
        m, ps = self.model_cfg, self.cfg.page_size
        per_page = KVCache.bytes_per_page(
            num_layers=m.num_layers,
            page_size=ps,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=self.dtype,
        )
        num_pages = self.cfg.num_pages
        if num_pages is None and self.device.type == "cuda":
            # Kept out: a full step's activations (a generous 64 KiB per token); the decode graphs' shared
            # logits buffer plus their pool's logits of the largest bucket; the step graphs' pool, which
            # holds the largest bucket's activations and logits as well.
            tokens, vocab = self.graph_tokens, self.model_cfg.vocab_size
            logits_rows = self.cfg.cuda_graph_max_batch + min(tokens, self.max_seqs)
            reserve = (self.cfg.max_tokens_per_step + tokens) * 65536 + logits_rows * vocab * (4 + 4 + 2)
            num_pages = pages_that_fit(self.device, per_page, self.cfg.gpu_memory_utilization, reserve)
        elif num_pages is None:
            num_pages = (self.cfg.cpu_kv_tokens + ps - 1) // ps
        if self.tp is not None:  # every rank holds the same pages (of its own KV heads)
            num_pages = self.tp.min_int(num_pages)
        if num_pages < 1:
            raise RuntimeError("no memory left for the KV cache")
        self.kv = KVCache(
            num_layers=m.num_layers,
            num_pages=num_pages,
            page_size=ps,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def _init_graphs(self) -> None:
        """Decode graphs and step graphs (CUDA only), sharing one memory pool; the constructor captures
        them all (after the warm-up) so that serving never pauses to capture."""
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        self.graph_memory_bytes = 0
        if self.device.type != "cuda":
            return
        lora = self.lora if self.lora.name == "triton" else None  # the torch backend reads host ranks
        # the torch attention loop depends on each batch's extents: no decode graphs, piecewise steps
        triton_attention = self.attention_backend == "triton"
        if self.cfg.cuda_graph_max_batch > 0 and triton_attention:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv,
                lora,
                max_batch=self.cfg.cuda_graph_max_batch,
                max_model_len=self.max_context,
                capture=True,
            )
        if self.graph_tokens > 0:
            self.step_graphs = StepGraphs(
                self.model,
                self.kv,
                lora,
                max_tokens=self.graph_tokens,
                max_seqs=self.max_seqs,
                max_model_len=self.max_context,
                piecewise=not triton_attention,
                capture=True,
                pool=self.graphs.pool if self.graphs is not None else None,
                gated=self.layered_loads,
            )

    def _capture_graphs(self) -> None:
        """Step graphs first (the largest buckets), then decode graphs, into the shared pool; the memory
        it took is kept for the log. The allocator's cache is emptied once before them (what the warm-up
        left cached goes back, so the pool has the room the KV cache's sizing kept), and no capture waits
        for the device (`graph_capture.recording`): what stays cached is at most the eager run of the
        largest bucket, captured first, which that sizing keeps room for beside the graph pool."""
        if self.graphs is None and self.step_graphs is None:
            return
        from stages.worker.compile_pool import counting_compiles

        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        with torch.inference_mode(), counting_compiles(self.capture_compiled):
            if self.step_graphs is not None:
                self.step_graphs.capture_all()
            if self.graphs is not None:
                self.graphs.capture_all()
        torch.cuda.synchronize(self.device)
        pool = self.graphs.pool if self.graphs is not None else self.step_graphs.pool
        self.graph_memory_bytes = graph_pool_bytes(pool)

    @property
    def layered_loads(self) -> bool:
        """Whether an adapter of the pool's largest rank is copied layer by layer when overlapped."""
        least, layout = self.cfg.layered_min_bytes, self.pool.layout
        return least is not None and layout.block_bytes(layout.max_rank, self.dtype) >= least

    @property
    def graph_tokens(self) -> int:
        """Largest step (tokens) the step graphs replay: 0 without them."""
        if self.device.type != "cuda":
            return 0
        return max(0, min(self.cfg.cuda_graph_max_tokens, self.cfg.max_tokens_per_step))

    @property
    def max_context(self) -> int:
        """Longest sequence a step can see: max_model_len (else the model's), capped by the KV cache."""
        max_len = self.cfg.max_model_len or self.model_cfg.max_position_embeddings
        return min(max_len, self.kv.num_pages * self.kv.page_size)

    @property
    def max_seqs(self) -> int:
        return self.cfg.max_running_requests

    def graphs_sizes(self) -> tuple[int | tuple[int, int], ...]:
        """Padded batches of the graphs that run LoRA kernels: decode batch sizes (decode token tile),
        then (tokens, LoRA token tile) of the step graphs' buckets; none without graphs."""
        graphs, steps = self.graphs, self.step_graphs
        sizes: tuple[int | tuple[int, int], ...] = ()
        if graphs is not None and graphs.lora is not None:
            sizes += tuple(graphs.buckets)
        if steps is not None:
            sizes += steps.padded_lora_configs()
        return sizes

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

    def load_adapter(
        self,
        lora_id: int,
        adapter: PackedAdapter,
        runs: Runs,
        stream: torch.cuda.Stream | None = None,
        layer_events: bool = False,
    ) -> list[torch.cuda.Event] | None:
        """Copy `adapter` (packed in `host_layout`, as the loader packs it) into the pool; a
        tensor-parallel rank copies its own shard of it. `layer_events` is honoured only where the config
        allows layered copies (`layered_min_bytes`): a tensor-parallel rank 0 turns them off, since a
        step waiting on per-layer copies would take another path than its other ranks."""
        if self.shard_adapter is not None:
            adapter = self.shard_adapter(adapter, stream)
        layer_events = layer_events and self.cfg.layered_min_bytes is not None
        return self.pool.load(lora_id, adapter, runs, stream, layer_events)

    @torch.inference_mode()
    def execute(
        self,
        seqs: list[SeqInput],
        layer_waits: list[list] | None = None,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(seqs), V] float32, row i for seqs[i] (`execute_grouped`, its rows put back in
        the order of `seqs`)."""
        logits, order = self.execute_grouped(seqs, layer_waits, pending)
        if order is None:
            return logits
        return logits[self.index_uploads(inverse_of(order))]

    @torch.inference_mode()
    def execute_grouped(
        self,
        seqs: list[SeqInput],
        layer_waits: list[list] | None = None,
        pending: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[int] | None]:
        """Logits [len(seqs), V] float32 with each adapter's sequences together, as the forward ran
        them, and that order: row j is for seqs[order[j]] (order None: row i is for seqs[i]). Putting
        the rows back would be a gather of [B, V] (about 1 % of the device time of a many-adapter mix on
        an H100); the executor samples the rows where they are instead.
        `layer_waits[i]`: events the compute stream waits on before layer i (slot copies still in
        flight). Whole-copy waits (all before layer 0) are made on the stream, and the step may replay a
        graph; per-layer waits replay a step graph that waits between layers (piecewise, or full with
        gates), else the step runs eagerly.
        `pending`: [B] device tokens of the step still in flight, which placeholder ids (-1 - row) in
        `seqs` stand for (seq_input.fill_pending)."""
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)  # each adapter's tokens contiguous
        ordered = [seqs[i] for i in order]
        before = whole_copy_waits(layer_waits)
        if before is not None:
            stream = torch.cuda.current_stream(self.device)
            for event in before:
                stream.wait_event(event)  # a replayed graph starts after them, in stream order
            layer_waits = None
        layered = layer_waits is not None
        if not layered and self.graphs is not None and self.graphs.supports(ordered):
            logits = self.graphs.run(ordered, pending)  # [B, V] in `order`
        elif self.step_graphs is not None and self.step_graphs.supports(ordered, layered):
            logits = self.step_graphs.run(ordered, pending, layer_waits)
        else:
            logits = self._forward_eager(ordered, layer_waits, pending)
        return logits, None if all(i == pos for pos, i in enumerate(order)) else order

    def _forward_eager(
        self, seqs: list[SeqInput], layer_waits=None, pending: torch.Tensor | None = None, extra=()
    ) -> torch.Tensor:
        """[B + len(extra), V]: each sequence's last token's logits, then those of the batch's tokens at
        `extra` (prompt_logprobs.py)."""
        fb, seg_indptr, seg_slots = self._build_batch(seqs, extra)
        fill_pending(fb.input_ids, pending)
        lora = None
        if any(s >= 0 for s in seg_slots):
            self.lora.prepare(seg_indptr, seg_slots)
            lora = self.lora
        return self.model.forward(fb, self.kv, lora, layer_waits)  # [B, V]

    def _build_batch(self, seqs: list[SeqInput], extra=()) -> tuple[ForwardBatch, list[int], list[int]]:
        ps = self.cfg.page_size
        ids, positions, rows, extents, last = [], [], [], [], []
        max_pages = max(len(s.page_ids) for s in seqs)
        table = []
        for s in seqs:
            start, n = len(ids), len(s.token_ids)
            ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            rows.extend(s.page_ids[p // ps] * ps + p % ps for p in pos)
            extents.append(SeqExtent(q_start=start, q_len=n, ctx_len=s.start_pos + n))
            last.append(start + n - 1)
            table.append(s.page_ids + [0] * (max_pages - len(s.page_ids)))
        dev = self.device
        pin = dev.type == "cuda"  # a pageable source could make the copy wait for the queued steps

        def t(x):
            return torch.tensor(x, dtype=torch.int64, pin_memory=pin).to(dev, non_blocking=True)

        m = self.model_cfg
        fb = ForwardBatch(
            input_ids=t(ids),
            positions=t(positions),
            kv_rows=t(rows),
            page_table=t(table),
            logits_indices=t(last + list(extra)),
            seqs=tuple(extents),
            attn_plan=plan_for(self.attention_backend, extents, m.num_heads, m.num_kv_heads, dev),
        )
        return fb, *slot_segments(seqs)
