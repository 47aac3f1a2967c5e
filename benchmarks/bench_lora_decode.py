"""One decode step of a Llama-shaped model (random bf16 weights), as the worker runs it: the decode CUDA
graph of its batch bucket (`stages/worker/decode_graphs.py`), replayed, base-only against each LoRA
design of the Triton backend (`TritonLoraBackend.design`: "serial", "side", "fused"; "serial-nopdl" is
"serial" with programmatic dependent launch off), sequence i on adapter i % N (rank-R adapters at
scattered pool rows), every variant in one process, measured in rounds of alternating order (A-B-B-A).

    python -m benchmarks.bench_lora_decode OUT_DIR [--cases 8b:16:4,8b:64:4,1b:64:32,1b:256:32]
        [--designs serial,serial-nopdl,side,fused] [--rank 16] [--lora-dtype auto|fp8|int8] [--ctx 512]
        [--rounds 6] [--smoke] [--tile-classes 8,32,128] [--fused-programs-per-sm 8]

Per case: the median µs of one step, the LoRA overhead (step / base-only - 1), base-only / step, the
bytes bound of that ratio (weights / (weights + the distinct adapters' rows)) and the fraction of it
reached, and each design's logits against "serial" (max abs difference: 0 where the kernels are the
same). A variant whose step does not finish within HANG_SECONDS stops the run with a message. Prints
one table, writes OUT_DIR/lora_decode.json and OUT_DIR/lora_decode.txt."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_lora_step import layout_for, make_pool  # noqa: E402
from kernels import device_info, lora_fused  # noqa: E402
from kernels.lora_quant import NUM_SCALES, QUANT_DTYPES  # noqa: E402
from runtime.common.model_config import ModelConfig  # noqa: E402
from runtime.synthetic.model import build_config  # noqa: E402
from stages.worker.decode_graphs import DecodeGraphs  # noqa: E402
from stages.worker.lora import tiles  # noqa: E402
from stages.worker.lora.triton_backend import DESIGNS, TritonLoraBackend  # noqa: E402
from stages.worker.model.kv_cache import KVCache  # noqa: E402
from stages.worker.model.llama import LlamaModel  # noqa: E402
from stages.worker.model.weights import LayerWeights, ModelWeights  # noqa: E402
from stages.worker.seq_input import SeqInput  # noqa: E402

PAGE = 16
HANG_SECONDS = 60.0
VARIANTS = (*DESIGNS, "serial-nopdl")


def random_model(cfg: ModelConfig, device: torch.device, seed: int) -> LlamaModel:
    """The Llama forward over random bf16 weights (std 0.02, norms 1) with the Triton attention and
    pointwise kernels, as the worker builds it on CUDA."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).mul_(0.02)

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    ones = torch.ones(h, device=device, dtype=torch.bfloat16)
    layers = [
        LayerWeights(ones, w(q + 2 * kv, h), None, w(h, q), None, ones, w(2 * i, h), None, w(h, i), None)
        for _ in range(cfg.num_layers)
    ]
    embed = w(cfg.vocab_size, h)
    lm_head = embed if cfg.tie_word_embeddings else w(cfg.vocab_size, h)
    weights = ModelWeights(embed=embed, layers=layers, norm=ones, lm_head=lm_head)
    backend = "triton"
    return LlamaModel(cfg, weights, None, attention_backend=backend, pointwise_backend=backend)


def weight_bytes(cfg: ModelConfig) -> int:
    """Bytes a decode step reads of the base weights (bf16): every projection and the LM head."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * (cfg.num_heads * d + 2 * cfg.num_kv_heads * d) + cfg.num_heads * d * h + 3 * h * i
    return 2 * (cfg.num_layers * per_layer + cfg.vocab_size * h)


def make_backend(pool, variant: str, max_seqs: int) -> TritonLoraBackend:
    """The backend of a variant; "serial-nopdl" is built (and its graphs captured) with LORAPIPE_PDL=0."""
    design = "serial" if variant == "serial-nopdl" else variant
    return TritonLoraBackend(pool, max_tokens=2048, max_seqs=max_seqs, design=design)


class NoPdl:
    """LORAPIPE_PDL=0 while the configs are made and the graphs captured (the launches keep it)."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            self.saved = os.environ.get(device_info.PDL_ENV)
            os.environ[device_info.PDL_ENV] = "0"
            device_info.pdl.cache_clear()

    def __exit__(self, *exc):
        if self.on:
            if self.saved is None:
                os.environ.pop(device_info.PDL_ENV, None)
            else:
                os.environ[device_info.PDL_ENV] = self.saved
            device_info.pdl.cache_clear()


