"""Structured output on the worker: one llguidance matcher per request that asks (`SamplingParams.guided`),
fed the request's output tokens as they become known (a step's new tokens in one call, spread over
llguidance's own thread pool, which drops the GIL), and the step's token masks: computed by that pool
while the device runs the step's forward, packed 32 tokens a word, copied to the device and unpacked
there into the rows the sampler masks; the step thread itself does a few look-ups a request. Matchers
and the tokenizer they share are built on a thread of their own when a request first asks; a step in
which no request asks never touches any of this."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from proto.sampling import Guided
from runtime.common.grammar import grammar_of, matcher_tokenizer, rust_call

# llguidance's pool (masks and token consumption of one step, in parallel): every core this process may
# run on but two, which the step thread and the stage's event loop keep
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
MASK_THREADS = min(32, max(1, _CORES - 2))


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
    """One step's masks, computed by llguidance's pool on the masks thread (or at once): `result` waits for
    them and unpacks them on the device."""

    def __init__(self, guided: GuidedMasks, n: int, packed: torch.Tensor, failed: dict[int, str], done):
        self._guided, self._n, self._packed, self.failed, self._done = guided, n, packed, failed, done

    def wait(self) -> None:
        """Wait for the host's part (the matchers are free again after it)."""
        if isinstance(self._done, Future):
            t0 = time.perf_counter()
            self._done.result()
            self._guided.seconds["wait"] += time.perf_counter() - t0

    def result(self, width: int) -> torch.Tensor:
        """[n, width] bool on the device, True where the token is allowed (the rows of `failed`, the
        requests whose grammar failed, allow nothing; the caller fails them)."""
        self.wait()
        n, device, bits = self._n, self._guided.device, self._guided._bits
        copies = self._guided._copies
        if copies is None:
            words = self._packed.to(device)
        else:  # on a stream of its own: it need not wait for the forward queued before it
            with torch.cuda.stream(copies):
                words = self._packed.to(device, non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(copies)
            words.record_stream(torch.cuda.current_stream(device))
        # token 8 b + j is bit j of byte b (the words are little-endian, on the host and on the device)
        octets = words.view(torch.uint8)  # [n, 4 W]
        allowed = ((octets.unsqueeze(-1) & bits) != 0).view(n, -1)  # [n, 32 W] bool
        if allowed.shape[1] >= width:
            return allowed[:, :width]
        pad = torch.zeros((n, width - allowed.shape[1]), dtype=torch.bool, device=device)
        return torch.cat((allowed, pad), dim=1)


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
        # the step thread's seconds feeding matchers, starting mask jobs and waiting for their masks
        self.seconds = dict.fromkeys(("feed", "start", "wait"), 0.0)
        self._builder: ThreadPoolExecutor | None = None
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._masker: ThreadPoolExecutor | None = None  # hands a step's mask call to llguidance's pool
        self._copies: torch.cuda.Stream | None = None  # the masks' copies to a CUDA device
        self._bits: torch.Tensor | None = None  # [8] uint8 on the device: 1 << j

    def prepare(self) -> None:
        """Start building the tokenizer matchers share, on the builder thread (once)."""
        if self._builder is None:
            self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            self._tokenizer = self._builder.submit(self._build_tokenizer)
            self._executor = llguidance.LLExecutor(self.threads)
            self._masker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
            if self.device.type == "cuda":
                self._copies = torch.cuda.Stream(self.device)
            self._bits = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=self.device)

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
        """Feed each request's matcher the tokens of its outputs `token_ids[start:end]` (id, token_ids,
        start, end) it has not taken yet: the newest one or few, never a copy of the whole output. A
        placeholder (-1 - row) is the token of that row in `known()` (the step before's tokens, read
        only when one is met). The requests with one new token, a step's usual case, go in one call
        over the thread pool; a token that breaks a grammar leaves the reason in `error` (then and
        after), a complete grammar sets `stopped`."""
        t0 = time.perf_counter()
        # the requests with one new token, by template: each template's copies go to the pool together
        # (they share a lock: `_template`)
        singles: list[list[tuple[llguidance.LLMatcher, int]]] = [[] for _ in range(self.templates)]
        owners: list[list[_Request]] = [[] for _ in range(self.templates)]
        resolved: list[int] = []
        for rid, ids, start, end in items:
            r = self._requests[rid]
            at = start + r.consumed
            if r.error is not None or at >= end:
                continue
            matcher = r.built if r.built is not None else self._matcher(r)
            if matcher is None:
                continue
            r.consumed = end - start
            if end - at == 1:
                token = ids[at]
                if token < 0:
                    assert known is not None, "a placeholder token without the step that samples it"
                    resolved = resolved or known()
                    token = resolved[-1 - token]
                singles[r.slot].append((matcher, token))
                owners[r.slot].append(r)
                continue
            tail = list(ids[at:end])
            if any(t < 0 for t in tail):
                assert known is not None, "a placeholder token without the step that samples it"
                resolved = resolved or known()
                tail = [t if t >= 0 else resolved[-1 - t] for t in tail]
            if matcher.consume_tokens(tail):
                r.stopped = matcher.is_stopped()
            else:
                r.error = f"the output left its grammar: {matcher.get_error()}"[:2000]
        pairs = [pair for group in singles for pair in group]
        if pairs:
            assert self._executor is not None
            oks = rust_call(self._executor.consume_token_par, pairs)
            for (matcher, _), r, ok in zip(pairs, (r for group in owners for r in group), oks, strict=True):
                if ok:
                    r.stopped = matcher.is_stopped()
                else:
                    r.error = f"the output left its grammar: {matcher.get_error()}"[:2000]
        self.seconds["feed"] += time.perf_counter() - t0

    def error(self, request_id: str) -> str | None:
        """Why the request's grammar failed (could not be built, or its output left it), if it did."""
        return self._requests[request_id].error

    def stopped(self, request_id: str) -> bool:
        """Whether the grammar is complete and allows nothing more (the request ends there)."""
        r = self._requests[request_id]
        return r.error is None and r.stopped

    def _matcher(self, r: _Request) -> llguidance.LLMatcher | None:
        """The request's matcher (waits for its build), or None when it failed (`r.error` says why)."""
        if r.built is not None:
            return r.built
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

    def start(self, request_ids: Sequence[str], background: bool = True) -> MaskJob:
        """Start computing the next token's mask of each request (all fed their outputs; its grammar
        built, else it fails: `MaskJob.failed`, {k: why}). In the background, the step thread must not
        call these requests' matchers until the job's `result`: a matcher is held by its mask call."""
        assert self._executor is not None and self._masker is not None
        t0 = time.perf_counter()
        n = len(request_ids)
        pin = self.device.type == "cuda"
        packed = torch.empty((n, self.words), dtype=torch.int32, pin_memory=pin)  # [n, W]
        # by template: each template's copies go to the pool together (they share a lock: `_template`)
        slotted: list[list[tuple[llguidance.LLMatcher, int]]] = [[] for _ in range(self.templates)]
        failed = {}
        for k, rid in enumerate(request_ids):
            r = self._requests[rid]
            matcher = self._matcher(r) if r.error is None else None
            if matcher is None:
                failed[k] = r.error or "its grammar failed"
                packed[k] = 0
            else:
                slotted[r.slot].append((matcher, k))
        work = [pair for group in slotted for pair in group]
        done = None
        if work:
            # one call for the whole step: llguidance spreads the matchers over its threads, GIL dropped;
            # it writes every word of each row it is given
            call = (self._executor.unsafe_compute_mask_ptr, work, packed.data_ptr(), self.words * 4, n)
            if background:
                started = threading.Event()
                done = self._masker.submit(_started, started, *call)
                # The masks thread needs the GIL to make its call: waiting here hands it over at once
                # (else it waits for the step thread's next switch interval, milliseconds of pure Python).
                started.wait()
            else:
                rust_call(*call)
        self.seconds["start"] += time.perf_counter() - t0
        return MaskJob(self, n, packed, failed, done)


def _started(started: threading.Event, fn, *args) -> None:
    """`fn(*args)`, on the masks thread, once it has said that it runs (it drops the GIL in `fn`)."""
    started.set()
    rust_call(fn, *args)  # a panic of its Rust code fails the step, not the stage
