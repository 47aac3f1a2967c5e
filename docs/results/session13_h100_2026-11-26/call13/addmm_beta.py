"""Would an expand that only writes (the delta first, then the base GEMM accumulating onto it with
cuBLAS's beta = 1) move fewer bytes than today's expand, which reads and writes the GEMM's output again?
(session 13, call 13; a measurement, not runtime code). Times, on the 1B projections at 1,024-8,192
tokens (bf16): y = x @ W^T (beta 0) against y.addmm_(x, W^T) (beta 1, y read in cuBLAS's epilogue), and
the traffic of the two expand forms stood in for by elementwise kernels over y: read + write (y.mul_, as
today's expand reads and writes y) and write only (y.fill_, as a store-only expand would write it).
Medians of triton.testing.do_bench.
    python docs/results/session13_h100_2026-11-26/call13/addmm_beta.py   (from the repository root)"""

import torch
import triton

SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def main() -> None:
    dev = torch.device("cuda")
    print(f"{'tokens':>7} {'group':8s} {'beta 0':>9} {'beta 1':>9} {'y.mul_':>9} {'y.fill_':>9}  (us)")
    for m in (8192, 2048, 1024, 256):
        for name, (k, n) in SHAPES.items():
            x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
            w = torch.randn((n, k), device=dev, dtype=torch.bfloat16) * 0.02
            y = torch.randn((m, n), device=dev, dtype=torch.bfloat16)
            want = y.double() + x.double() @ w.double().t()
            got = y.clone().addmm_(x, w.t())
            err = float((got.double() - want).norm() / want.norm())
            assert err < 1e-2, (name, m, err)
            b0 = us(lambda x=x, w=w: torch.matmul(x, w.t()))
            b1 = us(lambda x=x, w=w, y=y: y.addmm_(x, w.t()))
            rmw = us(lambda y=y: y.mul_(1.0))
            fill = us(lambda y=y: y.fill_(0.5))
            print(f"{m:7d} {name:8s} {b0:9.1f} {b1:9.1f} {rmw:9.1f} {fill:9.1f}", flush=True)


if __name__ == "__main__":
    main()
