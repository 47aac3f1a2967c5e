"""Session 9 (CPU, development machine): where one part-writer's time goes in a load, and how fast torch
transposes B. From the repository root:
    .venv/bin/python docs/results/session9_cpu_2026-11-26/loader_profile.py
Part 1 times the phases of `block_writer.write_all` (one thread, one intra-op thread, as a writer runs)
for a generated 1B-shaped bf16 adapter of rank 16 and 64: the header plan, the positioned reads, the value
checks (aminmax) and the packing copies. Part 2 times the packing copy of a B run ([16 layers, out, r] →
rows of [r, out]) against a plain copy of the same bytes, and blocked variants of the transpose."""

import collections
import json
import tempfile
import time
from pathlib import Path

import torch

import stages.loader.block_writer as bw
from runtime.common.lora_layout import LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.model import build_config
from stages.loader.adapter_reader import plan_adapter

torch.set_num_threads(1)
REPS = 7
spent: collections.Counter = collections.Counter()


def timed_fn(name):
    f = getattr(bw, name)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t

    setattr(bw, name, g)


for n in ("read_exact", "_peak", "_copy"):
    timed_fn(n)

print("## Part 1: one load on one thread, ms per load (median of", REPS, "after one warm-up)")
with tempfile.TemporaryDirectory() as work:
    model = Path(work) / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_config("llama", "1b")))
    cfg = ModelConfig.from_dir(model)
    layout = LoraLayout.for_model(cfg, 64)
    for r in (16, 64):
        (path,) = make_adapters(model, Path(work), n=1, ranks=(r,), dtype="bfloat16", prefix=f"r{r}_")
        block = torch.empty(layout.num_layers, r, layout.row_elems, dtype=torch.bfloat16)
        buf = bw.SegmentBuffer()
        runs = []
        for rep in range(REPS + 1):
            spent.clear()
            t0 = time.perf_counter()
            with plan_adapter("x", path, cfg, layout, torch.bfloat16) as plan:
                spent["plan"] += time.perf_counter() - t0
                bw.write_all(plan, block, buf)
            spent["total"] += time.perf_counter() - t0
            if rep:
                runs.append(dict(spent))
        runs.sort(key=lambda d: d["total"])
        med = runs[len(runs) // 2]
        mb = block.numel() * 2 / 1e6
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in med.items() if k != "total")
        total = med["total"]
        print(f"rank {r}: {mb:.1f} MB in {total * 1e3:.2f} ms ({mb / 1e3 / total:.2f} GB/s): {parts}")


def bench(f, n=10):
    f()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return sorted(out)[n // 2]


def pack_rates(r: int, out: int, layers: int = 16) -> tuple[float, float, float, int, float]:
    """GB/s of a plain copy, today's transposing copy, the best blocked one (and its chunk), numpy's."""
    src = torch.randn(layers, out, r).to(torch.bfloat16)
    dst = torch.empty(layers, r, 100_000, dtype=torch.bfloat16)[:, :, :out]  # rows of a packed block
    nb = src.numel() * 2
    flat = torch.empty_like(src)
    plain = nb / bench(lambda: flat.copy_(src)) / 1e9
    today = nb / bench(lambda: dst.copy_(src.transpose(1, 2))) / 1e9
    best = (0.0, 0)
    for c in (64, 128, 256, 512):

        def chunked(c: int = c) -> None:
            for o in range(0, out, c):
                dst[:, :, o : o + c].copy_(src[:, o : o + c, :].transpose(1, 2))

        best = max(best, (nb / bench(chunked) / 1e9, c))
    s16, d16 = src.view(torch.int16).numpy(), dst.view(torch.int16).numpy()
    npy = nb / bench(lambda: d16.__setitem__(slice(None), s16.transpose(0, 2, 1))) / 1e9
    assert torch.equal(dst, src.transpose(1, 2))
    return plain, today, best[0], best[1], npy


print("\n## Part 2: packing one B run of 16 layers, GB/s (median of 10)")
print("| r | out | plain copy | transposing copy (today) | best blocked (out in chunks of C) | numpy |")
print("| --- | --- | --- | --- | --- | --- |")
for r in (16, 32, 64):
    for out in (2048, 8192):
        plain, today, blocked, c, npy = pack_rates(r, out)
        print(f"| {r} | {out} | {plain:.1f} | {today:.2f} | {blocked:.2f} (C={c}) | {npy:.2f} |")
