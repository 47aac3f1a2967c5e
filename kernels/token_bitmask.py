"""Grammar masks applied in one launch: `masked_logits(logits, rows, words)` → [n, V] float32, row j the
logits row rows[j] where bit t % 32 of words[j, t // 32] is set, -inf elsewhere (and at every token
past the words' 32 W). The words are llguidance's packed masks as they were copied up, never unpacked
into a [n, V] bool tensor first; the forward's logits are left as they are (log-probabilities read
them raw). `reference` is the same function in torch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _masked_logits_kernel(
    logits_ptr, rows_ptr, words_ptr, out_ptr, vocab, num_words, stride_l, stride_o, BLOCK: tl.constexpr
):
    # Grid: (mask rows, token blocks). A word is read by its 32 tokens' lanes: one cache line serves them.
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    row = tl.load(rows_ptr + j).to(tl.int64)
    x = tl.load(logits_ptr + row * stride_l + cols, mask=inside, other=0.0)
    word = tl.load(words_ptr + j * num_words + cols // 32, mask=cols < 32 * num_words, other=0)
    bit = (word >> (cols % 32)) & 1  # arithmetic shift of bit 31 spreads its sign: the & keeps one bit
    tl.store(out_ptr + j * stride_o + cols, tl.where(bit != 0, x, float("-inf")), mask=inside)


def masked_logits(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32 with contiguous rows; rows [n] int32/int64, each in [0, N); words [n, W]
    int32, contiguous (token t of mask j is bit t % 32 of words[j, t // 32], little-endian as llguidance
    writes them) → a new [n, V] float32 tensor. All on one device; on a CPU tensor without the Triton
    interpreter, `reference`."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"masked_logits expects float32 logits [N, V] with contiguous rows, got {logits.shape}"
        )
    if words.dim() != 2 or words.dtype != torch.int32 or not words.is_contiguous():
        raise ValueError(
            f"masked_logits expects contiguous int32 words [n, W], got {words.shape} {words.dtype}"
        )
    if rows.shape != (words.shape[0],) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"masked_logits: rows {tuple(rows.shape)} do not index the {words.shape[0]} masks")
    if not (logits.device == rows.device == words.device):
        raise ValueError("masked_logits: logits, rows and words must be on one device")
    n, vocab = words.shape[0], logits.shape[1]
    if not logits.is_cuda and not _interpreted():
        return reference(logits, rows, words)
    out = torch.empty((n, vocab), dtype=torch.float32, device=logits.device)
    if n and vocab:
        grid = (n, triton.cdiv(vocab, BLOCK))
        _masked_logits_kernel[grid](
            logits, rows, words, out, vocab, words.shape[1], logits.stride(0), out.stride(0), BLOCK=BLOCK,
            num_warps=8,
        )  # fmt: skip
    return out


def reference(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """`masked_logits` in torch: the words' bytes unpacked to [n, 32 W] bool (little-endian: token
    8 b + j is bit j of byte b), then a select."""
    n, vocab = words.shape[0], logits.shape[1]
    bits = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=words.device)  # [8]
    unpacked = ((words.view(torch.uint8).unsqueeze(-1) & bits) != 0).view(n, -1)  # [n, 32 W]
    allowed = torch.zeros((n, vocab), dtype=torch.bool, device=words.device)
    width = min(vocab, unpacked.shape[1])
    allowed[:, :width] = unpacked[:, :width]
    return torch.where(allowed, logits[rows.long()], float("-inf"))  # [n, V]


def warm(device: torch.device, vocab: int) -> None:
    """Launch the kernel once as a sampling step does (float32 logits [N, vocab], int64 rows, the words
    of that vocabulary): compiles or loads the one specialization serving uses."""
    logits = torch.zeros((1, vocab), dtype=torch.float32, device=device)
    words = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32, device=device)
    masked_logits(logits, torch.zeros(1, dtype=torch.int64, device=device), words)


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
