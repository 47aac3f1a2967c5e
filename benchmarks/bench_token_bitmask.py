"""One step's grammar masks applied on the GPU: the mask kernel (`kernels/token_bitmask.py`: packed words
and logits rows in, masked [n, V] float32 out) then the greedy argmax, against the torch ops it replaced
(the words unpacked to a [n, V] bool tensor through a uint8 broadcast, the logits rows gathered, a select,
then the argmax), device µs per step over a sweep of masked rows on float32 logits of a real vocabulary;
and the host µs of the step's one upload (pinned words and rows in one copy). Every case checks that both
paths pick the same tokens.

    python -m benchmarks.bench_token_bitmask OUT_DIR [--vocab 128256] [--rows 1,64,256] [--iters 50]

Prints one table, writes OUT_DIR/token_bitmask.json."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_top_logprobs import device_us  # noqa: E402
from kernels.token_bitmask import masked_logits  # noqa: E402


def unpacked(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The replaced path: bytes → [n, 32 W] bool by a broadcast against 1 << j, then a select."""
    n, vocab = words.shape[0], logits.shape[1]
    bits = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=words.device)
    allowed = ((words.view(torch.uint8).unsqueeze(-1) & bits) != 0).view(n, -1)[:, :vocab]  # [n, V]
    return torch.where(allowed, logits.index_select(0, rows.long()), float("-inf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    num_words = (a.vocab + 31) // 32
    found = []
    print("| rows | kernel + argmax us | unpacked + argmax us | speed-up | upload host us |")
    print("| --- | --- | --- | --- | --- |")
    for n in map(int, a.rows.split(",")):
        logits = torch.randn(n, a.vocab, device=device, generator=g)
        rows = torch.randperm(n, device=device, generator=g)  # the forward's order is not the requests'
        words = torch.randint(-(2**31), 2**31, (n, num_words), device=device, generator=g, dtype=torch.int64)
        words = words.to(torch.int32)
        fused = masked_logits(logits, rows, words).argmax(-1)
        plain = unpacked(logits, rows, words).argmax(-1)
        assert torch.equal(fused, plain), "the kernel and the torch ops disagree"
        k_us = device_us(lambda: masked_logits(logits, rows, words).argmax(-1), a.iters)  # noqa: B023
        u_us = device_us(lambda: unpacked(logits, rows, words).argmax(-1), a.iters)  # noqa: B023
        pinned = torch.empty(n * num_words + n, dtype=torch.int32, pin_memory=device.type == "cuda")
        host = []
        for _ in range(a.iters):
            t = time.perf_counter()
            pinned[n * num_words :] = torch.tensor(list(range(n)), dtype=torch.int32)
            pinned.to(device, non_blocking=True)
            host.append((time.perf_counter() - t) * 1e6)
        up_us = statistics.median(host)
        found.append(
            {"rows": n, "vocab": a.vocab, "kernel_us": k_us, "unpacked_us": u_us, "upload_host_us": up_us}
        )
        print(f"| {n} | {k_us:.1f} | {u_us:.1f} | {u_us / k_us:.2f}x | {up_us:.1f} |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "token_bitmask.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
