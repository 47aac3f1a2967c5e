"""Turns each sequence's last-token logits into its next token under its own SamplingParams: greedy
rows by argmax in one op (a request with penalties or a logit bias has its row adjusted first, by its
LogitAdjuster; a batch without any pays nothing for them; a request with a grammar has its row masked
to what the grammar allows, greedy ones all in one masked argmax), sampled rows through temperature,
min-p, top-k and top-p with a generator of their own (the request's seed, else one derived from the
engine's seed and the request id), so a request's samples never depend on its batch-mates or on rows
an overlapped step computes and then drops. A row whose logits are not finite is reported as failed
instead of yielding a token. Sampling is issued on the device; its one device→host read is a
non-blocking copy into pinned memory that the caller collects later (`SampledTokens.result`), so the
next step can be launched first; the log-probabilities of the requests that ask for them travel with it
(`SampledTokens.logprobs`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from proto.client import TokenLogprobs
from proto.sampling import SamplingParams
from stages.worker.logit_adjust import LogitAdjuster
from stages.worker.token_logprobs import StepLogprobs

NOT_FINITE = (
    "the model's output for this request is not finite (NaN or infinity): its adapter's weights or "
    "scalings are out of range, or its sampling values overflow"
)


class SampledTokens:
    """One step's sampled tokens on the device (`tokens`, [B] int64, what the next step's placeholder
    ids are resolved from) and their copy to the host, in flight until `result()`."""

    def __init__(
        self,
        tokens_ok: torch.Tensor,
        logprobs: StepLogprobs | None = None,
        failed: dict[int, str] | None = None,
    ):
        """`tokens_ok`: [2, B] int64 on the device: the tokens, then 1 where the row was finite;
        `logprobs`: those of the requests that asked, copied to the host with the tokens; `failed`:
        {row: why} known on the host (a grammar that failed)."""
        self.tokens = tokens_ok[0]  # [B]
        self._event = None
        self._logprobs = logprobs
        self._failed = failed or {}
        self._read: tuple[list[int], dict[int, str]] | None = None
        if tokens_ok.is_cuda:
            self._host = torch.empty(tokens_ok.shape, dtype=tokens_ok.dtype, pin_memory=True)  # [2, B]
            self._host.copy_(tokens_ok, non_blocking=True)
            if logprobs is not None:
                logprobs.to_host()
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens_ok.device))
        else:
            self._host = tokens_ok

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block until the host copy has landed (releases the GIL while it waits)."""
        if self._event is not None:
            self._event.synchronize()

    def result(self) -> tuple[list[int], dict[int, str]]:
        """One token per row, and {row: why} for the rows that could not be sampled (logits or
        probabilities not finite): those fail alone, never their batch-mates."""
        if self._read is None:  # read once: a guided launch and the finish both ask
            self.wait()
            host_tokens, host_ok = self._host.tolist()  # [2, B]
            bad = {i: NOT_FINITE for i, good in enumerate(host_ok) if not good} | self._failed
            self._read = (host_tokens, bad)
        return self._read

    def logprobs(self) -> dict[int, TokenLogprobs]:
        """{row: its token's log-probabilities} for the rows whose request asked (waits like result)."""
        if self._logprobs is None:
            return {}
        self.wait()
        return self._logprobs.entries()


