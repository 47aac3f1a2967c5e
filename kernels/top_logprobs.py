"""Log-probabilities of one sampled token per row and the row's k likeliest tokens (k <= 32; requests
ask for at most 20, OpenAI's limit), reading each wanted row of the logits once, in its own dtype:
`top_logprobs(logits, rows, tokens, k)`. Replaces a float32 copy, torch's composite logsumexp (max,
subtract, exp, sum: several passes over [M, V]) and a radix-select top-k with two launches: programs
over (row, vocabulary chunk) keep a running max and sum of exponentials and a running top-k set, and
one program per row merges its chunks. Order: likeliest first, equal logits towards the lower token id
(torch.topk leaves ties in no set order). `reference` is the same function in torch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import device_info
from kernels.batch_info import next_pow2

KP = 32  # lanes of a running top-k set: any k up to it (requests ask for at most 20)
BLOCK = 2048  # vocabulary columns a program reads per tile
MAX_SPLITS = 64  # vocabulary chunks per row at most (the merge reads them in one tile)
PROGRAMS_PER_SM = 4  # chunk programs an SM holds at once (8 warps of 63 registers a thread, on sm_90)
I64_MIN: tl.constexpr = tl.constexpr(-(2**63))
I64_MAX: tl.constexpr = tl.constexpr(2**63 - 1)


@triton.jit
def _keys(x, col):
    """int64 keys ordered as (logit, -token id): the logit's float32 bits made order-preserving in the
    high half (negative floats have their magnitude bits flipped), 2^31 - 1 - id in the low half. So
    one integer max finds the largest logit and, among equal ones, the lowest id; the key decodes back
    to both. -0.0 counts as 0.0 (they are equal logits)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - col).to(tl.int64)


