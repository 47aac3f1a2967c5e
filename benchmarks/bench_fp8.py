"""An fp8 base model against the bf16 one, both engines built in one process on the same checkpoint
(`--quantization fp8` quantizes it at load), with the same rank-16 adapters, measured A-B-B-A:

    python -m benchmarks.bench_fp8 OUT_DIR [--preset 8b] [--device cuda]

- decode: output tokens/s of a batch of B prompts (128 tokens each, 256 new tokens, one adapter each,
  round-robin over 4), B in --batches;
- prefill: prompt tokens/s of 4 prompts of 2,048 tokens (one new token each);
- quality (`fp8_quality.py`), on each weight structure of --structures (random; low-rank: a rank-64
  product carrying most of each projection, plus full-rank noise; ordered: the residual branches'
  output projections scaled by 1/sqrt(2 layers), as GPT-2 initialises them): the next-token
  distributions of 32 prompts of 512 tokens, teacher-forced, on the same adapters (8 prompts each), of
  a float32, a bf16 and an fp8-base engine: mean KL and top-1 agreement of bf16 against fp8 (the
  target), of float32 against bf16 (the noise floor) and against fp8, and the relative error of the
  hidden state after every layer; --quality-only runs only this part;
- the GEMMs alone: bf16 `F.linear` against the fp8 path (`fp8_linear`: weight-only up to
  kernels.fp8_gemm.MAX_M tokens, else per-token quantization + `_scaled_mm`) at the model's projection
  shapes (`bench_fp8_gemm.py` takes them apart).
The checkpoints are made on the device, written to --scratch (default: in the temporary directory),
and removed once read (--keep-checkpoints keeps them). Prints one summary table; everything goes to
OUT_DIR/fp8_bench.json."""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.fp8_quality import (
    MAX_RANK,
    STRUCTURES,
    make_checkpoint,
    model_config,
    quality,
    quality_engine,
)
from kernels.fp8_quant import quantize_per_token
from proto.sampling import SamplingParams
from runtime.offline import LLM
from runtime.synthetic.adapters import make_adapters
from stages.worker.model.linear import fp8_linear, quantize_weight


def engine(model: Path, adapters: dict, device: str, quantization: str | None) -> LLM:
    """An engine for the throughput runs: CUDA graphs, warm-up and a KV cache."""
    return LLM(model, adapters=adapters, device=device, dtype="bfloat16", quantization=quantization,
               max_lora_rank=MAX_RANK, max_running_requests=64, lora_gpu_memory_gb=0.5,
               num_pages=2048,  # 32k tokens: batch 64 x 384, or 4 x 2,049
               prefix_caching=False)  # the rounds repeat the prompts: each must prefill them  # fmt: skip


