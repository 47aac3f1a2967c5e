"""Kernel warm-up, run by the worker before it reports ready: every Triton kernel variant a serving step
can reach is compiled, or loaded from Triton's on-disk cache (TRITON_CACHE_DIR, set by the launcher from
--compile-cache-dir), so that the first burst after "ready" runs at full speed.

Each variant is launched once through the serving code itself (`TritonLoraBackend.apply`, or
`apply_act` for the gate_up group fused with the activation; the model's `triton_paged_attention`) on
real-shaped buffers, with device metadata that says 0 tiles / empty queries: the launch compiles the
variant and computes nothing (the fused activation: that of the zero buffers). The variants come
from the heuristics (`warmup_plan.py`) rather than from real forwards over a sweep of batches: a sweep
large enough to reach every (tokens, tiles, rank class, key splits) combination would run thousands
of forwards, while the plan needs one launch per variant and one LoRA launch per layer (views of
different layers may differ in alignment, which Triton specialises on). One real forward at the
step-size limit then warms the allocator and the matmul libraries. Nothing here runs on the CPU:
there is nothing to compile.

With a compile pool (`compile_pool.py`; CUDA), the plan's launches are first recorded rather than run,
the pool compiles the recorded specializations in parallel into the cache, and the launches then load
them: the specializations are the JIT's own, so the launch pass compiles nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stages.worker.model import attention
from stages.worker.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from stages.worker.compile_pool import CompilePool
    from stages.worker.runner import ModelRunner
    from stages.worker.warm_marker import WarmMarker

log = logging.getLogger("lorapipe.worker")
LOG_EVERY_S = 5.0


@dataclass(frozen=True)
class WarmupStats:
    lora: int  # LoRA shrink/expand variants launched
    attention: int  # attention variants launched
    seconds: float
    cache_dir: str
    kernels: int = 0  # distinct kernel specializations the launches need (recorded for the pool)
    compiled: int = 0  # of those, compiled by the pool (the rest were in the cache)
    compiled_here: int = 0  # kernels the launches compiled in this process (not found in the cache)
    # wall seconds of its parts: the plan, recording the launches, the pool's compiles, the launch pass
    parts: tuple[tuple[str, float], ...] = ()
    fp8: int = 0  # weight-only fp8 GEMM variants launched
    plan: str = ""  # the plan's fingerprint (plan_cache.py)
    cached: bool = False  # the cache's marker held this plan: no pool, no recording, launches load only


Report = Callable[[int, int], None]  # (steps done, total): compiles of the pool, then variant launches


class _Progress:
    """Log lines with a count and the elapsed time: the first, then at most one per LOG_EVERY_S, the last.
    `report` hears every step."""

    def __init__(self, total: int, say: Callable[[str], None], report: Report | None = None):
        self.total, self.say, self.done, self.report = total, say, 0, report
        self.start = self.last = time.perf_counter()
        if report is not None:
            report(0, total)

    def step(self, what: str) -> None:
        self.done += 1
        if self.report is not None:
            self.report(self.done, self.total)
        now = time.perf_counter()
        if self.done in (1, self.total) or now - self.last >= LOG_EVERY_S:
            self.last = now
            self.say(f"warm-up: {self.done}/{self.total} kernel variants ({what}), {now - self.start:.1f} s")


def start_compiling(
    device: torch.device, warmup: bool, marker: WarmMarker | None = None
) -> CompilePool | None:
    """On CUDA: point the compile cache at its namespace for this GPU and these kernels, and (`warmup`)
    start the compile pool, whose processes start up while the caller reads the weights; none where
    `marker` says the cache holds every kernel already."""
    if device.type != "cuda":
        return None
    from triton.runtime.driver import driver

    from stages.worker.compile_pool import CompilePool, namespace_cache

    with torch.cuda.device(device):
        target = driver.active.get_current_target()
    namespace_cache(target)
    if not warmup or (marker is not None and marker.complete()):
        return None
    return CompilePool(target)


def warm_up(
    runner: ModelRunner,
    say: Callable[[str], None] = log.info,
    pool: CompilePool | None = None,
    report: Report | None = None,
    marker: WarmMarker | None = None,
) -> WarmupStats:
    """Compile everything serving can reach on this runner (CUDA only; a no-op elsewhere): in `pool`
    when given, then load it all in this process. `report` hears the progress. Without a pool, where
    `marker` was given: its cache held every kernel of this plan (else a pool starts now)."""
    cache_dir = os.environ.get("TRITON_CACHE_DIR", "triton's default (~/.triton/cache)")
    start = time.perf_counter()
    if runner.device.type != "cuda":
        return WarmupStats(0, 0, 0.0, cache_dir)
    from kernels import device_info
    from stages.worker.compile_pool import counting_compiles, recording
    from stages.worker.plan_cache import cached_plan, fingerprint
    from stages.worker.warmup_plan import attention_variants, fp8_launches, lora_launches, plan_axes

    graphs = runner.graphs_sizes()
    lora = runner.lora if runner.lora.name == "triton" else None
    m = runner.model_cfg
    attn_args = {}
    if runner.attention_backend == "triton":
        attn_args = dict(
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            max_tokens=runner.cfg.max_tokens_per_step,
            max_seqs=runner.max_seqs,
            max_model_len=runner.max_context,
            device=runner.device,
        )

    def plan() -> tuple[list, list]:
        launches = lora_launches(lora, graphs) if lora is not None else []  # type: ignore[arg-type]
        return launches, attention_variants(**attn_args) if attn_args else []

    key = fingerprint(lora, graphs, attn_args)
    cached = pool is None and marker is not None and marker.holds(key)
    if pool is None and marker is not None and not cached:  # the marker was for another plan
        from triton.runtime.driver import driver

        from stages.worker.compile_pool import CompilePool

        with CompilePool(driver.active.get_current_target()) as late:
            return warm_up(runner, say, late, report)
    (launches, attn), read = cached_plan(os.environ.get("TRITON_CACHE_DIR"), key, plan)
    if lora is not None:
        lora.prepare([0], [])  # an empty batch: its header says 0 tiles (what the launches below read)
    fp8 = fp8_launches(runner.model.w.layers[0], device_info.num_sms(runner.device))
    marks = [("plan", time.perf_counter())]
    say(
        f"warm-up: {len(launches)} LoRA and {len(attn)} attention kernel variants, and {len(fp8)} fp8 GEMM "
        f"ones, to {'load' if cached else 'compile or load'} (cache: {cache_dir}; plan "
        f"{'read from it' if read else 'computed'}); "
        f"{plan_axes(launches, attn)}"
    )
    specs = []
    if pool is not None:
        with recording() as specs, torch.inference_mode():
            _lora(runner, launches, None)
            _attention(runner, attn, None)
            _fp8(runner, fp8, None)
            _top_logprobs(runner)
            # The step-sized forward's own kernels (norms, rotary, activation) too, and those graph capture
            # will launch (its buffers' shapes and strides, which Triton specialises on, are the graphs'
            # own). Recorded launches do not run, so activations are garbage; indices all come from host
            # copies, and nothing of it is kept.
            _forward(runner)
            # A plan read from the cache was written by a warm-up whose capture then filled the cache with
            # the graphs' kernels too: only a computed plan needs the graphs' dry runs (seconds of host
            # work, about what compiling their few extra kernels one by one in capture would cost).
            for graphs in (runner.step_graphs, runner.graphs) if not read else ():
                if graphs is not None:
                    graphs.dry_run()
        say(f"warm-up: {len(specs)} kernel specializations to compile in {pool.workers} processes")
        marks.append(("record", time.perf_counter()))
    progress = _Progress(len(specs) + len(launches) + len(attn) + len(fp8), say, report)
    compiled = pool.compile(specs, lambda: progress.step("compiled")) if specs else 0
    marks.append(("compile", time.perf_counter()))
    read: list[float] = []  # seconds of each kernel read from the cache (the rest: module loads, launches)
    with torch.inference_mode(), counting_compiles(read_seconds=read) as here:
        _lora(runner, launches, progress)
        _attention(runner, attn, progress)
        _fp8(runner, fp8, progress)
        _top_logprobs(runner)
        _forward(runner)
    torch.cuda.synchronize(runner.device)
    marks.append(("launch", time.perf_counter()))
    took = time.perf_counter() - start
    say(done_line(took, compiled, len(specs), sum(here), len(here), sum(read)))
    times = [start] + [t for _, t in marks]
    parts = tuple((name, b - a) for (name, _), a, b in zip(marks, times[:-1], times[1:], strict=True))
    n = (len(launches), len(attn))
    return WarmupStats(*n, took, cache_dir, len(specs), compiled, sum(here), parts, len(fp8), key, cached)


def done_line(
    seconds: float,
    pool_compiled: int,
    kernels: int,
    here_compiled: int,
    here: int,
    read_s: float | None = None,
) -> str:
    """The warm-up's last log line (benchmarks/cold_start_report.py reads it). `read_s`: seconds the
    worker's launches spent reading kernels from the cache (the rest of them: module loads, launches)."""
    read = "" if read_s is None else f", {read_s:.1f} s reading kernels from the cache"
    return (
        f"warm-up done in {seconds:.1f} s: {pool_compiled} of {kernels} kernels compiled by the pool, "
        f"{here_compiled} of {here} compiled in the worker{read}"
    )


