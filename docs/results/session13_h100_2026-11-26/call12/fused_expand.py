"""Is an expand fused into the base GEMM's epilogue worth building? (session 13, call 12; a measurement,
not runtime code). On the 1B gate_up projection (K 2,048, N 16,384 = gate | up, bf16), with 32 rank-16
adapters whose tokens come in runs of 256 (prefill chunks), this times:
  - cuBLAS (torch.matmul) alone, and cuBLAS followed by the runtime's expand (kernels/lora_expand.py over
    a rank-row table, the eager heuristic's tiles and config): what serving does today;
  - a Triton GEMM alone (the same tiling as below), to see what Triton costs against cuBLAS;
  - that Triton GEMM with the expand in its epilogue: each output tile adds v[rows, slice, :r] @
    B[adapter, :r, cols] * scaling before its one store (a tile whose rows span adapters adds, per rank
    row, each row's own adapter's B row).
Every result is checked against a float64 reference on sampled rows. Medians of triton.testing.do_bench.
    python docs/results/session13_h100_2026-11-26/call12/fused_expand.py   (from the repository root)"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from kernels.batch_info import BatchInfoBuilder  # noqa: E402
from kernels.lora_expand import lora_expand  # noqa: E402

K, HALF, R, N_AD, RUN = 2048, 8192, 16, 32, 256
N = 2 * HALF


@triton.jit
def _gemm(
    x_ptr, w_ptr, y_ptr, v_ptr, b_ptr, slot_ptr, scal_ptr, M, N, K,
    LORA: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]  # W is [N, K]: w^T tile [BK, BN]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, K, BK):
        acc += tl.dot(tl.load(x_ptrs, mask=m_ok[:, None], other=0.0), tl.load(w_ptrs))
        x_ptrs += BK
        w_ptrs += BK
    if LORA:
        s = (pid_n * BN) // HALF  # this column block's slice (gate or up); BN divides HALF
        slots = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1)
        lo, hi = tl.min(slots, axis=0), tl.max(slots, axis=0)
        offs_r = tl.arange(0, R)
        if lo == hi:  # one adapter for the whole tile: one small dot
            if lo >= 0:
                vt = tl.load(
                    v_ptr + (offs_m[:, None] * 2 + s) * R + offs_r[None, :], mask=m_ok[:, None], other=0.0
                )
                bt = tl.load(b_ptr + (lo * R + offs_r[:, None]).to(tl.int64) * N + offs_n[None, :])
                scale = tl.load(scal_ptr + lo * 2 + s)
                acc += tl.dot(vt.to(tl.bfloat16), bt) * scale
        else:  # rows of several adapters: each row gathers its own adapter's B row, rank row by rank row
            ok = m_ok & (slots >= 0)
            safe = tl.where(ok, slots, 0)
            scale = tl.load(scal_ptr + safe * 2 + s, mask=ok, other=0.0)
            for k in range(R):
                vk = tl.load(v_ptr + (offs_m * 2 + s) * R + k, mask=ok, other=0.0)
                bk = tl.load(
                    b_ptr + (safe[:, None] * R + k).to(tl.int64) * N + offs_n[None, :],
                    mask=ok[:, None],
                    other=0.0,
                )
                acc += (vk * scale)[:, None] * bk.to(tl.float32)
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc.to(tl.bfloat16), mask=m_ok[:, None]
    )


def triton_gemm(x, w, lora=None, cfg=(128, 256, 64, 8, 3)):
    M = x.shape[0]
    bm, bn, bk, warps, stages = cfg
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    v, b, slot, scal = lora if lora is not None else (x, x, x, x)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _gemm[grid](x, w, y, v, b, slot, scal, M, N, K, LORA=lora is not None, R=R, HALF=HALF,
                BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)  # fmt: skip
    return y


def run_case(M: int, shift: int, w, b_rows, scal, ranks, table, g) -> None:
    dev = w.device
    x = torch.randn((M, K), device=dev, dtype=torch.bfloat16, generator=g)
    # Runs of RUN tokens, adapters in order; `shift` moves run edges off the 128-row tiles.
    indptr = sorted({0, M, *range(shift or RUN, M, RUN)})
    slots_seg = [i % N_AD for i in range(len(indptr) - 1)]
    slot = torch.empty(M, dtype=torch.int32, device=dev)
    for i, sl in enumerate(slots_seg):
        slot[indptr[i] : indptr[i + 1]] = sl
    v = torch.randn((M, 2, R), device=dev, dtype=torch.float32, generator=g) * 0.5  # the shrink's output
    info = BatchInfoBuilder(M, dev).build(indptr, slots_seg, R)
    v4 = v.view(1, M, 2, R)

    def cublas():
        return x @ w.t()

    def cublas_expand():
        y = x @ w.t()
        lora_expand(v4, b_rows, ranks, scal, table, y, (0, HALF), (HALF, HALF), info, check=False)
        return y

    # float64 reference on sampled rows (v rounded to bf16 as both kernels do)
    rows = torch.randint(0, M, (64,), device=dev, generator=g)
    xb, vb, sb = x[rows].double(), v[rows].to(torch.bfloat16).double(), slot[rows].long()
    base = xb @ w.double().t()
    bsel = b_rows.double().view(N_AD, R, N)[sb]  # [64, R, N]
    parts = [torch.einsum("mr,mrn->mn", vb[:, sl], bsel[:, :, sl * HALF : (sl + 1) * HALF]) for sl in (0, 1)]
    delta = torch.cat(parts, 1) * 2.0

    def err(y, with_lora):
        want = base + delta if with_lora else base
        return float((y[rows].double() - want).norm() / want.norm())

    lora = (v, b_rows, slot, scal)
    cases = [("cuBLAS", cublas, False), ("cuBLAS + expand (runtime kernel)", cublas_expand, True)]
    for cfg in ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4)):
        cases.append((f"Triton GEMM {cfg}", lambda c=cfg: triton_gemm(x, w, None, c), False))
        cases.append((f"Triton GEMM + fused expand {cfg}", lambda c=cfg: triton_gemm(x, w, lora, c), True))
    for name, fn, with_lora in cases:
        e = err(fn(), with_lora)
        us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        label = name + (f" (run edges +{shift})" if shift else "")
        print(f"{M:7d} {label:50s} {us:9.1f} {e:9.1e}", flush=True)


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn((N, K), device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    b_rows = torch.randn((N_AD * R, N), device=dev, dtype=torch.bfloat16, generator=g) * 0.02  # B^T rows
    scal = torch.full((N_AD, 2), 2.0, device=dev, dtype=torch.float32)
    ranks = torch.full((N_AD, 2), R, device=dev, dtype=torch.int32)
    table = torch.arange(N_AD * R, device=dev, dtype=torch.int32).view(N_AD, R)
    print(f"{'tokens':>7} {'case':50s} {'us':>9} {'rel err':>9}")
    for M, shift in ((8192, 0), (8192, 100), (2048, 0), (1024, 37)):
        run_case(M, shift, w, b_rows, scal, ranks, table, g)


if __name__ == "__main__":
    main()