@triton.jit
def _value(key):
    """The float32 logit a key was made of."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["chunk", "k"])
def _chunk_kernel(
    logits_ptr,
    rows_ptr,
    ms_ptr,
    keys_ptr,
    vocab,
    stride_row,
    chunk,
    k,
    BLOCK: tl.constexpr,
    KP: tl.constexpr,
):
    # Grid: (M, S). Program (m, s) reads columns [s * chunk, (s + 1) * chunk) of logits row rows[m] once.
    m = tl.program_id(0)
    s = tl.program_id(1)
    splits = tl.num_programs(1)
    row = tl.load(rows_ptr + m).to(tl.int64)
    base = logits_ptr + row * stride_row
    lane = tl.arange(0, KP)
    # The set: k distinct sentinels below every real key (any value is taken over one), and lanes past
    # k held above every key so they are never the set's minimum, the one an insertion replaces.
    wide = lane.to(tl.int64)
    best = tl.where(lane < k, I64_MIN + 64 + wide, I64_MAX - wide)
    kth = tl.min(best, axis=0)
    mx = -float("inf")
    acc = 0.0
    start = s * chunk
    end = tl.minimum(start + chunk, vocab)
    col = start + tl.arange(0, BLOCK)
    ahead = tl.load(base + col, mask=col < end, other=-float("inf"))
    for off in range(start, end, BLOCK):
        col = off + tl.arange(0, BLOCK)
        ok = col < end
        x = ahead.to(tl.float32)
        # the next tile's load is issued before this tile's work, so two tiles are in flight
        ahead = tl.load(base + col + BLOCK, mask=col + BLOCK < end, other=-float("inf"))
        key = tl.where(ok, _keys(x, col), I64_MIN)  # [BLOCK]
        top = tl.max(key, axis=0)
        # running max and sum of exp(x - max), the max shifted to 0 when infinite (as torch.logsumexp)
        new_mx = tl.maximum(mx, _value(top))
        shift = tl.where(tl.abs(new_mx) == float("inf"), 0.0, new_mx)
        old = tl.where(mx == -float("inf"), 0.0, acc * tl.exp(mx - shift))
        acc = old + tl.sum(tl.exp(x - shift), axis=0)
        mx = new_mx
        # insert the tile's keys above the set's minimum, largest first: each replaces that minimum
        cur = top
        while cur > kth:
            best = tl.where(best == kth, cur, best)
            kth = tl.min(best, axis=0)
            cur = tl.max(tl.where(key < cur, key, I64_MIN), axis=0)
    part = m * splits + s
    tl.store(ms_ptr + part * 2, mx)
    tl.store(ms_ptr + part * 2 + 1, acc)
    tl.store(keys_ptr + part * KP + lane, tl.where(lane < k, best, I64_MIN))


@triton.jit(do_not_specialize=["splits", "k", "stride_out"])
def _merge_kernel(
    logits_ptr,
    rows_ptr,
    tokens_ptr,
    ms_ptr,
    keys_ptr,
    out_ptr,
    stride_row,
    stride_out,
    splits,
    k,
    SB: tl.constexpr,
    KP: tl.constexpr,
):
    # Grid: (M,). Row m's logsumexp from its chunks' maxima and sums, its token's log-probability, and
    # the k largest of its chunks' top sets. out[m]: the token's log-probability and the top k's (float32
    # bits), then the top k's ids.
    m = tl.program_id(0)
    s = tl.arange(0, SB)
    has = s < splits
    part = m * splits + s
    mx = tl.load(ms_ptr + part * 2, mask=has, other=-float("inf"))
    acc = tl.load(ms_ptr + part * 2 + 1, mask=has, other=0.0)
    big = tl.max(mx, axis=0)
    shift = tl.where(tl.abs(big) == float("inf"), 0.0, big)
    total = tl.sum(tl.where(mx == -float("inf"), 0.0, acc * tl.exp(mx - shift)), axis=0)
    lse = shift + tl.log(total)
    row = tl.load(rows_ptr + m).to(tl.int64)
    token = tl.load(tokens_ptr + m).to(tl.int64)
    x = tl.load(logits_ptr + row * stride_row + token).to(tl.float32)
    out = out_ptr + m.to(tl.int64) * stride_out
    tl.store(out, (x - lse).to(tl.int32, bitcast=True))
    i = tl.arange(0, SB * KP)
    keys = tl.load(keys_ptr + m * splits * KP + i, mask=i < splits * KP, other=I64_MIN)
    for j in range(k):
        top = tl.max(keys, axis=0)
        keys = tl.where(keys == top, I64_MIN, keys)
        tl.store(out + 1 + j, (_value(top) - lse).to(tl.int32, bitcast=True))
        tl.store(out + 1 + k + j, (0x7FFFFFFF - (top & 0x7FFFFFFF)).to(tl.int32))


def splits_for(num_rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary chunks per row: as many programs as the device holds at once (a second, partial wave
    would cost as much as the first), at least one tile each."""
    want = PROGRAMS_PER_SM * device_info.num_sms(device) // max(1, num_rows)
    return max(1, min(MAX_SPLITS, -(-vocab // BLOCK), want))


def top_logprobs(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int, splits: int | None = None
) -> torch.Tensor:
    """`logits` [N, V] (any float dtype, rows contiguous), `rows` [M] and `tokens` [M] integer tensors on
    its device: for each m, row rows[m]'s log-softmax at tokens[m] and its k largest values with their
    ids. Returns [M, 1 + 2k] int32: column 0 and columns 1..k are float32 bits (view the first 1 + k
    columns as float32), columns k + 1.. the ids, likeliest first. `splits`: vocabulary chunks per row
    (default `splits_for`)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.dtype.is_floating_point:
        raise ValueError(f"top_logprobs expects float logits [N, V] with contiguous rows, got {logits.shape}")
    m, vocab = rows.shape[0], logits.shape[1]
    if tokens.shape != (m,) or rows.dim() != 1 or not rows.device == logits.device == tokens.device:
        raise ValueError(f"top_logprobs: rows {tuple(rows.shape)} and tokens {tuple(tokens.shape)} differ")
    if not 0 <= k <= min(KP, vocab):
        raise ValueError(f"top_logprobs: k must be in [0, {min(KP, vocab)}], got {k}")
    out = torch.empty((m, 1 + 2 * k), dtype=torch.int32, device=logits.device)
    if m == 0:
        return out
    splits = splits or splits_for(m, vocab, logits.device)
    tiles = -(-vocab // BLOCK)
    chunk = -(-tiles // min(splits, MAX_SPLITS)) * BLOCK  # whole tiles
    splits = -(-vocab // chunk)
    ms = torch.empty((m, splits, 2), dtype=torch.float32, device=logits.device)
    keys = torch.empty((m, splits, KP), dtype=torch.int64, device=logits.device)
    _chunk_kernel[(m, splits)](
        logits, rows, ms, keys, vocab, logits.stride(0), chunk, k, BLOCK=BLOCK, KP=KP, num_warps=8
    )
    _merge_kernel[(m,)](
        logits, rows, tokens, ms, keys, out, logits.stride(0), out.stride(0), splits, k,
        SB=next_pow2(MAX_SPLITS), KP=KP, num_warps=4,
    )  # fmt: skip
    return out


def reference(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """`top_logprobs` in torch (float32 arithmetic; ties in torch.topk's own order)."""
    x = logits.index_select(0, rows.long()).float()  # [M, V]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [M, 1]
    top = x.topk(k, dim=-1)  # [M, k] each
    values = torch.cat((x.gather(1, tokens.long().view(-1, 1)), top.values), dim=1) - lse  # [M, 1 + k]
    return torch.cat((values.view(torch.int32), top.indices.to(torch.int32)), dim=1)


def warm(device: torch.device, vocab: int) -> None:
    """Launch both kernels once as a sampling step does (float32 logits [N, vocab] with contiguous rows,
    int64 rows and tokens): compiles or loads the one specialization serving uses (row counts, k and
    splits are not specialized on)."""
    logits = torch.zeros((1, vocab), dtype=torch.float32, device=device)
    index = torch.zeros(1, dtype=torch.int64, device=device)
    top_logprobs(logits, index, index, 1)
