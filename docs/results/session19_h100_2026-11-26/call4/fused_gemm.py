"""Is the LoRA expand worth fusing into a Triton GEMM now? (session 19, call 3; a measurement, not runtime
code). The thirteenth session's fused epilogue (call 12 there) ran 3.9-4.9x slower than cuBLAS plus the
runtime's expand: a plain Triton GEMM was already 33-39 % behind cuBLAS, and the epilogue's own fp32
tiles and per-row gathers left its main loop no registers. This tries the two things it named:

  - a persistent Triton GEMM that loads x and W through TMA descriptors (one program an SM walking the
    output tiles in grouped order), against cuBLAS on the 1B model's four projections;
  - the LoRA delta as extra K steps of that GEMM: for each adapter run that meets an output tile, the
    run's rows of v (the shrink's output, scaled by the adapter's scaling and rounded to bf16, other
    rows masked to zero) times the adapter's B^T rows (gathered through the rank-row table) accumulate
    into the same fp32 tile. No second accumulator; prefill runs of 128 or more rows meet a 128-row
    tile at most twice.

Baselines: cuBLAS (torch.matmul) alone; cuBLAS followed by the runtime's expand (kernels/lora_expand.py,
its eager heuristic), and for gate_up cuBLAS + the runtime's fused expand + activation
(kernels/lora_expand_act.py) against the fused GEMM + `silu_mul`. Every result is checked against a
float64 reference on sampled rows. Medians of triton.testing.do_bench.
    python docs/results/session19_h100_2026-11-26/call3/fused_gemm.py   (from the repository root)"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from kernels.batch_info import BatchInfoBuilder, interpreting  # noqa: E402
from kernels.lora_expand import lora_expand  # noqa: E402
from kernels.lora_expand_act import lora_expand_silu_mul  # noqa: E402
from kernels.silu_mul import silu_mul  # noqa: E402

NSEG = 4  # adapter runs one row tile may meet (host-checked)
SEG_COLS = 1 + 3 * NSEG


@triton.jit
def _tile_of(t, grid_m, grid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles share each column block, so W tiles are reused from L2."""
    per_group = GROUP_M * grid_n
    first = (t // per_group) * GROUP_M
    rows = tl.minimum(grid_m - first, GROUP_M)
    return first + (t % per_group) % rows, (t % per_group) // rows


@triton.jit
def _lora_k_steps(
    acc, off_m, off_n, pid_m, v_ptr, b_ptr, rows_ptr, ranks_ptr, scal_ptr, seg_ptr, d0, d1,
    stride_vt, stride_vs, stride_br, stride_ts, stride_rs, stride_ss,
    BM: tl.constexpr, BN: tl.constexpr, RC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """acc += each adapter run's (v * scaling)[rows of the run] @ B^T rows, RC rank rows a dot, up to the
    adapter's own rank."""
    s = (off_n >= d0).to(tl.int32) + (off_n >= d0 + d1).to(tl.int32)  # slice of this column block
    offs_m = off_m + tl.arange(0, BM)
    offs_n = off_n + tl.arange(0, BN)
    seg = seg_ptr + pid_m * (1 + 3 * 4)
    for j in range(tl.load(seg)):
        lo = tl.load(seg + 1 + 3 * j)
        hi = tl.load(seg + 2 + 3 * j)
        ad = tl.load(seg + 3 + 3 * j).to(tl.int64)
        r = tl.load(ranks_ptr + ad * stride_rs + s)
        scale = tl.load(scal_ptr + ad * stride_ss + s)
        m_ok = (offs_m >= lo) & (offs_m < hi)
        for k in range(0, r, RC):
            offs_r = k + tl.arange(0, RC)
            r_ok = offs_r < r
            vt = tl.load(
                v_ptr + offs_m[:, None].to(tl.int64) * stride_vt + s * stride_vs + offs_r[None, :],
                mask=m_ok[:, None] & r_ok[None, :],
                other=0.0,
            )
            prow = tl.load(rows_ptr + ad * stride_ts + offs_r, mask=r_ok, other=0).to(tl.int64)
            bt = tl.load(b_ptr + prow[:, None] * stride_br + offs_n[None, :], mask=r_ok[:, None], other=0.0)
            vt = (vt * scale).to(bt.dtype)
            if UPCAST:
                vt, bt = vt.to(tl.float32), bt.to(tl.float32)
            acc = tl.dot(vt, bt, acc)
    return acc


@triton.jit
def _gemm_lora_kernel(
    x_desc, w_desc, y_desc, v_ptr, b_ptr, rows_ptr, ranks_ptr, scal_ptr, seg_ptr,
    M, N, K, d0, d1, stride_vt, stride_vs, stride_br, stride_ts, stride_rs, stride_ss,
    LORA: tl.constexpr, RC: tl.constexpr, FIRST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GROUP_M: tl.constexpr, PROGS: tl.constexpr, FLATTEN: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    for t in tl.range(tl.program_id(0), grid_m * grid_n, PROGS, flatten=FLATTEN):
        pid_m, pid_n = _tile_of(t, grid_m, grid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if LORA and FIRST:  # the LoRA steps before the main loop: their loads overlap its pipeline fill
            acc = _lora_k_steps(
                acc, off_m, off_n, pid_m, v_ptr, b_ptr, rows_ptr, ranks_ptr, scal_ptr, seg_ptr, d0, d1,
                stride_vt, stride_vs, stride_br, stride_ts, stride_rs, stride_ss, BM, BN, RC, UPCAST,
            )  # fmt: skip
        for kk in range(k_steps):
            a = x_desc.load([off_m, kk * BK])
            w = w_desc.load([off_n, kk * BK])
            if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w.T, acc)
        if LORA and not FIRST:
            acc = _lora_k_steps(
                acc, off_m, off_n, pid_m, v_ptr, b_ptr, rows_ptr, ranks_ptr, scal_ptr, seg_ptr, d0, d1,
                stride_vt, stride_vs, stride_br, stride_ts, stride_rs, stride_ss, BM, BN, RC, UPCAST,
            )  # fmt: skip
        y_desc.store([off_m, off_n], acc.to(tl.bfloat16))


def segments(indptr, slots, M, bm, device):
    """Per row tile: the adapter runs that meet it, (count, then (lo, hi, adapter) each)."""
    grid_m = triton.cdiv(M, bm)
    seg = torch.zeros((grid_m, SEG_COLS), dtype=torch.int32)
    for i in range(grid_m):
        lo_t, hi_t = i * bm, min(M, (i + 1) * bm)
        runs = [(max(lo_t, indptr[j]), min(hi_t, indptr[j + 1]), slots[j]) for j in range(len(slots))]
        runs = [r for r in runs if r[0] < r[1]]
        assert len(runs) <= NSEG, runs
        seg[i, 0] = len(runs)
        for j, r in enumerate(runs):
            seg[i, 1 + 3 * j : 4 + 3 * j] = torch.tensor(r)
    return seg.to(device)


def gemm_lora(x, w, y, lora, dims, cfg, flatten, rc=None, first=False):
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk, warps, stages = cfg
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    yd = TensorDescriptor.from_tensor(y, [bm, bn])
    progs = min(132, triton.cdiv(M, bm) * triton.cdiv(N, bn))
    if lora is None:
        v = b = rows = ranks = scal = seg = x
        svt = svs = sbr = sts = srs = sss = 0
        R = 16
    else:
        v, b, rows, ranks, scal, seg, R = lora
        svt, svs, sbr, sts, srs, sss = (
            v.stride(0),
            v.stride(1),
            b.stride(0),
            rows.stride(0),
            ranks.stride(0),
            scal.stride(0),
        )
    d0, d1 = (list(dims) + [0, 0])[:2]
    _gemm_lora_kernel[(progs,)](
        xd, wd, yd, v, b, rows, ranks, scal, seg, M, N, K, d0, d1, svt, svs, sbr, sts, srs, sss,
        LORA=lora is not None, RC=rc or R, FIRST=first, BM=bm, BN=bn, BK=bk, GROUP_M=8, PROGS=progs,
        FLATTEN=flatten, UPCAST=interpreting(),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


PROJ = {  # name: (K, slice widths)
    "qkv": (2048, (2048, 512, 512)),
    "o": (2048, (2048,)),
    "gate_up": (2048, (8192, 8192)),
    "down": (8192, (2048,)),
}
CONFIGS = (((128, 256, 64, 8, 3), False), ((128, 256, 64, 8, 3), True), ((128, 128, 64, 4, 4), True))
# fused variants: (name, rank rows a dot (None: the whole rank tile), LoRA steps before the main loop)
VARIANTS = (
    ("after, whole rank tile", None, False),
    ("after, 16 rank rows", 16, False),
    ("first, 16 rank rows", 16, True),
)


def run_case(name, M, shift, rank_list, g, out):
    dev = torch.device("cuda")
    K, dims = PROJ[name]
    N, S = sum(dims), len(dims)
    offs = [sum(dims[:i]) for i in range(S)]
    R = max(rank_list)
    n_ad, run = 32, 256
    x = torch.randn((M, K), device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn((N, K), device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn((n_ad * R, N), device=dev, dtype=torch.bfloat16, generator=g) * 0.02  # B^T rows
    ranks = torch.tensor(
        [[rank_list[i % len(rank_list)]] * S for i in range(n_ad)], device=dev, dtype=torch.int32
    )
    scal = torch.full((n_ad, S), 2.0, device=dev, dtype=torch.float32)
    perm = torch.randperm(n_ad * R, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    table = perm.view(n_ad, R).to(dev)  # each adapter's rank rows scattered over the pool
    indptr = sorted({0, M, *range(shift or run, M, run)})
    slots = [i % n_ad for i in range(len(indptr) - 1)]
    v = torch.zeros((M, S, R), device=dev, dtype=torch.float32)
    for j, sl in enumerate(slots):  # the shrink writes zeros past each adapter's rank
        r, n = int(ranks[sl, 0]), indptr[j + 1] - indptr[j]
        v[indptr[j] : indptr[j + 1], :, :r] = torch.randn((n, S, r), device=dev, generator=g)
    info = BatchInfoBuilder(M, dev).build(indptr, slots, R)
    v4 = v.view(1, M, S, R)

    rows_s = torch.randint(0, M, (64,), device=dev, generator=g)
    slot_of = torch.empty(M, dtype=torch.long)
    for j, sl in enumerate(slots):
        slot_of[indptr[j] : indptr[j + 1]] = sl
    base = x[rows_s].double() @ w.double().t()
    delta = torch.zeros_like(base)
    for i, row in enumerate(rows_s.tolist()):
        sl = int(slot_of[row])
        for s in range(S):
            r = int(ranks[sl, s])
            bt = b[table[sl, :r].long(), offs[s] : offs[s] + dims[s]].double()
            delta[i, offs[s] : offs[s] + dims[s]] = (v[row, s, :r].double() @ bt) * 2.0
    want = base + delta
    act = name == "gate_up"
    if act:  # gate_up is compared with its activation on both sides, as the forward runs it
        inter = N // 2
        base = torch.nn.functional.silu(base[:, :inter]) * base[:, inter:]
        want = torch.nn.functional.silu(want[:, :inter]) * want[:, inter:]

    y = torch.empty((M, N), device=dev, dtype=torch.bfloat16)
    fin = silu_mul if act else (lambda t: t)

    def today():
        gu = torch.matmul(x, w.t(), out=y)
        if act:
            return lora_expand_silu_mul(v4, b, ranks, scal, table, gu, info, check=False)
        return lora_expand(v4, b, ranks, scal, table, gu, offs, dims, info, check=False)

    cases = [
        ("base", "cuBLAS" + (" + silu_mul" if act else ""), lambda: fin(torch.matmul(x, w.t(), out=y)), base),
        ("today", "cuBLAS + " + ("expand_act" if act else "expand") + " (runtime)", today, want),
    ]
    for cfg, flat in CONFIGS:
        seg = segments(indptr, slots, M, cfg[0], dev)
        lora = (v, b, table, ranks, scal, seg, R)
        tag = f"{cfg} flat={int(flat)}"
        cases.append(
            (
                "gemm",
                f"Triton TMA GEMM {tag}",
                lambda c=cfg, f=flat: fin(gemm_lora(x, w, y, None, dims, c, f)),
                base,
            )
        )
        for vname, rc, first in VARIANTS:
            cases.append(
                (
                    f"fused: {vname}",
                    f"fused {vname} {tag}",
                    lambda c=cfg, f=flat, lo=lora, rc=rc, fi=first: fin(
                        gemm_lora(x, w, y, lo, dims, c, f, rc, fi)
                    ),
                    want,
                )
            )
    best = {}
    for method, label, fn, ref in cases:
        try:
            got = fn()[rows_s].double()
            e = float((got - ref).norm() / ref.norm())
            us = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3
        except Exception as exc:  # a variant this Triton cannot compile is reported, not fatal
            print(f"{name:8s} {M:6d} +{shift:<3d} {label:60s} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        best[method] = min(best.get(method, float("inf")), us)
        ranks_s = "/".join(map(str, rank_list))
        print(
            f"{name:8s} {M:6d} +{shift:<3d} r{ranks_s:11s} {label:60s} {us:9.1f} us  err {e:.1e}", flush=True
        )
    out.append((name, M, shift, rank_list, best))


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    shapes = [((8192, 0), [16]), ((8192, 100), [16]), ((2048, 0), [16]), ((1024, 37), [16])]
    shapes += [((8192, 100), [8, 16, 32, 64]), ((4096, 100), [8, 16, 32, 64])]
    for (M, shift), rl in shapes:
        for name in PROJ:
            run_case(name, M, shift, rl, g, out)
    print("\nper layer (qkv + o + gate_up with its activation + down), best config of each method, us:")
    methods = ["base", "today", "gemm"] + [f"fused: {v[0]}" for v in VARIANTS]
    print(f"{'tokens':>14} {'ranks':>12} " + " ".join(f"{m:>30}" for m in methods))
    for (M, shift), rl in shapes:
        tot = dict.fromkeys(methods, 0.0)
        for _name, m2, s2, rl2, best in out:
            if (m2, s2, rl2) == (M, shift, rl):
                for m in methods:
                    tot[m] += best.get(m, float("nan"))
        ranks_s = "/".join(map(str, rl))
        print(f"{M:>8d} +{shift:<4d} {ranks_s:>12} " + " ".join(f"{tot[m]:>30.1f}" for m in methods))


if __name__ == "__main__":
    main()
