"""Would one launch per group that runs both halves of the LoRA, the expand of a tile starting as soon as
that tile's shrink is done, beat the shrink and expand as two launches? (session 19, call 8; a
measurement, not runtime code.)

Today a decode step's group is the base GEMM, then the shrink (split-K partials of v per 16-row tile),
then the expand (each program sums its tile's partials and adds v @ B to one column block); the expand
launches as a programmatic dependent of the shrink and waits for all of it. Here one persistent kernel
(PROGS programs, all resident) first walks the shrink items (tile, K split), each storing its partial and
counting itself in on its tile's counter (release), then the expand items (tile, column block) in tile
order: each loads its B rows and output block, waits only until its own tile's counter is full
(acquire), sums the partials and stores. The last expand item of a tile resets both counters.

One slice a group (the 1B model's o: 2,048 -> 2,048; down: 8,192 -> 2,048; and a 2,048 -> 16,384 stand-in
for gate_up), adapters' rank rows scattered over a pool through a row table, decode steps ordered by
adapter. Each variant is a CUDA graph of 16 layers of (cuBLAS GEMM, LoRA), median of replays; the result
is checked against float64 on every row.
    python docs/results/session19_h100_2026-11-26/call8/fused_pair.py [PROGS_PER_SM ...]"""

import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from kernels.batch_info import META_COLS, BatchInfoBuilder, interpreting  # noqa: E402
from kernels.lora_expand import expand_config, lora_expand  # noqa: E402
from kernels.lora_shrink import lora_shrink, shrink_config  # noqa: E402


