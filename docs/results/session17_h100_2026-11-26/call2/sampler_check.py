"""The sampler's finiteness check, before and after: torch.isfinite(logits).all(-1) against the row's
aminmax, each checked against the other on rows with NaN and infinities, then timed (CUDA events,
triton.testing.do_bench, median µs) on float32 logits of the 1B shape's vocabulary (a measurement script,
not runtime code).
    python docs/results/session17_h100_2026-11-26/call2/sampler_check.py"""

import torch
import triton


def old(x):
    return torch.isfinite(x).all(dim=-1)


def new(x):
    lo, hi = torch.aminmax(x, dim=-1)
    return torch.isfinite(lo) & torch.isfinite(hi)


for rows in (16, 64, 256):
    x = torch.randn(rows, 128256, device="cuda") * 4
    x[1, -1] = float("nan")
    x[2, 0] = float("inf")
    x[3, 7] = float("-inf")
    assert torch.equal(old(x), new(x)), (rows, old(x), new(x))
    t_old = triton.testing.do_bench(lambda x=x: old(x), warmup=25, rep=200, return_mode="median") * 1e3
    t_new = triton.testing.do_bench(lambda x=x: new(x), warmup=25, rep=200, return_mode="median") * 1e3
    t_arg = (
        triton.testing.do_bench(lambda x=x: x.argmax(dim=-1), warmup=25, rep=200, return_mode="median") * 1e3
    )
    print(
        f"{rows:4d} rows x 128256: isfinite().all() {t_old:7.1f} us, aminmax {t_new:7.1f} us "
        f"(argmax {t_arg:6.1f} us)"
    )
