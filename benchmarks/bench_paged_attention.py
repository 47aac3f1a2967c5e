"""Paged attention on Llama-3.2-1B shapes (32 heads, 8 KV heads, D 64, bf16, pages of 16): the Triton
kernel against the torch loop, with block-shape variants; prints one table, writes $OUT/bench.json (default
$TMPDIR/lorapipe-bench/paged_attention)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.getcwd())
import kernels.paged_attention as pa  # noqa: E402
from stages.worker.model.attention import torch_paged_attention  # noqa: E402
from stages.worker.model.forward_batch import ForwardBatch, SeqExtent  # noqa: E402
from stages.worker.model.kv_cache import KVCache  # noqa: E402

H, KVH, D, PS, DT, DEV = 32, 8, 64, 16, torch.bfloat16, torch.device("cuda")
OUT = os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "lorapipe-bench", "paged_attention")
SETS = 4  # page-table sets rotated between runs so the KV reads do not come from L2
results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


def bench(_, fns) -> float:
    state = {"i": 0}

    def step():
        state["i"] += 1
        fns[state["i"] % len(fns)]()

    return do_bench(step, warmup=25, rep=150, return_mode="median") * 1e3  # us


def ceilings():
    x = torch.randn(2**28, device=DEV, dtype=DT)  # 512 MiB
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3
    a = torch.randn(8192, 8192, device=DEV, dtype=DT)
    tm = do_bench(lambda: a @ a, return_mode="median") * 1e-3
    results["copy_TBps"] = 2 * x.numel() * 2 / t / 1e12
    results["bf16_mm_TFLOPs"] = 2 * 8192**3 / tm / 1e12


def make(extents):
    need = [(c + PS - 1) // PS for _, c in extents]
    per_set = sum(need)
    kv = KVCache(num_layers=1, num_pages=per_set * SETS, page_size=PS, num_kv_heads=KVH, head_dim=D,
                 dtype=DT, device=DEV)  # fmt: skip
    kv.k.normal_()
    kv.v.normal_()
    perm = torch.randperm(per_set * SETS).tolist()
    starts = [0]
    for q_len, _ in extents:
        starts.append(starts[-1] + q_len)
    seqs = tuple(SeqExtent(starts[i], q, c) for i, (q, c) in enumerate(extents))
    fbs = []
    for s in range(SETS):
        mine = perm[s * per_set : (s + 1) * per_set]
        table = torch.zeros((len(extents), max(need)), dtype=torch.int64)
        i = 0
        for b, n in enumerate(need):
            table[b, :n] = torch.tensor(mine[i : i + n])
            i += n
        dummy = torch.zeros(1, dtype=torch.int64, device=DEV)
        fbs.append(ForwardBatch(dummy, dummy, dummy, table.to(DEV), dummy, seqs))
    q = torch.randn((starts[-1], H, D), device=DEV, dtype=DT)
    return kv, fbs, q, seqs


def floors(extents):
    kv_bytes = sum(c for _, c in extents) * KVH * D * 2 * 2
    qo_bytes = sum(q for q, _ in extents) * H * D * 2 * 2
    flops = sum(4 * H * D * sum(c - q + 1 + i for i in range(q)) for q, c in extents)
    t_mem = (kv_bytes + qo_bytes) / (results["copy_TBps"] * 1e12) * 1e6
    t_mma = flops / (results["bf16_mm_TFLOPs"] * 1e12) * 1e6
    return kv_bytes + qo_bytes, flops, t_mem, t_mma


def run_case(name, extents, variants=(), window=None):
    kv, fbs, q, seqs = make(extents)
    scale = D**-0.5
    args = lambda p: ([s.q_start for s in seqs], [s.q_len for s in seqs], [s.ctx_len for s in seqs])
    t0 = time.perf_counter()
    for _ in range(20):
        pa.plan_attention(*args(None), num_heads=H, num_kv_heads=KVH, device=DEV)
    plan_us = (time.perf_counter() - t0) / 20 * 1e6
    row = {"case": name, "plan_host_us": plan_us}
    nbytes, flops, t_mem, t_mma = floors(extents)
    row.update(bytes=nbytes, flops=flops, floor_mem_us=t_mem, floor_mma_us=t_mma)

    def triton_fns(block_m=None, num_splits=None, config=None):
        plans = [pa.plan_attention(*args(None), num_heads=H, num_kv_heads=KVH, device=DEV, block_m=block_m,
                                   num_splits=num_splits) for _ in fbs]  # fmt: skip
        return plans, [
            (lambda fb=fb, p=p: pa.paged_attention(q, kv.k[0], kv.v[0], fb.page_table, p, page_size=PS,
                                                   scale=scale, sliding_window=window, config=config))
            for fb, p in zip(fbs, plans, strict=True)
        ]  # fmt: skip

    plans, fns = triton_fns()
    out = fns[0]()
    ref = pa.paged_attention_ref(q.float(), kv.k[0].float(), kv.v[0].float(), fbs[0].page_table,
                                 [(s.q_start, s.q_len, s.ctx_len) for s in seqs], page_size=PS, scale=scale,
                                 sliding_window=window).float()  # fmt: skip
    loop = torch_paged_attention(q, kv, 0, fbs[0], scale, window).float()
    torch.cuda.synchronize()
    row["rel_err_vs_fp32_ref"] = float((out.float() - ref).norm() / ref.norm())
    row["torch_loop_rel_err"] = float((loop - ref).norm() / ref.norm())
    row["auto"] = dict(block_m=plans[0].block_m, splits=plans[0].num_splits,
                       cfg=pa.attention_config(plans[0], D).__dict__)  # fmt: skip
    row["triton_us"] = bench(None, fns)
    row["torch_us"] = bench(
        None, [lambda fb=fb: torch_paged_attention(q, kv, 0, fb, scale, window) for fb in fbs]
    )
    row["variants"] = []
    for bm, ns, cfg in variants:
        try:
            _, vf = triton_fns(bm, ns, pa.AttentionConfig(*cfg) if cfg else None)
            o = vf[0]()
            torch.cuda.synchronize()
            err = float((o.float() - ref).norm() / ref.norm())
            row["variants"].append(dict(block_m=bm, splits=ns, cfg=cfg, us=bench(None, vf), err=err))
        except Exception as e:  # noqa: BLE001
            row["variants"].append(dict(block_m=bm, splits=ns, cfg=cfg, error=repr(e)[:300]))
    results.setdefault("cases", []).append(row)


def main():
    ceilings()
    dec = [(None, None, (n, 4, s)) for n in (32, 64, 128) for s in (2, 3)] + [
        (None, 2, None),
        (32, None, None),
    ]
    pre = [(bm, None, (bn, w, s)) for bm, bn, w, s in [(64, 64, 4, 3), (64, 32, 4, 2), (64, 128, 8, 2),
           (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2), (128, 128, 8, 2), (64, 64, 8, 2)]]  # fmt: skip
    cases = [
        ("decode 64 x ctx 512", [(1, 512)] * 64, dec),
        ("prefill 2048", [(2048, 2048)], pre),
        ("decode 256 x ctx 1024", [(1, 1024)] * 256, dec[:4]),
        ("chunk 512@2048 + 63 dec@1024", [(512, 2048)] + [(1, 1024)] * 63, pre[:4]),
        ("decode 1 x ctx 8192", [(1, 8192)], [(None, 1, None), (None, 4, None), (None, 32, None)]),
        ("decode 64 x 512, window 256", [(1, 512)] * 64, []),
    ]
    for name, ext, var in cases:
        w = 256 if "window" in name else None
        try:
            run_case(name, ext, var, window=w)
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            results.setdefault("cases", []).append({"case": name, "error": repr(e)[:500]})
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "bench.json"), "w") as f:
            json.dump(results, f, indent=1)
    try:
        for _key, kern in pa._paged_attention_kernel.device_caches.items():
            for ck in kern[0].values():
                print("regs/spills", ck.n_regs, ck.n_spills, ck.metadata.num_warps, ck.metadata.shared)
    except Exception as e:  # noqa: BLE001
        print("no resource report:", repr(e)[:200])
    print(
        f"\n{results['device']}: copy {results['copy_TBps']:.2f} TB/s, "
        f"bf16 mm {results['bf16_mm_TFLOPs']:.0f} TFLOP/s"
    )
    print(f"{'case':32s} {'torch us':>9s} {'triton us':>9s} {'speedup':>7s} {'floor us':>8s} {'GB/s':>6s} "
          f"{'TFLOP/s':>7s} {'err':>8s} {'best variant':>28s}")  # fmt: skip
    for r in results["cases"]:
        if "error" in r:
            print(f"{r['case']:32s} ERROR {r['error'][:200]}")
            continue
        best = min([v for v in r["variants"] if "us" in v], key=lambda v: v["us"], default=None)
        bs = f"{best['block_m']},{best['splits']},{best['cfg']}:{best['us']:.1f}" if best else "-"
        speedup = r["torch_us"] / r["triton_us"]
        floor = max(r["floor_mem_us"], r["floor_mma_us"])
        gbps, tflops = r["bytes"] / r["triton_us"] / 1e3, r["flops"] / r["triton_us"] / 1e6
        print(f"{r['case']:32s} {r['torch_us']:9.1f} {r['triton_us']:9.1f} {speedup:7.1f} {floor:8.1f} "
              f"{gbps:6.0f} {tflops:7.1f} {r['rel_err_vs_fp32_ref']:8.1e} {bs:>28s}")  # fmt: skip


if __name__ == "__main__":
    main()