@triton.jit
def _fused_lora_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, ranks_ptr, rows_ptr, scal_ptr, meta_ptr, part_ptr, cnt_ptr,
    K, N, k_per_split, n_blocks, table_width, cap,
    stride_xt, stride_ar, stride_br, stride_ot, stride_ts, stride_pp,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, PROGS: tl.constexpr, META: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_tiles = tl.load(meta_ptr)
    offs_r = tl.arange(0, BLOCK_R)
    rows_m = tl.arange(0, BLOCK_M)
    for item in range(pid, n_tiles * SPLIT, PROGS):  # the shrink: (tile, K split)
        t = item // SPLIT
        ks = item % SPLIT
        row = meta_ptr + (t + 1) * META
        start = tl.load(row)
        end = tl.load(row + 1)
        slot = tl.load(row + 2).to(tl.int64)
        r = tl.minimum(tl.load(ranks_ptr + slot), table_width)
        r_ok = offs_r < r
        prow = tl.load(rows_ptr + slot * stride_ts + offs_r, mask=r_ok, other=0).to(tl.int64)
        offs_m = start + rows_m
        m_ok = offs_m < end
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(ks * k_per_split, (ks + 1) * k_per_split, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            xt = tl.load(
                x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            at = tl.load(
                a_ptr + prow[:, None] * stride_ar + offs_k[None, :],
                mask=r_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers
                xt, at = xt.to(tl.float32), at.to(tl.float32)
            acc += tl.dot(xt, tl.trans(at))
        p_ptrs = part_ptr + ks * stride_pp + offs_m[:, None].to(tl.int64) * BLOCK_R + offs_r[None, :]
        tl.store(p_ptrs, acc, mask=m_ok[:, None])
        tl.debug_barrier()  # every thread's partial before the count's release
        tl.atomic_add(cnt_ptr + t, 1, sem="release")
    for item in range(pid, n_tiles * n_blocks, PROGS):  # the expand: (tile, column block), tile order
        t = item // n_blocks
        nb = item % n_blocks
        row = meta_ptr + (t + 1) * META
        start = tl.load(row)
        end = tl.load(row + 1)
        slot = tl.load(row + 2).to(tl.int64)
        r = tl.minimum(tl.load(ranks_ptr + slot), table_width)
        r_ok = offs_r < r
        prow = tl.load(rows_ptr + slot * stride_ts + offs_r, mask=r_ok, other=0).to(tl.int64)
        scale = tl.load(scal_ptr + slot)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        bt = tl.load(
            b_ptr + prow[:, None] * stride_br + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0
        )
        offs_m = start + rows_m
        m_ok = offs_m < end
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]
        o = tl.load(o_ptrs, mask=o_mask, other=0.0)  # the shrink does not write out: before the wait
        c = tl.atomic_add(cnt_ptr + t, 0, sem="acquire")
        while c < SPLIT:  # this tile's shrink items, on any program
            c = tl.atomic_add(cnt_ptr + t, 0, sem="acquire")
        p_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * BLOCK_R + offs_r[None, :]
        v = tl.load(p_ptrs, mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
        for p in tl.static_range(1, SPLIT):
            v += tl.load(p_ptrs + p * stride_pp, mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
        vt = v.to(bt.dtype)
        if UPCAST:
            vt, bt = vt.to(tl.float32), bt.to(tl.float32)
        acc = tl.dot(vt, bt)
        tl.store(o_ptrs, (o.to(tl.float32) + acc * scale).to(o.dtype), mask=o_mask)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + cap + t, 1, sem="acq_rel") == n_blocks - 1:  # the tile's last item
            tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed")
            tl.atomic_xchg(cnt_ptr + cap + t, 0, sem="relaxed")


def fused_lora(x, a, b, out, ranks, rows, scal, info, part, cnt, progs, split, block_n=128, block_k=128):
    T, K = x.shape
    N = b.shape[1]
    n_blocks = triton.cdiv(N, block_n)
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    _fused_lora_kernel[(progs,)](
        x, a, b, out, ranks, rows, scal, info.meta, part, cnt, K, N, k_per_split, n_blocks,
        rows.shape[1], cnt.numel() // 2, x.stride(0), a.stride(0), b.stride(0), out.stride(0),
        rows.stride(0), part.stride(0),
        SPLIT=split, BLOCK_M=info.block_m, BLOCK_R=info.block_rank, BLOCK_K=block_k, BLOCK_N=block_n,
        PROGS=progs, META=META_COLS, UPCAST=interpreting(), num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


GROUPS = {"o": (2048, 2048), "down": (8192, 2048), "gate_up (one slice)": (2048, 16384)}
STEPS = {  # name: (adapters, rank cycle, decodes)
    "S1-like: 155 rank-16 adapters, 186 decodes": (155, [16], 186),
    "S2-like: 62 adapters of ranks 8-64, 256 decodes": (62, [8, 16, 32, 64], 256),
    "8 rank-16 adapters, 256 decodes": (8, [16], 256),
}


def make_case(group, step, dev, seed=0):
    K, N = GROUPS[group]
    n_ad, cycle, decodes = STEPS[step]
    g = torch.Generator(device="cpu").manual_seed(seed)
    ranks_l = [cycle[i % len(cycle)] for i in range(n_ad)]
    R = max(ranks_l)
    pool_rows = sum(ranks_l) + 64
    perm = torch.randperm(pool_rows, generator=g)
    rows = torch.zeros((n_ad, R), dtype=torch.int32)
    k = 0
    for i, r in enumerate(ranks_l):
        rows[i, :r] = perm[k : k + r].to(torch.int32)
        k += r
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, n_ad + 1)
    seqs = sorted(list(range(n_ad)) + [int(a) for a in rng.choice(n_ad, size=decodes - n_ad, p=w / w.sum())])
    indptr, slots = [0], []
    for a in seqs:
        if slots and slots[-1] == a:
            indptr[-1] += 1
        else:
            slots.append(a)
            indptr.append(indptr[-1] + 1)
    T = indptr[-1]
    x = (torch.randn((T, K), generator=g) * 0.5).to(torch.bfloat16).to(dev)
    a = (torch.randn((pool_rows, 1, K), generator=g) * 0.02).to(torch.bfloat16).to(dev)
    b = (torch.randn((pool_rows, N), generator=g) * 0.02).to(torch.bfloat16).to(dev)
    ranks = torch.tensor(ranks_l, dtype=torch.int32).view(n_ad, 1).to(dev)
    scal = torch.full((n_ad, 1), 2.0).to(dev)
    info = BatchInfoBuilder(T, dev).build(indptr, slots, R)
    return dict(K=K, N=N, x=x, a=a, b=b, ranks=ranks, rows=rows.to(dev), scal=scal, info=info, indptr=indptr,
                slots=slots, ranks_l=ranks_l)  # fmt: skip


def reference(c, out0):
    want = out0.double().clone()
    x, a, b = c["x"].double(), c["a"][:, 0].double(), c["b"].double()
    rows = c["rows"].long()
    for j, s in enumerate(c["slots"]):
        r = c["ranks_l"][s]
        lo, hi = c["indptr"][j], c["indptr"][j + 1]
        v = (x[lo:hi] @ a[rows[s, :r]].t()).to(torch.bfloat16).double()  # v rounded as the kernels do
        want[lo:hi] += 2.0 * (v @ b[rows[s, :r]])
    return want


def run_case(group, step, per_sm, sms, dev):
    c = make_case(group, step, dev)
    info, K, N = c["info"], c["K"], c["N"]
    T = c["x"].shape[0]
    w = (torch.randn((N, K)) * 0.02).to(torch.bfloat16).to(dev)
    xin = (torch.randn((T, K)) * 0.5).to(torch.bfloat16).to(dev)
    out = torch.empty((T, N), dtype=torch.bfloat16, device=dev)
    scfg = shrink_config(info, K, 1)
    ecfg = expand_config(info, (N,), scfg.parts)
    v = torch.empty((scfg.parts, T, 1, info.block_rank), dtype=torch.float32, device=dev)
    sp = torch.empty(scfg.split_k * T * info.block_rank, dtype=torch.float32, device=dev)
    scnt = torch.zeros(4096, dtype=torch.int32, device=dev)
    split = scfg.split_k
    part = torch.empty((split, T, info.block_rank), dtype=torch.float32, device=dev)
    cnt = torch.zeros(2 * 4096, dtype=torch.int32, device=dev)
    a, b, ranks, rows, scal = c["a"], c["b"], c["ranks"], c["rows"], c["scal"]

    def today():
        for _ in range(16):
            torch.matmul(xin, w.t(), out=out)
            lora_shrink(c["x"], a, ranks, rows, info, out=v, partials=sp, counters=scnt, config=scfg,
                        check=False, pdl=True)  # fmt: skip
            lora_expand(v, b, ranks, scal, rows, out, (0,), (N,), info, config=ecfg, check=False, pdl=True)
        return out

    def fused(progs):
        for _ in range(16):
            torch.matmul(xin, w.t(), out=out)
            fused_lora(c["x"], a[:, 0], b, out, ranks, rows, scal, info, part, cnt, progs, split)
        return out

    variants = [("today: shrink + expand (PDL)", today)]
    variants += [(f"fused, {k} program(s) an SM", lambda k=k: fused(k * sms)) for k in per_sm]
    base = torch.matmul(xin, w.t()).double()
    want = reference(c, base)
    want_bf = want.to(torch.bfloat16).double()  # the kernels round the output once
    first = None
    for label, fn in variants:
        got = fn().double()
        first = got.clone() if first is None else first
        err = float((got - want_bf).norm() / (want - base).norm())
        same = float((got - first).norm() / (want - base).norm())  # against today's result
        if dev.type == "cuda":
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            us = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
        else:
            us = float("nan")
        line = f"{group:20s} {step:48s} split {split:2d} {label:30s} {us:9.1f} us"
        print(f"{line}  err {err:.1e}  vs today {same:.1e}", flush=True)


def main():
    per_sm = [int(v) for v in sys.argv[1:]] or [1, 2]
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    if dev.type == "cpu":  # a check of the kernel under TRITON_INTERPRET=1 (one program: sequential)
        GROUPS.clear()
        GROUPS["small"] = (200, 300)
        STEPS.clear()
        STEPS["6 adapters of ranks 1-24, 11 decodes"] = (6, [8, 1, 24, 16, 5, 16], 11)
        per_sm = [1]
    for group in GROUPS:
        for step in STEPS:
            run_case(group, step, per_sm, sms, dev)


if __name__ == "__main__":
    main()