@dataclass(frozen=True)
class Allowed:
    """The token masks of a step's requests with a grammar, applied: request k's logits row with its mask
    applied is `masked[rows[k]]` ([V] float32 on the device, -inf where not allowed; a mask commutes with
    the logit adjustments, which leave -inf as it is); `failed`: {k: why} for those whose grammar
    failed."""

    masked: torch.Tensor  # [n, V] float32
    rows: dict[int, int]
    failed: dict[int, str]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.seed = seed
        self._gens: dict[str, torch.Generator] = {}
        self._adjusters: dict[str, LogitAdjuster] = {}  # requests with penalties or a bias

    def forget(self, request_id: str) -> None:
        self._gens.pop(request_id, None)
        self._adjusters.pop(request_id, None)

    def _adjuster(
        self,
        request_id: str,
        params: SamplingParams,
        prompts: Callable[[int], Sequence[int]] | None,
        k: int,
        vocab: int,
    ) -> LogitAdjuster:
        adjuster = self._adjusters.get(request_id)
        if adjuster is None:
            prompt = prompts(k) if prompts is not None else ()
            adjuster = self._adjusters[request_id] = LogitAdjuster(params, prompt, vocab, self.device)
        return adjuster

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._gens.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed if params.seed is not None else derived_seed(self.seed, request_id))
            self._gens[request_id] = gen
        return gen

    def issue(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        rows: tuple[list[int], torch.Tensor] | None = None,
        prompts: Callable[[int], Sequence[int]] | None = None,
        allowed: Allowed | None = None,
    ) -> SampledTokens:
        """logits: [N, V] float32. Request k's row is k, or with `rows` (host list, and the same on the
        device) rows[k]; rows no request names are never sampled, and their values fail nothing.
        `prompts(k)`: request k's prompt ids, read only at the first sample of a request whose logits
        are adjusted (penalties, bias). Issues the sampling and the host copy; never synchronises (a
        bad row samples a stand-in distribution, so every row's token is a valid id). A batch in which
        no request adjusts its logits or samples takes the greedy path alone. `allowed`: the token masks
        of the requests with a grammar, their logits rows masked (`StepMasks.allowed`)."""
        # A row is finite when its largest and smallest values are (max and min propagate NaN): the
        # greedy tokens' reduction gives the largest, one more the smallest. isfinite(logits).all() ran
        # four elementwise kernels over [B, V] and a reduction: with argmax 334 us against 142 for 256
        # rows of a 128k vocabulary on an H100.
        hi, tokens = logits.max(dim=-1)  # [N] each; the first index of the largest value, as argmax
        ok = torch.isfinite(hi) & torch.isfinite(logits.amin(dim=-1))  # [N]
        at = request_rows(len(request_ids), rows)
        if rows is not None:  # each request's row, [B]: a gather of B values, not of B rows of logits
            tokens, ok = tokens[rows[1]], ok[rows[1]]
        wanted: list[tuple[int, int]] = []  # (request, its top count) for those that want logprobs
        masked = _greedy_masked(tokens, allowed, params) if allowed is not None else set()
        for i, p in enumerate(params):
            if p.logprobs is not None:
                wanted.append((i, p.logprobs))
            adjusts = p.adjusts_logits
            mask = allowed.rows.get(i) if allowed is not None else None
            if p.greedy and not adjusts and mask is None or i in masked:
                continue
            row = logits[at[i]] if mask is None else allowed.masked[mask]  # [V]
            adjuster = None
            if adjusts:
                adjuster = self._adjuster(request_ids[i], p, prompts, i, row.shape[-1])
                row = adjuster.apply(row)
            if p.greedy:
                tokens[i] = row.argmax()
            else:
                probs = _filtered_probs(row, p)
                good = ok[i] & torch.isfinite(probs).all() & (probs.sum() > 0)
                probs = torch.where(good, probs, torch.ones_like(probs))  # a bad row samples a stand-in
                tokens[i] = draw(probs, self._generator(request_ids[i], p))
                ok[i] = good
            if adjuster is not None:
                adjuster.record(tokens[i])
        on_device = rows[1] if rows is not None else None
        logprobs = _logprobs(logits, at, on_device, tokens, wanted) if wanted else None
        failed = allowed.failed if allowed is not None else None
        return SampledTokens(torch.stack((tokens, ok.to(tokens.dtype))), logprobs, failed)  # [2, B]

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> tuple[list[int], dict[int, str]]:
        """`issue` and wait for its result: tokens and {row: why} for the rows that failed."""
        if not request_ids:
            return [], {}
        return self.issue(logits, request_ids, params).result()


def _greedy_masked(tokens: torch.Tensor, allowed: Allowed, params) -> set[int]:
    """Greedy requests with a grammar and nothing else to apply, all at once (one argmax over their
    masked rows, not a few kernels a request): writes their tokens; returns which requests those were."""
    fast = [i for i in allowed.rows if params[i].greedy and not params[i].adjusts_logits]
    if not fast:
        return set()
    masks = [allowed.rows[i] for i in fast]
    best = allowed.masked.argmax(dim=-1)  # [n]
    if fast == masks and len(fast) == tokens.shape[0]:  # all of them, in order
        tokens.copy_(best)
        return set(fast)
    index = _upload([masks, fast], tokens.device)  # [2, m]
    tokens.index_copy_(0, index[1], best.index_select(0, index[0]))
    return set(fast)


def _logprobs(
    logits: torch.Tensor,
    at: Sequence[int],
    rows: torch.Tensor | None,
    tokens: torch.Tensor,
    wanted: list[tuple[int, int]],
) -> StepLogprobs:
    """The step's log-probabilities for the `wanted` requests (request k's logits row at[k], `rows` the
    same on the device, None for row k; its token tokens[k]). When every request asks (the usual case)
    the rows index and the tokens are those already on the device; else one small index upload picks
    the wanted ones. Never an op per request."""
    if len(wanted) == tokens.shape[0]:  # wanted[j] is request j
        return StepLogprobs(
            logits, rows if rows is not None else _arange(len(wanted), logits.device), tokens, wanted
        )
    ks = [k for k, _ in wanted]
    index = _upload([[at[k] for k in ks], ks], logits.device)  # [2, M]
    return StepLogprobs(logits, index[0], tokens.index_select(0, index[1]), wanted)


_ARANGE: dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """0 .. n - 1 on `device`, from one tensor kept per device (no launch per step)."""
    have = _ARANGE.get(device)
    if have is None or have.shape[0] < n:
        have = _ARANGE[device] = torch.arange(max(n, 256), dtype=torch.int64, device=device)
    return have[:n]


def _upload(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Host lists of ints as one int64 tensor on `device`, copied from pinned memory without a sync."""
    index = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index


def request_rows(n: int, rows: tuple[list[int], torch.Tensor] | None) -> Sequence[int]:
    """The logits row of each of `n` requests under `Sampler.issue`'s `rows` (row k without it)."""
    return range(n) if rows is None else rows[0]


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One sample of the [V] distribution `probs` as a 0-d device tensor: what torch.multinomial(probs,
    1) draws from the same generator state (argmax of p / q, q ~ Exp(1)), without the two host reads
    with which multinomial checks its input first (they would make the launch wait for the device)."""
    q = torch.empty_like(probs).exponential_(1, generator=gen)
    return (probs / q).argmax()


def derived_seed(seed: int, request_id: str) -> int:
    """The seed of a request that set none: fixed by the engine's seed and the request id alone."""
    digest = hashlib.blake2b(f"{seed}/{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits → [V] probabilities after temperature, min-p, top-k and top-p (nucleus) filtering."""
    scaled = logits / p.temperature
    if p.min_p > 0:  # drop what is less likely than min_p × the likeliest token
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly before each token
        drop = before >= p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
