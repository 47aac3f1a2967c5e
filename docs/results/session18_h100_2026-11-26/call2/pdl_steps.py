"""A step's LoRA kernels with and without programmatic dependent launch (PDL), one process, one CUDA graph
per variant (median µs), in two chains: the LoRA kernels alone (as session 15's steps_ab.py) and each
group's base GEMM (cuBLAS, F.linear) before its shrink and expand, as the model runs them. Each variant's
outputs must equal the PDL-off graph's bit for bit (a race would show here). A measurement script for
the session-18 working copy, whose kernels read the EXP_* switches (not runtime code).
    python docs/results/session18_h100_2026-11-26/call2/pdl_steps.py"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.getcwd())

import kernels.lora_expand as ke  # noqa: E402
import kernels.lora_shrink as ks  # noqa: E402
from kernels import device_info  # noqa: E402
from stages.worker.lora.triton_backend import TritonLoraBackend  # noqa: E402
from stages.worker.step_inputs import token_buckets  # noqa: E402
from tools.bench_lora_step import layout_for, make_pool, make_step  # noqa: E402

STEPS = (
    ("S1-like decode: 155 rank-16 adapters, 186 decodes", 155, [16], 186, [], "auto"),
    ("S2-like decode: 62 adapters of ranks 8-64, 256 decodes", 62, [8, 16, 32, 64], 256, [], "auto"),
    (
        "S2-like mixed: 80 adapters, 190 decodes + 512 + 256 prefill",
        80,
        [8, 16, 32, 64],
        190,
        [512, 256],
        None,
    ),
    ("32 rank-16 adapters, 64 decodes + 31 x 256 prefill", 32, [16], 64, [256] * 31, None),
    ("16 rank-64 adapters, 256 decodes", 16, [64], 256, [], "auto"),
    ("40 adapters of ranks 8-64, 128 decodes", 40, [8, 16, 32, 64], 128, [], "auto"),
    ("128 rank-16 adapters, 256 decodes", 128, [16], 256, [], "auto"),
    ("8 rank-16 adapters, 256 decodes", 8, [16], 256, [], "auto"),
)
# (shrink launched with PDL, shrink's trigger: 0 none / 1 top / 2 after its K loop, expand with PDL,
# expand triggers at its top)
MODES = {
    "off": None,
    "M1": (True, 1, True, True),
    "M2": (True, 1, True, False),
    "M4": (False, 1, True, False),
    "M5": (False, 2, True, False),
}
ORDER = ["off", "M1", "M2", "M4", "M5", "M5", "M4", "M2", "M1", "off"]


def set_mode(name: str) -> None:
    mode = MODES[name]
    os.environ["LORAPIPE_PDL"] = "0" if mode is None else "1"
    device_info.pdl.cache_clear()
    if mode is not None:
        ks.EXP_PDL_SHRINK, ks.EXP_TRIGGER_SHRINK, ke.EXP_PDL_EXPAND, ke.EXP_TRIGGER_EXPAND = mode


def measure(label, n_ad, ranks, decodes, prefill, tile_class) -> None:
    dev = torch.device("cuda")
    layout = layout_for("1b", max(ranks))
    pool, _ = make_pool(layout, 4 << 30, n_ad, ranks, dev, 0)
    indptr, slots = make_step(n_ad, decodes, prefill, 0)
    bucket = next(b for b in token_buckets(8192) if b >= indptr[-1])
    backend = TritonLoraBackend(pool, max_tokens=8192, max_seqs=256)
    backend.prepare(indptr, slots, pad_to=bucket, tile_class=tile_class)
    gen = torch.Generator(device=dev).manual_seed(0)
    xs = {
        g.name: torch.randn((bucket, g.in_dim), device=dev, dtype=torch.bfloat16, generator=gen)
        for g in layout.groups
    }
    ws = {
        g.name: torch.randn((g.out_total, g.in_dim), device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        for g in layout.groups
    }
    outs = {
        g.name: torch.zeros((bucket, g.out_total), device=dev, dtype=torch.bfloat16) for g in layout.groups
    }

    def lora_only():
        for layer in range(layout.num_layers):
            for g in layout.groups:
                backend.apply(xs[g.name], outs[g.name], layer, g)
        return [outs[g.name] for g in layout.groups]

    def with_gemm():
        last = []
        for layer in range(layout.num_layers):
            last = []
            for g in layout.groups:
                y = F.linear(xs[g.name], ws[g.name])
                backend.apply(xs[g.name], y, layer, g)
                last.append(y)
        return last

    results: dict[tuple[str, str], list[float]] = {}
    refs: dict[str, list[torch.Tensor]] = {}
    for name in ORDER:
        set_mode(name)
        for chain, fn in (("lora", lora_only), ("gemm", with_gemm)):
            for o in outs.values():
                o.zero_()
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = fn()
            for o in outs.values():
                o.zero_()
            g.replay()
            torch.cuda.synchronize()
            snap = [t.clone() for t in got]
            key = f"{chain}"
            if name == "off" and key not in refs:
                refs[key] = snap
            elif not all(torch.equal(a, b) for a, b in zip(refs[key], snap, strict=True)):
                print(f"  MISMATCH {label} {chain} {name}", flush=True)
            us = triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3
            results.setdefault((chain, name), []).append(us)
            del g
    for chain in ("lora", "gemm"):
        off = sum(results[(chain, "off")]) / 2
        parts = []
        for name in MODES:
            v = results[(chain, name)]
            med = sum(v) / len(v)
            parts.append(
                f"{name} {med:8.1f}" + ("" if name == "off" else f" ({(med / off - 1) * 100:+5.1f}%)")
            )
        print(f"{label[:58]:58s} {chain:4s} " + "  ".join(parts), flush=True)


if __name__ == "__main__":
    for s in STEPS:
        measure(*s)
