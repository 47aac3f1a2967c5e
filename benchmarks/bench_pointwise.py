"""Device time of the forward's pointwise ops per layer, the torch form against the fused Triton kernels
(`stages/worker/model/pointwise.py`), on a model's shapes at several token counts: RMSNorm, the residual
add + RMSNorm, rotary + K/V write, SiLU-mul. Each op is captured 20 times back to back in a CUDA graph and
the replay timed with CUDA events (median of --reps replays), so host launch costs are not counted; the
bytes each op must move (its inputs once, its outputs once) give the achieved bandwidth.

    python -m benchmarks.bench_pointwise --preset 1b --tokens 256,2048,8192 --out pointwise.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.synthetic.model import PRESETS  # noqa: E402
from stages.worker.graph_capture import recording  # noqa: E402
from stages.worker.model.kv_cache import KVCache  # noqa: E402
from stages.worker.model.pointwise import TorchPointwise, TritonPointwise  # noqa: E402

INNER = 20  # launches of one op per graph replay


def shapes(preset: str) -> dict[str, int]:
    c = PRESETS[preset]
    heads = c["num_attention_heads"]
    return {
        "hidden": c["hidden_size"],
        "heads": heads,
        "kv_heads": c["num_key_value_heads"],
        "head_dim": c.get("head_dim", c["hidden_size"] // heads),
        "inter": c["intermediate_size"],
    }


BACKENDS = {"torch": TorchPointwise, "triton": TritonPointwise}


def cases(s: dict[str, int], T: int, device, dtype):
    """(name, {backend: thunk}, bytes the op must move) per op, on random operands."""
    H, D, nh, nkv, inter = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["inter"]
    x = torch.randn((T, H), device=device, dtype=dtype)
    d = torch.randn((T, H), device=device, dtype=dtype)
    w = torch.rand((H,), device=device, dtype=dtype) + 0.5
    qkv = torch.randn((T, (nh + 2 * nkv) * D), device=device, dtype=dtype)
    cos = torch.rand((T, 1, D), device=device, dtype=dtype)
    sin = torch.rand((T, 1, D), device=device, dtype=dtype)
    pages = T // 16 + 2
    kv = KVCache(
        num_layers=1, num_pages=pages, page_size=16, num_kv_heads=nkv, head_dim=D, dtype=dtype, device=device
    )
    rows = torch.randperm(kv.scratch_row, device=device)[:T]
    gate_up = torch.randn((T, 2 * inter), device=device, dtype=dtype)
    e = x.element_size()
    ops = {
        "rms_norm": (2 * T * H * e, lambda o: o.norm(x, w, 1e-5)),
        "add_rms_norm": (4 * T * H * e, lambda o: o.add_norm(x, d, w, 1e-5)),
        "rope_kv_write": (2 * qkv.numel() * e, lambda o: o.rope_kv(qkv, cos, sin, rows, kv, 0, nh, nkv)),
        "silu_mul": (3 * T * inter * e, lambda o: o.act(gate_up)),
    }
    return [
        (name, {b: (lambda c=call, o=impl: c(o)) for b, impl in BACKENDS.items()}, moved)
        for name, (moved, call) in ops.items()
    ]


def time_graph(thunk, reps: int) -> float:
    """Median µs of one launch of `thunk`, from replays of a graph of INNER launches."""
    thunk()  # compile / warm the allocator
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        thunk()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with recording(graph):
        for _ in range(INNER):
            thunk()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / INNER)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default="256,2048,8192", help="comma-separated token counts")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    dtype = getattr(torch, a.dtype)
    s = shapes(a.preset)
    rows = []
    print("| tokens | op | torch µs | triton µs | speed-up | triton GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for T in (int(t) for t in a.tokens.split(",")):
        total = {"torch": 0.0, "triton": 0.0}
        for name, thunks, moved in cases(s, T, torch.device("cuda"), dtype):
            us = {b: time_graph(f, a.reps) for b, f in thunks.items()}
            for b in total:
                total[b] += us[b]
            gbs = moved / us["triton"] / 1e3
            rows.append({"tokens": T, "op": name, **{f"{b}_us": v for b, v in us.items()}, "triton_gbs": gbs})
            ratio = us["torch"] / us["triton"]
            print(f"| {T} | {name} | {us['torch']:.1f} | {us['triton']:.1f} | {ratio:.2f}× | {gbs:.0f} |")
        # A layer runs each op once (the torch form's residual add is inside its add_rms_norm case).
        ratio = total["torch"] / total["triton"]
        print(f"| {T} | per layer | {total['torch']:.1f} | {total['triton']:.1f} | {ratio:.2f}× | |")
        rows.append({"tokens": T, "op": "per layer", **{f"{b}_us": v for b, v in total.items()}})
    if a.out is not None:
        a.out.write_text(json.dumps({"preset": a.preset, "dtype": a.dtype, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