def _lora(runner: ModelRunner, launches: list, progress: _Progress | None) -> None:
    from kernels.batch_info import BatchInfo
    from kernels.lora_expand_act import ExpandActConfig

    backend, layout = runner.lora, runner.lora_layout
    empty = backend.batch_info  # lora_launches left an empty batch prepared: its header says 0 tiles
    assert empty is not None
    for launch in launches:
        info = BatchInfo(
            meta=empty.meta,
            num_tokens=launch.num_tokens,
            num_tiles=launch.num_tiles,
            block_m=launch.block_m,
            max_len=min(launch.num_tokens, launch.num_tiles * launch.block_m),
            block_rank=launch.block_rank,
            num_slots_used=1,
        )
        configs = backend.configs_for(info)
        group = layout.group(launch.group)
        x = torch.zeros((launch.num_tokens, group.in_dim), dtype=runner.dtype, device=runner.device)
        out = torch.zeros((launch.num_tokens, group.out_total), dtype=runner.dtype, device=runner.device)
        fused = isinstance(configs[group.name][1], ExpandActConfig)  # expand + activation in one kernel
        for layer in range(layout.num_layers):
            if fused:
                backend.apply_act_as(info, configs, x, out, layer, group, runner.model.ops.act)
            else:
                backend.apply_as(info, configs, x, out, layer, group)
        if progress is not None:
            progress.step(f"LoRA {launch.group} block_m={launch.block_m} block_rank={launch.block_rank}")


