"""The offline engine: `LLM(...).generate(prompts, adapters=..., sampling=...)` runs the scheduler's
planner and the worker's executor in one process, step by step (schedule → launch → finish → update),
overlapped by default: step N+1 is launched before step N is finished (`overlap_schedule`)."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from proto.client import TokenLogprobs
from proto.pipeline import TokenBatch
from proto.plan import SlotLoad, StepResult
from proto.sampling import SamplingParams
from proto.tensor_parallel import AddAdapter, BeginRun, EndRun
from runtime.common.grammar import grammar_error
from runtime.common.model_config import ModelConfig
from runtime.common.names import check_adapter_name
from runtime.common.packed import PackedAdapter
from runtime.engine_args import EngineArgs, context_length, planner_policy, runner_config
from stages.loader.adapter_reader import read_adapter
from stages.scheduler.page_allocator import PageAllocator
from stages.scheduler.planner import Planner, PlannerConfig, PlannerStats
from stages.worker.executor import StepExecutor
from stages.worker.lora.pool import runs_of
from stages.worker.runner import ModelRunner
from stages.worker.tp.group import rank_device
from stages.worker.tp.ranks import RankProcesses
from stages.worker.tp.shard import check_divisible


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result (the SDK's streaming counterpart is `runtime.client.Completion`)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error" (the request alone failed; `error` says why)
    prompt_token_ids: list[int]
    adapter: str | None
    error: str | None = None
    # with SamplingParams.logprobs = k: one per token of token_ids (its log-probability under the raw
    # logits and the k likeliest tokens'), as vLLM's CompletionOutput.logprobs
    logprobs: list[TokenLogprobs] | None = None
    # with SamplingParams.prompt_logprobs = k: one per prompt token after the first (vLLM's list without
    # its leading None), each with its rank
    prompt_logprobs: list[TokenLogprobs] | None = None


class LLM:
    def __init__(
        self,
        model: str | Path,
        adapters: dict[str, str | Path] | None = None,
        *,
        compile_cache_dir: str | Path | None = None,
        **engine_args,
    ):
        """`engine_args` are `EngineArgs`' fields, under the names and with the defaults of the `serve`
        flags they share (runtime/engine_args.py says what each means); `dtype` may also be a torch
        dtype. Here adapter copies are synchronous, and a load is reported ready in the result of its
        step. `compile_cache_dir` sets TRITON_CACHE_DIR for this process (before the first compile).
        With `tensor_parallel_size` N > 1 the model is sharded over N ranks (cuda:0..N-1 on CUDA; N
        processes on the CPU): this process is rank 0, and `close()` (or leaving a `with` block) stops
        the others."""
        if compile_cache_dir is not None:
            os.environ["TRITON_CACHE_DIR"] = str(compile_cache_dir)
        dtype = engine_args.get("dtype")
        if dtype is None:
            engine_args.pop("dtype", None)
        elif not isinstance(dtype, str):
            engine_args["dtype"] = str(dtype).removeprefix("torch.")
        if "pinned_adapters" in engine_args:
            engine_args["pinned_adapters"] = tuple(engine_args["pinned_adapters"])
        self.engine_args = EngineArgs(model=str(model), **engine_args)
        tensor_parallel_size = self.engine_args.tensor_parallel_size
        mcfg = ModelConfig.from_dir(model)
        # config.json read once; the runner refuses a max_model_len past the model's positions
        rc = runner_config(self.engine_args, mcfg)
        self.ranks: RankProcesses | None = None
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
        if tensor_parallel_size == 1:
            self.runner = ModelRunner(rc, mcfg)
        else:
            check_divisible(mcfg, tensor_parallel_size)
            rc = dataclasses.replace(rc, device=rank_device(rc.device, 0))
            self.ranks = RankProcesses(rc, tensor_parallel_size, module="runtime.tp_ranks")
            try:
                self.runner = self.ranks.watch(lambda: ModelRunner(rc, mcfg, tp=self.ranks.group))
            except BaseException:
                self.ranks.abandon()
                raise
        context = context_length(self.engine_args, mcfg)
        kv_tokens = self.runner.num_pages * self.engine_args.page_size
        # a given max_model_len stands (the planner refuses one the KV cache cannot hold); the derived
        # one is capped by the KV cache the runner turned out to have
        given = self.engine_args.max_model_len is not None
        self.max_model_len = context if given else min(context, kv_tokens)
        pool = self.runner.pool
        self.planner_cfg = PlannerConfig.from_policy(
            planner_policy(self.engine_args),
            num_pages=self.runner.num_pages,
            page_size=self.engine_args.page_size,
            pool_rows=pool.total_rows,
            pool_ids=pool.num_ids,
            pool_row_bytes=pool.row_nbytes,
            max_lora_rank=pool.layout.max_rank,
            max_model_len=self.max_model_len,
        )
        tok_file = Path(model) / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.exists() else None
        self.adapters: dict[str, PackedAdapter] = {}  # the host cache: every registered adapter, packed
        self._generations: dict[str, int] = {}  # each name's load count: replaced weights, a new key
        # KV pages and their cached prefixes outlive one generate() call (the KV cache does too)
        self.kv_pages = PageAllocator(self.planner_cfg.num_pages, self.planner_cfg.page_size)
        for name, path in (adapters or {}).items():
            self.add_adapter(name, path)
        self._seed = self.engine_args.seed
        self._ids = itertools.count()
        self.last_planner: Planner | None = None  # the last generate()'s planner (its stats, its pool)
        self.last_phase_seconds: dict[str, float] = {}

    @property
    def last_stats(self) -> PlannerStats | None:
        return self.last_planner.stats if self.last_planner is not None else None

    def add_adapter(self, name: str, path: str | Path) -> None:
        """Read, validate and pack an adapter (raises AdapterError naming it and the reason)."""
        check_adapter_name(name)
        pin = self.runner.device.type == "cuda"
        r = self.runner
        self.adapters[name] = read_adapter(name, path, r.full_cfg, r.host_layout, r.dtype, pin_memory=pin)
        self._generations[name] = self._generations.get(name, 0) + 1
        self.kv_pages.drop_adapter(name)  # the KV of its earlier weights is never read again
        if self.ranks is not None:  # the file is good: every rank reads it for itself
            self._to_ranks(AddAdapter(name=name, path=str(Path(path).resolve())))

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave their group, so that this process can start
        another engine (nothing to do with one rank). The engine generates nothing after this."""
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.close(self.runner)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _to_ranks(self, msg) -> None:
        if self.ranks is not None:
            self.ranks.send(msg)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        adapters: str | None | Sequence[str | None] = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        n = len(prompts)
        names = list(adapters) if isinstance(adapters, list | tuple) else [adapters] * n
        params = list(sampling) if isinstance(sampling, list | tuple) else [sampling or SamplingParams()] * n
        if len(names) != n or len(params) != n:
            raise ValueError(f"{n} prompts but {len(names)} adapters and {len(params)} sampling params")
        for name in names:
            if name is not None and name not in self.adapters:
                raise ValueError(f"unknown adapter {name!r}; registered: {sorted(self.adapters) or 'none'}")
        if self.runner.tp is not None and self.ranks is None:
            raise RuntimeError("this tensor-parallel engine is closed")
        for p in params:
            p.validate()
            if p.guided is not None and (why := grammar_error(p.guided)) is not None:
                raise ValueError(f"guided: {why}")
        prompt_ids = [self._encode(p) for p in prompts]

        planner = Planner(
            self.planner_cfg,
            adapter_rows=lambda name: self.adapters[name].rank,
            adapter_generation=lambda name: self._generations.get(name, 0),
            pages=self.kv_pages,
        )
        self.last_planner = planner
        # The pool starts empty for each call (its rows are overwritten); a fresh executor gets a fresh
        # seed stream.
        executor = StepExecutor(
            self.runner,
            self._load_slot,
            self.max_model_len,
            seed=self._seed,
            overlap_loading=self.planner_cfg.overlap_loading,
        )
        self._to_ranks(
            BeginRun(
                max_model_len=self.max_model_len,
                seed=self._seed,
                overlap_loading=self.planner_cfg.overlap_loading,
            )
        )
        rids = [f"r{next(self._ids)}" for _ in range(n)]
        for rid, ids, name, p in zip(rids, prompt_ids, names, params, strict=True):
            planner.add(rid, ids, name, p)
        outputs: dict[str, list[int]] = {rid: [] for rid in rids}
        logprobs = {rid: [] for rid, p in zip(rids, params, strict=True) if p.logprobs is not None}
        prompt_lps: dict[str, list[TokenLogprobs]] = {}
        reasons: dict[str, str] = {}
        errors: dict[str, str] = {}
        try:
            for result, tokens in self._steps(planner, executor):
                for err in result.errors:
                    reasons[err.request_id], errors[err.request_id] = "error", err.message
                for item in tokens.items:
                    outputs[item.request_id].extend(item.token_ids)
                    if item.logprobs and item.request_id in logprobs:
                        logprobs[item.request_id].extend(item.logprobs)
                    if item.prompt_logprobs is not None:
                        prompt_lps[item.request_id] = item.prompt_logprobs
                    if item.finish_reason:
                        reasons[item.request_id] = item.finish_reason
        except BaseException:
            # requests left holding pages, and pages whose KV a failed step may not have written
            self.kv_pages = PageAllocator(self.planner_cfg.num_pages, self.planner_cfg.page_size)
            if self.ranks is not None:  # they may wait in a collective this rank left: stop them
                ranks, self.ranks = self.ranks, None
                ranks.abandon()
            raise
        finally:
            executor.guided.close()
        self._to_ranks(EndRun())
        self.last_phase_seconds = dict(executor.phase_seconds)
        if any(executor.guided.seconds.values()):  # a run with grammars: the step thread's part in them
            self.last_phase_seconds |= {f"guided_{k}": v for k, v in executor.guided.seconds.items()}
        return [
            RequestOutput(
                self._decode(outputs[rid]),
                outputs[rid],
                reasons[rid],
                ids,
                name,
                errors.get(rid),
                logprobs.get(rid),
                prompt_lps.get(rid),
            )
            for rid, ids, name in zip(rids, prompt_ids, names, strict=True)
        ]

    def _steps(self, planner: Planner, executor: StepExecutor) -> Iterator[tuple[StepResult, TokenBatch]]:
        """Each step's outcome, after the planner has taken it. Overlapped: step N+1 is planned (before
        the planner hears of step N, as a server's scheduler with plans in flight does) and launched
        before step N is finished, so the device has the next step queued while the host reads tokens."""
        overlap = self.engine_args.overlap_schedule
        prev = None
        while planner.has_work or prev is not None:
            step = None
            if planner.has_work:
                plan = planner.schedule()
                if self.ranks is not None:
                    self.ranks.launch(plan)
                step = executor.launch(plan)
            if not overlap:
                prev, step = step, None
            if prev is not None:
                result, tokens = executor.finish(prev)
                if self.ranks is not None:
                    self.ranks.step_finished()
                planner.update(result)
                yield result, tokens
            prev = step

    def _load_slot(self, load: SlotLoad) -> None:
        self.runner.load_adapter(
            load.slot, self.adapters[load.adapter], runs_of(load.row_starts, load.row_counts)
        )

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        vocab = self.runner.model_cfg.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("the model directory has no tokenizer.json; pass prompts as token ids")
            return self.tokenizer.encode(prompt).ids
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""


def _dtype_name(dtype: str | torch.dtype | None) -> str:
    """`dtype` as EngineArgs spells it ("auto": the checkpoint's)."""
    if dtype is None:
        return "auto"
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
