"""The sampler's greedy tokens and finiteness check, three ways: argmax + isfinite(logits).all(-1)
(8efb6c0), argmax + aminmax, and max(-1) (values and indices) + amin (the change). Each is checked
against the first on rows with NaN and infinities, then timed (triton.testing.do_bench, median µs) on
float32 logits of the 1B shape's vocabulary (a measurement script, not runtime code).
    python docs/results/session17_h100_2026-11-26/call3/sampler_check.py"""

import torch
import triton


def old(x):
    return x.argmax(dim=-1), torch.isfinite(x).all(dim=-1)


def minmax(x):
    lo, hi = torch.aminmax(x, dim=-1)
    return x.argmax(dim=-1), torch.isfinite(lo) & torch.isfinite(hi)


def new(x):
    hi, tokens = x.max(dim=-1)
    return tokens, torch.isfinite(hi) & torch.isfinite(x.amin(dim=-1))


for rows in (1, 16, 64, 128, 256):
    x = torch.randn(rows, 128256, device="cuda") * 4
    for i, v in zip((1, 2, 3), ("nan", "inf", "-inf"), strict=True):
        if i < rows:
            x[i, (7 * i) % 128256 - 1] = float(v)
    ref = old(x)
    for f in (minmax, new):
        got = f(x)
        fin = ref[1]
        assert torch.equal(got[1], fin) and torch.equal(got[0][fin], ref[0][fin]), (f.__name__, rows)
    t = {
        f.__name__: triton.testing.do_bench(lambda f=f, x=x: f(x), warmup=25, rep=200, return_mode="median")
        * 1e3
        for f in (old, minmax, new)
    }
    print(f"{rows:4d} rows x 128256: " + ", ".join(f"{k} {v:6.1f} us" for k, v in t.items()), flush=True)