def finish(device: torch.device, what: str, seconds: float = HANG_SECONDS) -> None:
    """Wait for the device's queued work, polling: a step that has not finished within `seconds` (a
    kernel waiting forever) ends the process with a message rather than hanging the machine."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            print(f"{what}: the GPU did not finish within {seconds:.0f} s; stopping", flush=True)
            os._exit(3)
        time.sleep(0.001)


def step_runner(model, kv, backend, seqs, ctx: int, capture: bool, what: str):
    """A callable running one decode step of `seqs` (the captured graph's replay on CUDA), and the
    step's logits (float32 [B, V], a copy). The step runs eagerly once before it is captured, and the
    graph once after, each watched for a hang. The callable holds the DecodeGraphs that owns the
    graph's input buffers."""
    kw = dict(max_batch=len(seqs), max_model_len=ctx + 2 * PAGE)
    eager = DecodeGraphs(model, kv, backend, capture=False, **kw)
    logits = eager.run(seqs).clone()
    finish(kv.k.device, f"{what}, eager")
    if not capture:
        return (lambda: eager.run(seqs)), logits
    graphs = DecodeGraphs(model, kv, backend, capture=True, **kw)
    logits = graphs.run(seqs).clone()
    finish(kv.k.device, f"{what}, graphed")
    (graph,) = graphs.graphs.values()

    def replay() -> None:
        # the graph reads the input buffers `graphs` owns: the closure keeps them from being freed and
        # their memory handed to the next variant's tensors while the graph still replays
        graphs.replays += 1
        graph.replay()

    return replay, logits


def time_us(fn, device: torch.device, iters: int, what: str) -> float:
    """Mean µs of one call over `iters` back-to-back calls (after three on CUDA)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e6
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    finish(device, what)
    return start.elapsed_time(end) / iters * 1e3


def run_case(preset, batch, n_ad, a, device, model, cfg) -> dict:
    layout = layout_for(preset, a.rank)
    model.lora_layout = layout
    pool, _ = make_pool(layout, int(a.pool_gb * 2**30), n_ad, [a.rank], device, a.seed, a.lora_dtype)
    pages = a.ctx // PAGE + 2
    kv = KVCache(
        num_layers=cfg.num_layers, num_pages=batch * pages, page_size=PAGE, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=torch.bfloat16, device=device,
    )  # fmt: skip

    def seqs(lora: bool) -> list[SeqInput]:
        out = [
            SeqInput([7 + i], a.ctx, list(range(i * pages, (i + 1) * pages)), i % n_ad if lora else -1)
            for i in range(batch)
        ]
        return sorted(out, key=lambda s: s.slot)  # each adapter's tokens contiguous

    runners, logits, classes = {}, {}, {}
    case = f"{preset} b{batch} {n_ad}x"
    runners["base-only"], logits["base-only"] = step_runner(
        model, kv, None, seqs(False), a.ctx, a.capture, f"{case} base-only"
    )
    for variant in a.designs:
        with NoPdl(variant == "serial-nopdl"):
            backend = make_backend(pool, variant, max(a.max_seqs, batch))
            runners[variant], logits[variant] = step_runner(
                model, kv, backend, seqs(True), a.ctx, a.capture, f"{case} {variant}"
            )
            classes[variant] = backend.tile_class  # the LoRA tile class the step's graph was made for
    samples: dict[str, list[float]] = {k: [] for k in runners}
    order = list(runners)
    for r in range(a.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            samples[name].append(time_us(runners[name], device, a.iters, f"{case} {name}"))
    us = {k: statistics.median(v) for k, v in samples.items()}
    # the distinct adapters' rows: bf16, or 8-bit with an fp32 scale per slice's A and B^T row
    row = layout.row_elems * 2 if pool.scales is None else layout.row_elems + 4 * NUM_SCALES
    adapter_bytes = n_ad * a.rank * row * layout.num_layers
    wb = weight_bytes(cfg)
    ref = logits.get("serial")
    rows = []
    for name, t in us.items():
        diff = None if ref is None or name == "base-only" else float((logits[name] - ref).abs().max())
        rows.append(
            dict(
                variant=name,
                us=t,
                samples=samples[name],
                overhead_pct=100 * (t / us["base-only"] - 1),
                vs_base=us["base-only"] / t,
                fraction_of_bound=us["base-only"] / t / (wb / (wb + adapter_bytes)),
                logits_max_diff_vs_serial=diff,
                tile_class=classes.get(name),
            )
        )
    lora_moved = float((logits[a.designs[0]] - logits["base-only"]).abs().max()) if a.designs else None
    return dict(
        preset=preset, batch=batch, adapters=n_ad, rank=a.rank, lora_dtype=a.lora_dtype, ctx=a.ctx,
        weight_bytes=wb, adapter_bytes=adapter_bytes, bound_vs_base=wb / (wb + adapter_bytes),
        lora_logits_max_change=lora_moved, rows=rows,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--cases", default="8b:16:4,8b:64:4,1b:64:32,1b:256:32", help="preset:batch:adapters,...")
    p.add_argument("--designs", default="serial,serial-nopdl,side,fused", help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-dtype", choices=("auto", *QUANT_DTYPES), default="auto", help="the pool's rows")
    p.add_argument("--ctx", type=int, default=512, help="tokens each sequence has in the KV cache")
    p.add_argument(
        "--max-seqs", type=int, default=64, help="the runner's max_running_requests (at least batch)"
    )
    p.add_argument("--pool-gb", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=50, help="replays per timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, eager on the CPU: checks the script")
    p.add_argument(
        "--tile-classes", default=None, metavar="N,N,...", help="A/B: the padded batches' LoRA tile classes "
        "(stages/worker/lora/tiles.py's TILE_CLASSES), for every variant of the run",
    )  # fmt: skip
    p.add_argument(
        "--fused-programs-per-sm", type=int, default=None, metavar="N",
        help="A/B: the fused launch's programs an SM (kernels/lora_fused.py's PROGRAMS_PER_SM)",
    )  # fmt: skip
    a = p.parse_args(argv)
    a.designs = [d for d in a.designs.split(",") if d]
    bad = [d for d in a.designs if d not in VARIANTS]
    if bad:
        p.error(f"unknown design(s) {bad}: choose from {', '.join(VARIANTS)}")
    cases = [(c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2])) for c in a.cases.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a.capture = device.type == "cuda"
    if a.smoke:
        cases = [("tiny", b, n) for _, b, n in cases[:1]] or [("tiny", 4, 2)]
        a.ctx, a.rounds, a.iters, a.pool_gb = 32, 1, 1, 0.002
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, models = [], {}
    with torch.inference_mode(), knobs(a):
        for preset, batch, n_ad in cases:
            if preset not in models:
                models.clear()  # one model resident at a time
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                cfg = ModelConfig.from_dict(build_config("llama", preset, dtype="bfloat16"))
                models[preset] = (random_model(cfg, device, a.seed), cfg)
            model, cfg = models[preset]
            results.append(run_case(preset, batch, n_ad, a, device, model, cfg))
            print(table([results[-1]]), flush=True)
    text = table(results)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    summary = dict(device=name, args={k: v for k, v in vars(a).items()}, cases=results)
    (out / "lora_decode.json").write_text(json.dumps(summary, indent=1))
    (out / "lora_decode.txt").write_text(f"{name}\n{text}\n")
    print(f"\n{name}\n{text}")


@contextlib.contextmanager
def knobs(a):
    """The run's A/B settings of module constants, put back when it ends."""
    saved = tiles.TILE_CLASSES, lora_fused.PROGRAMS_PER_SM
    if a.tile_classes:
        tiles.TILE_CLASSES = tuple(int(c) for c in a.tile_classes.split(","))
    if a.fused_programs_per_sm:
        lora_fused.PROGRAMS_PER_SM = a.fused_programs_per_sm
    try:
        yield
    finally:
        tiles.TILE_CLASSES, lora_fused.PROGRAMS_PER_SM = saved


def table(results: list[dict]) -> str:
    lines = [
        "| case | variant | step µs | LoRA overhead | vs base-only | bytes bound | fraction of bound "
        "| logits vs serial |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in results:
        case = f"{c['preset']} b{c['batch']} {c['adapters']}x r{c['rank']}"
        for r in c["rows"]:
            diff = "" if r["logits_max_diff_vs_serial"] is None else f"{r['logits_max_diff_vs_serial']:.1e}"
            lines.append(
                f"| {case} | {r['variant']} | {r['us']:,.1f} | {r['overhead_pct']:+.1f} % | "
                f"{r['vs_base']:.3f} | {c['bound_vs_base']:.3f} | {r['fraction_of_bound']:.3f} | {diff} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