def _attention(runner: ModelRunner, variants: list[tuple[int, int]], progress: _Progress | None) -> None:
    from kernels.paged_attention import META_COLS, AttentionPlan

    m, dev = runner.model_cfg, runner.device
    meta = torch.zeros((1, META_COLS), dtype=torch.int32, device=dev)  # one block with no query rows
    q = torch.zeros((1, m.num_heads, m.head_dim), dtype=runner.dtype, device=dev)  # [T, H, D]
    one = torch.zeros(1, dtype=torch.int64, device=dev)
    for block_m, splits in variants:
        plan = AttentionPlan(
            meta=meta,
            num_tokens=1,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            block_m=block_m,
            num_splits=splits,
        )
        fb = ForwardBatch(
            input_ids=one,
            positions=one,
            kv_rows=one,
            page_table=torch.zeros((1, 1), dtype=torch.int64, device=dev),  # as the eager path builds it
            logits_indices=one,
            seqs=(),
            attn_plan=plan,
        )
        for layer in range(m.num_layers):
            attention.triton_paged_attention(q, runner.kv, layer, fb, runner.model.scale, m.sliding_window)
        if progress is not None:
            progress.step(f"attention block_m={block_m} splits={splits}")


def _fp8(runner: ModelRunner, launches: list, progress: _Progress | None) -> None:
    """Each weight-only fp8 GEMM variant once, on layer 0's weights and a zero input."""
    from kernels.fp8_gemm import w8a16_matmul

    layer = runner.model.w.layers[0]
    for launch in launches:
        w, bias = getattr(layer, launch.proj), getattr(layer, f"{launch.proj}_bias")
        x = torch.zeros((launch.num_tokens, w.shape[1]), dtype=runner.dtype, device=runner.device)
        w8a16_matmul(x, w.q, w.scale, bias, config=launch.config)
        if progress is not None:
            progress.step(f"fp8 GEMM {launch.proj} block_m={launch.config.block_m}")


def _top_logprobs(runner: ModelRunner) -> None:
    """The sampler's fused top-k log-probability kernels (a step with logprobs launches them) and its
    grammar-mask kernel (a step with structured output), on the logits the runner returns."""
    from kernels import token_bitmask, top_logprobs

    top_logprobs.warm(runner.device, runner.full_cfg.vocab_size)
    token_bitmask.warm(runner.device, runner.full_cfg.vocab_size)


def _forward(runner: ModelRunner) -> None:
    """One base-model prefill step of max_tokens_per_step tokens, in sequences of at most the context
    length, on pages from 0 (no sequence has written any yet): the caching allocator reaches its peak
    and the matmul libraries meet their largest shapes now."""
    from stages.worker.seq_input import SeqInput

    ps, page = runner.cfg.page_size, 0
    left = min(runner.cfg.max_tokens_per_step, runner.kv.num_pages * ps)
    seqs = []
    while left > 0 and page < runner.kv.num_pages:
        n = min(left, runner.max_context, (runner.kv.num_pages - page) * ps)
        pages = -(-n // ps)
        seqs.append(SeqInput([0] * n, 0, list(range(page, page + pages)), -1))
        page, left = page + pages, left - n
    runner._forward_eager(seqs)
