"""The fp8 GEMMs alone at the 8B projection shapes (qkv, o, gate_up, down), against bf16, on one GPU:

    python -m benchmarks.bench_fp8_gemm OUT_DIR [--ms 1 16 32 64 128 512 2048] [--no-sweep] [--iters 50]

For each projection and token count M: bf16 `F.linear`; the per-token activation quantization alone;
`torch._scaled_mm` alone and with the quantization (the path above kernels.fp8_gemm.MAX_M tokens); the
weight-only kernel (`kernels/fp8_gemm.py`) with its chosen config, the codes widened by bit moves and by
Triton's conversion, and its w8a8 variant (x quantized per token and K block in the kernel, an fp8
MMA); and `fp8_linear`, what serving runs. Microseconds per call, each a CUDA-graph replay of --iters
calls that cycle over copies of the weight larger than L2 together (every call reads its weight from
device memory, as a forward does), and each as a fraction of its bytes floor: the bytes it must move
(weights, input, output) at the copy bandwidth `tools/roofline.py` probes.
--sweep (default on) also times a fixed grid of the kernel's tiles, K splits and pipeline depths at
every M up to 128 (M = 128: the crossover against `_scaled_mm`, beyond what serving sends it; the w8a8
variant of each tile too), the best per projection and M against the chosen one. Each kernel result's
relative error against float32 products of the dequantized weights and the unquantized input is
recorded (w8a8: the activations' e4m3 error). One table; everything goes to OUT_DIR/fp8_gemm.json."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.fp8_gemm import TILE_MAX_M, GemmConfig, choose_config, split_for, w8a16_matmul
from kernels.fp8_quant import quantize_per_token
from stages.worker.model.linear import fp8_linear, quantize_weight
from tools.roofline import probe_bandwidth

# (name, N, K) of one Llama-3-8B layer: hidden 4096, 32 heads, 8 KV heads of 128, intermediate 14336
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
COPIES_BYTES = 256 << 20  # the fp8 copies of one weight together: several times an H100's 50 MB L2


def timed_us(fn, args: list, iters: int) -> float:
    """Median over 3 replays of a CUDA graph of `iters` calls fn(*args[j % len(args)]), µs a call."""
    fn(*args[0])  # compiles, allocates, picks algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(iters):
            fn(*args[j % len(args)])
    graph.replay()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    del graph
    return statistics.median(times)


def candidates(m: int, n: int, k: int, sms: int) -> list[GemmConfig]:
    """The sweep's grid for m tokens: block_n x block_k x pipeline depth (codes widened by bit moves; the
    main rows time Triton's conversion), each at the split rule's count, at the count that just spills
    into a second wave and at twice the rule's (capped by K), and the chosen config."""
    bm = max(16, 1 << (m - 1).bit_length())
    out = {choose_config(m, n, k, sms)} if m <= TILE_MAX_M else set()
    for bn, bk, stages in itertools.product((32, 64, 128), (128, 256), (3, 4)):
        smem = stages * (bn * bk + bm * bk * 2)
        if smem > 200 << 10 or (bm >= 128 and bn * bk > 64 * 128):  # beyond an H100's shared memory
            continue
        warps = 8 if bn * bm >= 128 * 64 else 4
        base = split_for(n, k, bn, bk, sms)
        more = -(-2 * sms // -(-n // bn))  # the splits that make a second, partial wave
        for split in sorted({base, min(more, k // bk), min(2 * base, k // (2 * bk))} - {0}):
            out.add(GemmConfig(bm, bn, bk, split, warps, stages))
        out.add(GemmConfig(bm, bn, bk, base, warps, stages, a8=True))
    return sorted(out, key=lambda c: (c.a8, c.block_n, c.block_k, c.num_stages, c.split, c.bits))


def scaled_mm(xq_xs: tuple, w8) -> torch.Tensor:
    return torch._scaled_mm(xq_xs[0], w8.q.t(), scale_a=xq_xs[1], scale_b=w8.scale.view(1, -1),
                            out_dtype=torch.bfloat16)  # fmt: skip


def quant_mm(x: torch.Tensor, w8) -> torch.Tensor:
    return scaled_mm(quantize_per_token(x), w8)


def rel_err(out: torch.Tensor, x: torch.Tensor, w8) -> float:
    want = x.float() @ (w8.q.float() * w8.scale[:, None]).t()
    return ((out.float() - want).norm() / want.norm()).item()


def bench_shape(name: str, n: int, k: int, ms: list[int], a: argparse.Namespace, bw: float, sms: int):
    """Rows of one projection at each M, and its sweep rows."""
    copies = -(-COPIES_BYTES // (n * k))
    ws = [(torch.randn((n, k), device="cuda") * 0.02).bfloat16() for _ in range(copies)]
    w8s = [quantize_weight(w) for w in ws]
    fp8_bytes, bf16_bytes = n * k, 2 * n * k
    rows, sweep = [], []
    for m in ms:
        x = torch.randn((m, k), device="cuda").bfloat16()
        xq = quantize_per_token(x)
        act_bytes = 2 * m * k + 2 * m * n  # the input read, the output written

        def frac(us: float, weight_bytes: int, act_bytes: int = act_bytes) -> float:
            return (weight_bytes + act_bytes) / bw * 1e6 / us

        row = {"proj": name, "m": m, "n": n, "k": k}
        row["bf16_us"] = timed_us(F.linear, [(x, w) for w in ws], a.iters)
        row["quant_us"] = timed_us(quantize_per_token, [(x,)], a.iters)
        row["scaled_mm_us"] = timed_us(scaled_mm, [(xq, w8) for w8 in w8s], a.iters)
        row["scaled_mm_quant_us"] = timed_us(quant_mm, [(x, w8) for w8 in w8s], a.iters)
        row["fp8_linear_us"] = timed_us(fp8_linear, [(x, w8) for w8 in w8s], a.iters)
        if m <= TILE_MAX_M:
            chosen = choose_config(m, n, k, sms)
            row["config"] = chosen.__dict__
            for key, change in (
                ("w8a16_us", {}),
                ("w8a16_cast_us", {"bits": False}),
                ("w8a8_us", {"a8": True}),
            ):
                cfg = GemmConfig(**{**chosen.__dict__, **change})
                row[key] = timed_us(lambda x_, w8, c=cfg: w8a16_matmul(x_, w8.q, w8.scale, config=c),
                                    [(x, w8) for w8 in w8s], a.iters)  # fmt: skip
                row[key.replace("_us", "_rel_err")] = rel_err(
                    w8a16_matmul(x, w8s[0].q, w8s[0].scale, config=cfg), x, w8s[0]
                )
        row["floor_frac"] = {
            key: frac(row[key], bf16_bytes if key == "bf16_us" else fp8_bytes)
            for key in (
                "bf16_us",
                "scaled_mm_quant_us",
                "fp8_linear_us",
                "w8a16_us",
                "w8a16_cast_us",
                "w8a8_us",
            )
            if key in row
        }
        row["floor_us"] = (fp8_bytes + act_bytes) / bw * 1e6
        rows.append(row)
        print(f"  {name} m={m}: bf16 {row['bf16_us']:.1f} us, fp8 {row['fp8_linear_us']:.1f} us", flush=True)
        if a.sweep and m <= 2 * TILE_MAX_M:
            for cfg in candidates(m, n, k, sms):
                entry = {"proj": name, "m": m, "config": cfg.__dict__}
                try:
                    entry["us"] = timed_us(lambda x_, w8, c=cfg: w8a16_matmul(x_, w8.q, w8.scale, config=c),
                                           [(x, w8) for w8 in w8s], a.iters)  # fmt: skip
                    entry["frac"] = frac(entry["us"], fp8_bytes)
                    entry["rel_err"] = rel_err(w8a16_matmul(x, w8s[0].q, w8s[0].scale, config=cfg), x, w8s[0])
                except Exception as e:  # a tile the compiler cannot fit is a result too
                    entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                sweep.append(entry)
    del ws, w8s
    torch.cuda.empty_cache()
    return rows, sweep


def cell(row: dict, key: str, width: int = 15) -> str:
    """A time and its fraction of the bytes floor, right-aligned in `width` columns ("-": not run)."""
    if key not in row:
        return f"{'-':>{width}}"
    f = row["floor_frac"]
    return f"{row[key]:>{width - 7}.1f} ({f[key]:.2f})" if key in f else f"{row[key]:>{width}.1f}"


def report(r: dict) -> None:
    print(f"fp8 GEMMs, 8B shapes, {r['device']}, copy bandwidth {r['bandwidth_gb_s']:.0f} GB/s; "
          f"us a call (fraction of the bytes floor)")  # fmt: skip
    print(f"{'proj':<8}{'M':>6}{'floor':>8}{'bf16':>15}{'quant':>7}{'_scaled_mm':>11}{'+quant':>15}"
          f"{'w8a16':>15}{'w8a16 cast':>12}{'w8a8':>12}{'fp8_linear':>15}{'fp8/bf16':>9}")  # fmt: skip
    for row in r["rows"]:
        print(f"{row['proj']:<8}{row['m']:>6}{row['floor_us']:>8.1f}{cell(row, 'bf16_us')}"
              f"{row['quant_us']:>7.1f}{row['scaled_mm_us']:>11.1f}{cell(row, 'scaled_mm_quant_us')}"
              f"{cell(row, 'w8a16_us')}{cell(row, 'w8a16_cast_us', 12)}{cell(row, 'w8a8_us', 12)}"
              f"{cell(row, 'fp8_linear_us')}"
              f"{row['bf16_us'] / row['fp8_linear_us']:>8.2f}x")  # fmt: skip
    print("one layer (qkv + o + gate_up + down), us: bf16 -> fp8_linear")
    for m in sorted({row["m"] for row in r["rows"]}):
        per = [row for row in r["rows"] if row["m"] == m]
        bf, f8 = sum(x["bf16_us"] for x in per), sum(x["fp8_linear_us"] for x in per)
        print(f"  M={m:<6} {bf:8.1f} -> {f8:8.1f}  ({bf / f8:.2f}x)")
    chosen = {(row["proj"], row["m"]): row.get("w8a16_us") for row in r["rows"]}
    for best in r["sweep_best"]:
        mine = chosen.get((best["proj"], best["m"]))
        vs = f"chosen {mine:7.1f} us" if mine is not None else "not served"
        print(f"sweep {best['proj']:<8} m={best['m']:<4} best {best['us']:7.1f} us ({best['frac']:.2f}), "
              f"{vs}: {best['config']}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16, 32, 64, 128, 512, 2048])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = probe_bandwidth()
    result: dict = {"device": torch.cuda.get_device_name(), "sms": sms, "bandwidth_gb_s": bw / 1e9}
    result["rows"], result["sweep"] = [], []
    for name, n, k in SHAPES:
        if name in a.shapes:
            rows, swept = bench_shape(name, n, k, a.ms, a, bw, sms)
            result["rows"] += rows
            result["sweep"] += swept
            best: dict = {}
            for e in result["sweep"]:
                key = (e["proj"], e["m"])
                if "us" in e and (key not in best or e["us"] < best[key]["us"]):
                    best[key] = e
            result["sweep_best"] = [best[key] for key in sorted(best)]
            result["total_s"] = time.perf_counter() - t0
            (a.out / "fp8_gemm.json").write_text(json.dumps(result, indent=1))  # after each projection
    report(result)


if __name__ == "__main__":
    main()
