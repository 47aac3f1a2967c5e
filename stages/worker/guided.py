"""Structured output on the worker: one llguidance matcher per request that asks (`SamplingParams.guided`)
and, a step, one job on the masks thread (`GuidedMasks.start`, before the step's forward is launched):
it waits for the step before's tokens, feeds them to the matchers in one call over llguidance's own
thread pool, then has that pool write every next-token mask, packed 32 tokens a word, into one pinned
buffer, all while the step thread launches the forward and finishes the step before. The masks then go
up in one copy and are applied by one kernel (kernels/token_bitmask.py). Matchers and the tokenizer they
share are built on a thread of their own when a request first asks; a step in which no request asks
never touches any of this."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from kernels.token_bitmask import masked_logits
from proto.sampling import Guided
from runtime.common.grammar import grammar_of, matcher_tokenizer, rust_call

# llguidance's pool (masks and token consumption of one step, in parallel): every core this process may
# run on but two, which the step thread and the stage's event loop keep
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
MASK_THREADS = min(32, max(1, _CORES - 2))
# The masks thread takes the GIL a few times a job (to read the tokens, to hand each call over) while the
# step thread runs Python: a waiting thread gets it after at most this interval (CPython's default, 5 ms,
# would stall a job behind the forward's launch). Set for the process once a request asks for a grammar.
SWITCH_INTERVAL_S = 2e-4


@functools.lru_cache(maxsize=2)  # an offline engine makes an executor, so a GuidedMasks, per generate()
def _tokenizer(model_dir: str, vocab: int, eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    text = (Path(model_dir) / "tokenizer.json").read_text()
    return matcher_tokenizer(text, vocab, eos_ids)


# Compiling a grammar's further templates (`_template`) may take about this long in all: a grammar that
# compiles in a millisecond gets one a pool thread, one that takes 50 ms or more only the first.
TEMPLATES_BUDGET_S = 0.05


@functools.lru_cache(maxsize=256)
def _template(
    model_dir: str, vocab: int, eos_ids: tuple[int, ...], guided: Guided, slot: int
) -> tuple[llguidance.LLMatcher, float]:
    """A fresh matcher of `guided`, never fed (its template number `slot`), and the seconds its compile
    took: requests with the same grammar (often all of a burst) each get a copy of one, microseconds
    against a millisecond or more for compiling the grammar again. A copy shares its template's lexer,
    and llguidance holds that lexer's lock for a whole mask or token: copies of one template never run in
    parallel, so requests spread over up to as many templates as the pool has threads
    (`GuidedMasks.start` hands the pool each template's copies together)."""
    t0 = time.perf_counter()
    tokenizer = _tokenizer(model_dir, vocab, eos_ids)
    matcher = rust_call(llguidance.LLMatcher, tokenizer, grammar_of(guided), log_level=0)
    return matcher, time.perf_counter() - t0


@dataclass(eq=False)
class _Request:
    matcher: Future[tuple[llguidance.LLMatcher, int]]  # and which template it copies
    consumed: int = 0  # output tokens the matcher has taken
    error: str | None = None
    built: llguidance.LLMatcher | None = None  # the matcher, once its build is known to have succeeded
    slot: int = 0  # which of its grammar's templates the built matcher copies (its lexer lock)
    # whether the grammar was complete after the last tokens fed: read back without touching the matcher,
    # which a mask job may hold on its thread meanwhile
    stopped: bool = False


class MaskJob:
    """One step's grammar work, started on the masks thread (or done at once): the matchers take the tokens
    handed to `GuidedMasks.start`, then llguidance's pool writes each request's next-token mask into one
    pinned buffer, [n W] words and then n int32 slots for the logits rows the masks apply to (filled
    by `upload`), so that one copy carries both. `fed` is set once the tokens are taken (the verdicts
    a finish reads), `wait` returns once the masks are written (the matchers are free again)."""

    def __init__(self, guided: GuidedMasks, n: int, packed: torch.Tensor):
        self._guided, self._n, self._packed = guided, n, packed
        self.fed = threading.Event()
        self.failed: dict[int, str] = {}  # {k: why} for the requests whose grammar failed: they allow nothing
        self._done: Future | None = None

    def wait(self) -> None:
        """Wait for the host's part (raises what it raised)."""
        if self._done is not None:
            t0 = time.perf_counter()
            self._done.result()
            self._guided.seconds["wait"] += time.perf_counter() - t0

    def upload(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The masks on the device, ([n, W] int32 words, [n] int32 `rows`: the logits row each applies
        to), after one copy from pinned memory on a stream of its own, which need not wait for the
        forward queued before it; the current stream waits for the copy."""
        self.wait()
        n, words, device = self._n, self._guided.words, self._guided.device
        self._packed[n * words :] = torch.tensor(rows, dtype=torch.int32)
        copies = self._guided._copies
        if copies is None:
            up = self._packed.to(device)
        else:
            with torch.cuda.stream(copies):
                up = self._packed.to(device, non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(copies)
            up.record_stream(torch.cuda.current_stream(device))
        return up[: n * words].view(n, words), up[n * words :]

    def result(self, width: int) -> torch.Tensor:
        """[n, width] bool on the device, True where the token is allowed (past the vocabulary: never),
        through the kernel sampling applies them with."""
        words, rows = self.upload([0] * self._n)
        zeros = torch.zeros((1, width), dtype=torch.float32, device=self._guided.device)
        return torch.isfinite(masked_logits(zeros, rows, words))


class GuidedMasks:
    def __init__(
        self,
        model_dir: str,
        vocab: int,
        eos_ids: Sequence[int],
        device: torch.device,
        threads: int = MASK_THREADS,
        templates: int | None = None,
    ):
        """`vocab`: the width of the logits the masks apply to; `eos_ids`: what a finished grammar allows;
        `threads`: llguidance's pool; `templates`: how many templates a grammar's matchers are copied
        from (`_template`; as many as threads unless given)."""
        self.model_dir, self.vocab, self.eos_ids, self.device = model_dir, vocab, tuple(eos_ids), device
        self.threads = threads
        self.templates = templates or threads
        self.words = (vocab + 31) // 32  # int32 words of one packed mask
        self._requests: dict[str, _Request] = {}
        self._built = 0  # matchers built (on the builder thread): the next one's template follows
        # the step thread's seconds feeding matchers, starting jobs and waiting for them; the masks
        # thread's seconds feeding (with waiting for the tokens) and computing masks
        self.seconds = dict.fromkeys(("feed", "start", "wait", "job_feed", "job_mask"), 0.0)
        self._builder: ThreadPoolExecutor | None = None
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._masker: ThreadPoolExecutor | None = None  # hands a step's mask call to llguidance's pool
        self._copies: torch.cuda.Stream | None = None  # the masks' copies to a CUDA device
        self._inflight: MaskJob | None = None  # the last job started

    def prepare(self) -> None:
        """Start building the tokenizer matchers share, on the builder thread (once)."""
        if self._builder is None:
            self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            self._tokenizer = self._builder.submit(self._build_tokenizer)
            self._executor = llguidance.LLExecutor(self.threads)
            self._masker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
            if self.device.type == "cuda":
                self._copies = torch.cuda.Stream(self.device)
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    def add(self, request_id: str, guided: Guided) -> None:
        """Start building the request's matcher (off the step thread; the first mask waits for it)."""
        self.prepare()
        assert self._builder is not None
        self._requests[request_id] = _Request(self._builder.submit(self._build_matcher, guided))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def close(self) -> None:
        if self._builder is not None:
            self._builder.shutdown(wait=False, cancel_futures=True)
        if self._masker is not None:
            self._masker.shutdown(wait=False, cancel_futures=True)

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        return _tokenizer(self.model_dir, self.vocab, self.eos_ids)

    def _build_matcher(self, guided: Guided) -> tuple[llguidance.LLMatcher, int]:
        """A copy of one of the grammar's templates, taken in turn (as many as the pool's threads, fewer
        when the grammar is slow to compile: `TEMPLATES_BUDGET_S`), and which one."""
        assert self._tokenizer is not None
        self._tokenizer.result()  # raises what building it raised
        key = (self.model_dir, self.vocab, self.eos_ids, guided)
        template, seconds = _template(*key, 0)
        slots = max(1, min(self.templates, int(TEMPLATES_BUDGET_S / max(seconds, 1e-6))))
        slot = self._built % slots
        self._built += 1
        if slot:
            template = _template(*key, slot)[0]
        return template.deep_copy(), slot

    def advance(self, request_id: str, outputs: Sequence[int]) -> str | None:
        """Feed the matcher the request's outputs it has not taken yet (all known on the host); returns
        why they break its grammar, if they do (then and after)."""
        self.feed([(request_id, outputs, 0, len(outputs))])
        return self._requests[request_id].error

    def feed(
        self,
        items: Sequence[tuple[str, Sequence[int], int, int]],
        known: Callable[[], list[int]] | None = None,
    ) -> None:
        """Feed each request's matcher, here and now, the tokens of its outputs `token_ids[start:end]`
        (id, token_ids, start, end) it has not taken yet: the newest one or few, never a copy of the whole
        output. A placeholder (-1 - row) is the token of that row in `known()` (the step before's
        tokens, read only when one is met). Waits for a job that is still feeding them first. A token
        that breaks a grammar leaves the reason in `error` (then and after), a complete grammar sets
        `stopped`."""
        self._settle()
        t0 = time.perf_counter()
        self._consume(self._take(items), known)
        self.seconds["feed"] += time.perf_counter() - t0

    def _take(self, items: Sequence[tuple[str, Sequence[int], int, int]]) -> list[tuple[_Request, list[int]]]:
        """The tokens each request's matcher has not taken yet (placeholders left in), marked taken: a
        copy, so the outputs may change after (a finish fills in or cuts them)."""
        pending = []
        for rid, ids, start, end in items:
            r = self._requests[rid]
            at = start + r.consumed
            if r.error is None and at < end:
                r.consumed = end - start
                pending.append((r, [ids[at]] if end - at == 1 else list(ids[at:end])))
        return pending

    def _consume(
        self, pending: list[tuple[_Request, list[int]]], known: Callable[[], list[int]] | None
    ) -> None:
        """Feed the `_take`n tokens; the requests with one new token, a step's usual case, go in one call
        over the thread pool. A failure of llguidance or of `known` fails the requests it concerns."""
        # by template: each template's copies go to the pool together (they share a lock: `_template`)
        singles: list[list[tuple[llguidance.LLMatcher, int]]] = [[] for _ in range(self.templates)]
        owners: list[list[_Request]] = [[] for _ in range(self.templates)]
        resolved: list[int] = []
        for r, tail in pending:
            matcher = self._matcher(r)
            if matcher is None:
                continue
            try:
                if any(t < 0 for t in tail):
                    assert known is not None, "a placeholder token without the step that samples it"
                    resolved = resolved or known()
                    tail = [t if t >= 0 else resolved[-1 - t] for t in tail]
                if len(tail) == 1:
                    singles[r.slot].append((matcher, tail[0]))
                    owners[r.slot].append(r)
                    continue
                ok = rust_call(matcher.consume_tokens, tail)
            except Exception as exc:  # the step before's tokens could not be read, or llguidance panicked
                r.error = f"its grammar could not take the output: {type(exc).__name__}: {exc}"[:2000]
                continue
            self._verdict(r, matcher, ok)
        pairs = [pair for group in singles for pair in group]
        if not pairs:
            return
        assert self._executor is not None
        try:
            oks = rust_call(self._executor.consume_token_par, pairs)
        except ValueError as exc:
            for r in (r for group in owners for r in group):
                r.error = f"its grammar could not take the output: {exc}"[:2000]
            return
        for (matcher, _), r, ok in zip(pairs, (r for group in owners for r in group), oks, strict=True):
            self._verdict(r, matcher, ok)

    @staticmethod
    def _verdict(r: _Request, matcher: llguidance.LLMatcher, ok: bool) -> None:
        if ok:
            r.stopped = matcher.is_stopped()
        else:
            r.error = f"the output left its grammar: {matcher.get_error()}"[:2000]

    def _settle(self) -> None:
        """Wait until the job in flight, if any, has fed its matchers (their verdicts are known)."""
        job = self._inflight
        if job is not None and not job.fed.is_set():
            t0 = time.perf_counter()
            job.fed.wait()
            self.seconds["wait"] += time.perf_counter() - t0

    def error(self, request_id: str) -> str | None:
        """Why the request's grammar failed (could not be built, or its output left it), if it did."""
        self._settle()
        return self._requests[request_id].error

    def stopped(self, request_id: str) -> bool:
        """Whether the grammar is complete and allows nothing more (the request ends there)."""
        self._settle()
        r = self._requests[request_id]
        return r.error is None and r.stopped

    def _matcher(self, r: _Request) -> llguidance.LLMatcher | None:
        """The request's matcher (waits for its build), or None when it failed (`r.error` says why)."""
        if r.built is not None:
            return r.built
        if r.error is not None:
            return None
        try:
            matcher, slot = r.matcher.result()
        except Exception as exc:  # a grammar the tokenizer stage let through, or no tokenizer.json
            r.error = f"its grammar could not be built: {type(exc).__name__}: {exc}"[:2000]
            return None
        if matcher.is_error():
            r.error = f"its grammar could not be built: {matcher.get_error()}"[:2000]
            return None
        r.built, r.slot = matcher, slot
        return matcher

    def allowed(self, request_ids: Sequence[str], width: int) -> tuple[torch.Tensor, dict[int, str]]:
        """The next token's mask of each request (all fed their outputs), at once: `start`'s."""
        job = self.start(request_ids, background=False)
        return job.result(width), job.failed

    def start(
        self,
        request_ids: Sequence[str],
        background: bool = True,
        feed: Sequence[tuple[str, Sequence[int], int, int]] = (),
        known: Callable[[], list[int]] | None = None,
    ) -> MaskJob:
        """Start a step's grammar work: feed the matchers `feed` (as `feed` does; `known` may wait for
        the step before's tokens), then compute the next token's mask of each of `request_ids` (its
        grammar built, else it fails: `MaskJob.failed`, {k: why}). In the background, the caller goes on
        (launches the forward, finishes the step before) while the masks thread waits for the tokens and
        llguidance's pool does the rest; the step thread must not call these requests' matchers until
        the job's `wait` (`feed`, `error` and `stopped` wait for its feeding themselves)."""
        assert self._executor is not None and self._masker is not None
        t0 = time.perf_counter()
        if self._inflight is not None:  # normally done (its step sampled): a failed step's may not be
            self._inflight.wait()
        n = len(request_ids)
        pin = self.device.type == "cuda"
        packed = torch.empty(n * self.words + n, dtype=torch.int32, pin_memory=pin)  # [n W + n]
        job = self._inflight = MaskJob(self, n, packed)
        args = (job, self._take(feed), known, [self._requests[rid] for rid in request_ids])
        if background:  # the masks thread takes the GIL within a switch interval (SWITCH_INTERVAL_S)
            job._done = self._masker.submit(self._run, *args)
        else:
            self._run(*args)
        self.seconds["start"] += time.perf_counter() - t0
        return job

    def _run(
        self,
        job: MaskJob,
        pending: list[tuple[_Request, list[int]]],
        known: Callable[[], list[int]] | None,
        requests: list[_Request],
    ) -> None:
        """A job's work, on the masks thread (or at once): feed, then masks. A panic of llguidance's mask
        call fails the requests of that call, by name; the others keep their masks."""
        t0 = time.perf_counter()
        try:
            if pending:
                self._consume(pending, known)
        finally:
            job.fed.set()
        t1 = time.perf_counter()
        words, packed = self.words, job._packed
        rows = packed[: len(requests) * words].view(len(requests), words)
        # by template: each template's copies go to the pool together (they share a lock: `_template`)
        slotted: list[list[tuple[llguidance.LLMatcher, int]]] = [[] for _ in range(self.templates)]
        for k, r in enumerate(requests):
            matcher = self._matcher(r) if r.error is None else None
            if matcher is None:
                job.failed[k] = r.error or "its grammar failed"
                rows[k] = 0
            else:
                slotted[r.slot].append((matcher, k))
        work = [pair for group in slotted for pair in group]
        if work:
            # one call for the whole step: llguidance spreads the matchers over its threads, GIL dropped;
            # it writes every word of each row it is given
            assert self._executor is not None
            try:
                rust_call(
                    self._executor.unsafe_compute_mask_ptr, work, packed.data_ptr(), words * 4, len(requests)
                )
            except ValueError as exc:
                for _, k in work:
                    requests[k].error = job.failed[k] = f"its grammar could not give a mask: {exc}"[:2000]
                    rows[k] = 0
        self.seconds["job_feed"] += t1 - t0
        self.seconds["job_mask"] += time.perf_counter() - t1