def timed(llm: LLM, prompts, adapters, max_tokens: int, device: str) -> float:
    """Seconds of one generate call."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, adapters=adapters, sampling=sampling)
    if any(o.error for o in outs) or sum(len(o.token_ids) for o in outs) != len(prompts) * max_tokens:
        raise RuntimeError("a request failed or ended early")
    return time.perf_counter() - start


def abba(engines: dict[str, LLM], prompts, adapters, max_tokens: int, tokens: int, device: str) -> dict:
    """tokens/s of each engine, warmed up once, then bf16, fp8, fp8, bf16."""
    for llm in engines.values():
        timed(llm, prompts, adapters, max_tokens, device)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for kind in ("bf16", "fp8", "fp8", "bf16"):
        rates[kind].append(tokens / timed(engines[kind], prompts, adapters, max_tokens, device))
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"tok_s": rates, "median_tok_s": med, "speedup": med["fp8"] / med["bf16"]}


def _scaled_mm(fast: bool):
    def run(xq_xs, w8):
        xq, xs = xq_xs
        scale_b = w8.scale.view(1, -1)
        return torch._scaled_mm(
            xq, w8.q.t(), scale_a=xs, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    return run


def gemms(cfg: dict, device: str, iters: int = 50) -> list[dict]:
    """Microseconds per call of each projection at a few token counts: bf16 `F.linear`, the fp8 path
    (`fp8_linear`), and the parts of its large-M path: the per-token quantization, `_scaled_mm` alone,
    and `_scaled_mm` with fast accumulation (not used: it trades accuracy for speed). Each call takes
    the next of several copies of the weight, together larger than the L2 cache, so that every call
    reads its weight from device memory as in a forward."""
    if device != "cuda":
        return []
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    qkv = h + 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    rows = []
    for name, n, k in (("qkv", qkv, h), ("o", h, h), ("gate_up", 2 * i, h), ("down", h, i)):
        copies = -(-(256 << 20) // (n * k))  # fp8 copies of at least 256 MiB in all
        ws = [(torch.randn((n, k), device=device) * 0.02).bfloat16() for _ in range(copies)]
        w8s = [quantize_weight(w) for w in ws]
        for m in (16, 64, 2048):
            x = torch.randn((m, k), device=device).bfloat16()
            xq = quantize_per_token(x)
            row = {"proj": name, "m": m, "n": n, "k": k}
            for kind, fn, arg, weights in (
                ("bf16_us", F.linear, x, ws),
                ("fp8_us", fp8_linear, x, w8s),
                ("quant_us", lambda a, _: quantize_per_token(a), x, [None]),
                ("scaled_mm_us", _scaled_mm(False), xq, w8s),
                ("scaled_mm_fast_us", _scaled_mm(True), xq, w8s),
            ):
                fn(arg, weights[0])
                graph = torch.cuda.CUDAGraph()  # replayed: launch gaps do not count
                with torch.cuda.graph(graph):
                    for j in range(iters):
                        fn(arg, weights[j % len(weights)])
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                row[kind] = start.elapsed_time(end) * 1000 / iters
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--preset", default="8b")
    p.add_argument(
        "--shape", default="{}", type=json.loads, help="config overrides, e.g. '{\"num_hidden_layers\": 4}'"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--draw-on", help="the device the checkpoints are drawn on (default: --device); the same "
                   "device draws the same weights, so runs on other devices compare")  # fmt: skip
    p.add_argument("--scratch", type=Path)
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefill", type=int, nargs=2, default=[4, 2048], metavar=("PROMPTS", "TOKENS"))
    p.add_argument("--quality", type=int, nargs=2, default=[32, 512], metavar=("PROMPTS", "TOKENS"))
    p.add_argument("--quality-only", action="store_true", help="no throughput runs and no GEMM timings")
    p.add_argument("--structures", nargs="+", default=list(STRUCTURES), choices=STRUCTURES)
    p.add_argument("--engines", nargs="+", default=["fp32", "bf16", "fp8"], choices=["fp32", "bf16", "fp8"],
                   help="the quality runs' engines (fp32: the noise floor's reference)")  # fmt: skip
    p.add_argument("--keep-checkpoints", action="store_true", help="leave the checkpoints in --scratch")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    scratch = a.scratch or Path(tempfile.gettempdir()) / "lorapipe-fp8-bench"
    cfg = model_config(a.preset, a.shape)
    vocab = min(cfg["vocab_size"], 32000)
    result: dict = {
        "preset": a.preset,
        "shape": a.shape,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
    }
    tag = f"llama-{a.preset}" + "".join(f"-{k}{v}" for k, v in sorted(a.shape.items()))
    t0 = time.perf_counter()
    if not a.quality_only:
        result["gemm_us"] = gemms(cfg, a.device)
    for structure in a.structures:
        t1 = time.perf_counter()
        model = make_checkpoint(scratch / f"{tag}-{structure}", cfg, structure, a.draw_on or a.device)
        paths = make_adapters(model, scratch / f"{tag}-adapters", n=4, ranks=(MAX_RANK,), dtype="bfloat16")
        adapters = {q.name: q for q in paths}
        result[f"make_s_{structure}"] = time.perf_counter() - t1
        if not a.quality_only and structure == "random":
            result.update(throughput(a, model, adapters, vocab))
        engines = {k: quality_engine(model, adapters, a.device, k) for k in a.engines}
        result[f"quality_{structure}"] = quality(engines, list(adapters), *a.quality, vocab)
        release(engines)
        if not a.keep_checkpoints:  # one checkpoint on disk at a time
            shutil.rmtree(model)
            shutil.rmtree(scratch / f"{tag}-adapters")
    result["total_s"] = time.perf_counter() - t0
    (a.out / "fp8_bench.json").write_text(json.dumps(result, indent=1))
    report(result, [] if a.quality_only else a.batches)


def throughput(a: argparse.Namespace, model: Path, adapters: dict, vocab: int) -> dict:
    """Decode at each of --batches and prefill, bf16 against fp8 engines, A-B-B-A."""
    t0 = time.perf_counter()
    engines = {k: engine(model, adapters, a.device, q) for k, q in (("bf16", None), ("fp8", "fp8"))}
    result: dict = {"build_s": time.perf_counter() - t0}
    names = list(adapters)
    g = torch.Generator().manual_seed(0)
    for b in a.batches:
        prompts = [torch.randint(2, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(b)]
        mix = [names[i % len(names)] for i in range(b)]
        result[f"decode_b{b}"] = abba(engines, prompts, mix, a.output_len, b * a.output_len, a.device)
    n, length = a.prefill
    prompts = [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]
    mix = [names[i % len(names)] for i in range(n)]
    result["prefill"] = abba(engines, prompts, mix, 1, n * length, a.device)
    release(engines)
    return result


def release(engines: dict[str, LLM]) -> None:
    """Close `engines` and give their memory back before the next ones are built."""
    for llm in engines.values():
        llm.close()
    engines.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def report(r: dict, batches: list[int]) -> None:
    print(
        f"fp8 base vs bf16 base, {r['preset']}-shaped {r['shape'] or ''}, 4 rank-16 adapters, {r['device']}"
    )
    if batches:
        print(f"{'what':<26}{'bf16':>12}{'fp8':>12}{'fp8/bf16':>10}")
    for key in [f"decode_b{b}" for b in batches] + (["prefill"] if batches else []):
        m = r[key]["median_tok_s"]
        print(f"{key + ' tok/s':<26}{m['bf16']:>12.0f}{m['fp8']:>12.0f}{r[key]['speedup']:>10.2f}")
    print(f"{'weights':<10}{'pair':<11}{'mean KL':>10}{'top-1':>8}  hidden-state rel. error by layer")
    for key in [k for k in r if k.startswith("quality_")]:
        q = r[key]
        for pair in [k for k in q if isinstance(q[k], dict)]:
            e = q[pair]["hidden_rel_err"]
            steps = sorted({1, max(1, len(e) // 4), max(1, len(e) // 2), len(e) - 1})
            errs = " ".join(f"L{i}:{e[i]:.3f}" for i in steps)
            print(
                f"{key[8:]:<10}{pair:<11}{q[pair]['mean_kl']:>10.2e}{q[pair]['top1_agreement']:>8.4f}  {errs}"
            )
        print(f"{key[8:]:<10}mean top-1 probability of the reference: {q['ref_top1_prob']:.4f}")
    for row in r.get("gemm_us", []):
        print(
            f"gemm {row['proj']:<8} m={row['m']:<5} "
            f"bf16 {row['bf16_us']:8.1f} us  fp8 {row['fp8_us']:8.1f} us  (quant {row['quant_us']:.1f}, "
            f"scaled_mm {row['scaled_mm_us']:.1f}, fast accum {row['scaled_mm_fast_us']:.1f})"
        )


if __name__ == "__main__":
    main()
