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
def _gemm_lora_kernel(
    x_desc, w_desc, y_desc, v_ptr, b_ptr, rows_ptr, ranks_ptr, scal_ptr, seg_ptr,
    M, N, K, d0, d1, stride_vt, stride_vs, stride_br, stride_ts, stride_rs, stride_ss,
    LORA: tl.constexpr, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, PROGS: tl.constexpr, FLATTEN: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    for t in tl.range(tl.program_id(0), grid_m * grid_n, PROGS, flatten=FLATTEN):
        pid_m, pid_n = _tile_of(t, grid_m, grid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kk in range(k_steps):
            a = x_desc.load([off_m, kk * BK])
            w = w_desc.load([off_n, kk * BK])
            if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w.T, acc)
        if LORA:
            s = (off_n >= d0).to(tl.int32) + (off_n >= d0 + d1).to(tl.int32)  # slice of this column block
            offs_m = off_m + tl.arange(0, BM)
            offs_n = off_n + tl.arange(0, BN)
            offs_r = tl.arange(0, R)
            seg = seg_ptr + pid_m * (1 + 3 * 4)
            for j in range(tl.load(seg)):
                lo = tl.load(seg + 1 + 3 * j)
                hi = tl.load(seg + 2 + 3 * j)
                ad = tl.load(seg + 3 + 3 * j).to(tl.int64)
                r = tl.load(ranks_ptr + ad * stride_rs + s)
                scale = tl.load(scal_ptr + ad * stride_ss + s)
                r_ok = offs_r < r
                m_ok = (offs_m >= lo) & (offs_m < hi)
                vt = tl.load(
                    v_ptr + offs_m[:, None].to(tl.int64) * stride_vt + s * stride_vs + offs_r[None, :],
                    mask=m_ok[:, None] & r_ok[None, :],
                    other=0.0,
                )
                prow = tl.load(rows_ptr + ad * stride_ts + offs_r, mask=r_ok, other=0).to(tl.int64)
                bt = tl.load(
                    b_ptr + prow[:, None] * stride_br + offs_n[None, :], mask=r_ok[:, None], other=0.0
                )
                vt = (vt * scale).to(bt.dtype)
                if UPCAST:
                    vt, bt = vt.to(tl.float32), bt.to(tl.float32)
                acc = tl.dot(vt, bt, acc)
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


def gemm_lora(x, w, y, lora, dims, cfg, flatten):
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
        LORA=lora is not None, R=R, BM=bm, BN=bn, BK=bk, GROUP_M=8, PROGS=progs, FLATTEN=flatten,
        UPCAST=interpreting(),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


PROJ = {  # name: (K, slice widths)
    "qkv": (2048, (2048, 512, 512)),
    "o": (2048, (2048,)),
    "gate_up": (2048, (8192, 8192)),
    "down": (8192, (2048,)),
}
CONFIGS = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4))


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
        r = int(ranks[sl, 0])
        v[indptr[j] : indptr[j + 1], :, :r] = torch.randn(
            (indptr[j + 1] - indptr[j], S, r), device=dev, generator=g
        )
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

    def err(y, ref):
        return float((y[rows_s].double() - ref).norm() / ref.norm())

    y = torch.empty((M, N), device=dev, dtype=torch.bfloat16)
    cases = [
        ("cuBLAS", lambda: torch.matmul(x, w.t(), out=y), base),
        ("cuBLAS + expand", lambda: lora_expand(
            v4, b, ranks, scal, table, torch.matmul(x, w.t(), out=y), offs, dims, info, check=False), want),
    ]  # fmt: skip
    fused_cfg = {}
    for cfg in CONFIGS:
        seg = segments(indptr, slots, M, cfg[0], dev)
        lora = (v, b, table, ranks, scal, seg, R)
        for flat in (False, True):
            tag = f"{cfg} flat={int(flat)}"
            cases.append(
                (f"Triton TMA GEMM {tag}", lambda c=cfg, f=flat: gemm_lora(x, w, y, None, dims, c, f), base)
            )
            cases.append((f"Triton TMA GEMM + LoRA K steps {tag}",
                          lambda c=cfg, f=flat, lo=lora: gemm_lora(x, w, y, lo, dims, c, f),
                          want))  # fmt: skip
            fused_cfg[f"Triton TMA GEMM + LoRA K steps {tag}"] = (cfg, flat, lora)
    results = {}
    for label, fn, ref in cases:
        try:
            e = err(fn(), ref)
            us = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3
        except Exception as exc:  # a config this Triton cannot compile is reported, not fatal
            print(
                f"{name:8s} {M:6d} +{shift:<3d} {label:58s} failed: {type(exc).__name__}: {str(exc)[:120]}",
                flush=True,
            )
            continue
        results[label] = us
        print(
            f"{name:8s} {M:6d} +{shift:<3d} r{'/'.join(map(str, rank_list)):10s} {label:58s} "
            f"{us:9.1f} us  err {e:.1e}",
            flush=True,
        )
    if name == "gate_up":
        inter = N // 2

        def unfused_act():
            gu = torch.matmul(x, w.t(), out=y)
            return lora_expand_silu_mul(v4, b, ranks, scal, table, gu, info, check=False)

        best = min((k for k in results if "K steps" in k), key=results.get, default=None)
        if best is not None:
            cfg, flat, lora = fused_cfg[best]  # the best fused config above

            def fused_act():
                return silu_mul(gemm_lora(x, w, y, lora, dims, cfg, flat))

            a1, a2 = unfused_act()[rows_s].float(), fused_act()[rows_s].float()
            act_want = torch.nn.functional.silu(want[:, :inter]) * want[:, inter:]
            for label, fn, got in (
                ("cuBLAS + expand_act (runtime)", unfused_act, a1),
                (f"fused GEMM {cfg} + silu_mul", fused_act, a2),
            ):
                us = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3
                e = float((got.double() - act_want).norm() / act_want.norm())
                results[label] = us
                print(
                    f"{name:8s} {M:6d} +{shift:<3d} r{'/'.join(map(str, rank_list)):10s} {label:58s} "
                    f"{us:9.1f} us  err {e:.1e}",
                    flush=True,
                )
    out.append((name, M, shift, rank_list, results))


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name in PROJ:
        for M, shift in ((8192, 0), (8192, 100), (2048, 0), (1024, 37)):
            run_case(name, M, shift, [16], g, out)
        run_case(name, 8192, 100, [8, 16, 32, 64], g, out)
    print("\nsummary: best Triton GEMM / cuBLAS, best fused / (cuBLAS + expand)")
    for name, M, shift, rl, res in out:
        plain = min((v for k, v in res.items() if k.startswith("Triton TMA GEMM (")), default=float("nan"))
        fused = min((v for k, v in res.items() if "K steps" in k), default=float("nan"))
        line = f"{name:8s} {M:6d} +{shift:<3d} r{'/'.join(map(str, rl)):10s} GEMM {plain / res['cuBLAS']:.3f}"
        line += f"  fused {fused / res['cuBLAS + expand']:.3f}"
        if "cuBLAS + expand_act (runtime)" in res:
            f2 = [v for k, v in res.items() if k.startswith("fused GEMM")]
            line += f"  act path {f2[0] / res['cuBLAS + expand_act (runtime)']:.3f}" if f2 else ""
        print(line)


if __name__ == "__main__":
    main()
