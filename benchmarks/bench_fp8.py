"""An fp8 base model against the bf16 one, both engines built in one process on the same checkpoint
(`--quantization fp8` quantizes it at load), with the same rank-16 adapters, measured A-B-B-A:

    python -m benchmarks.bench_fp8 OUT_DIR [--preset 8b] [--device cuda]

- decode: output tokens/s of a batch of B prompts (128 tokens each, 256 new tokens, one adapter each,
  round-robin over 4), B in --batches;
- prefill: prompt tokens/s of 4 prompts of 2,048 tokens (one new token each);
- quality: the next-token distributions of 32 prompts of 512 tokens, teacher-forced, on the same
  adapters (8 prompts each): mean KL(bf16 || fp8) and top-1 agreement, on random weights and on weights
  of low-rank structure (a rank-64 product carrying most of each projection, plus full-rank noise);
- the GEMMs alone: bf16 `F.linear` against the fp8 path (per-token quantization + `_scaled_mm`) at the
  model's projection shapes.
The checkpoints are made on the device, written to --scratch (default: in the temporary directory),
and removed once read (--keep-checkpoints keeps them). Prints one summary table; everything goes to
OUT_DIR/fp8_bench.json."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kernels.fp8_quant import quantize_per_token
from proto.sampling import SamplingParams
from runtime.offline import LLM
from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.model import build_config, tensor_specs, write_tokenizer
from stages.worker.model.linear import fp8_linear, quantize_weight
from stages.worker.runner import SeqInput

LOW_RANK = 64


def make_checkpoint(out: Path, preset: str, structure: str, device: str, seed: int = 0) -> Path:
    """A bf16 Llama checkpoint of `preset`'s shapes, its tensors drawn on `device`, one file per layer."""
    if (out / "model.safetensors.index.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config("llama", preset, dtype="bfloat16")
    write_tokenizer(out, cfg["max_position_embeddings"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    part: dict[str, torch.Tensor] = {}  # one layer's tensors (or the others'), written together

    def flush() -> None:
        fname = f"model-{len(set(weight_map.values())):05d}.safetensors"
        save_file(part, str(out / fname))
        weight_map.update(dict.fromkeys(part, fname))
        part.clear()

    for name, shape, kind in tensor_specs(cfg):
        if kind == "norm":
            t = 1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)
        elif structure == "lowrank" and ".layers." in name and len(shape) == 2:
            u = torch.randn((shape[0], LOW_RANK), generator=gen, device=device)
            v = torch.randn((LOW_RANK, shape[1]), generator=gen, device=device)
            noise = torch.randn(shape, generator=gen, device=device)
            t = 0.02 * (0.95 * (u @ v) / math.sqrt(LOW_RANK) + math.sqrt(1 - 0.95**2) * noise)
        else:
            t = 0.02 * torch.randn(shape, generator=gen, device=device)
        if part and _file_group(name) != _file_group(next(iter(part))):
            flush()
        part[name] = t.to(torch.bfloat16).cpu()
    flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def _file_group(name: str) -> str:
    """Which file a tensor goes to: its layer's, or the one of everything outside the layers."""
    return name.split(".")[2] if ".layers." in name else "other"


def engine(model: Path, adapters: dict, device: str, quantization: str | None, serving: bool) -> LLM:
    """`serving`: CUDA graphs, warm-up and a KV cache for the throughput runs; else the least engine
    that computes the quality runs' forwards (eagerly, one 512-token sequence at a time)."""
    if serving:
        kw = dict(num_pages=2048)  # 32k tokens: batch 64 x 384, or 4 x 2,049
    else:
        kw = dict(num_pages=64, cuda_graph_max_batch=0, cuda_graph_max_tokens=0, warmup=False)
    return LLM(model, adapters=adapters, device=device, dtype="bfloat16", quantization=quantization,
               max_lora_rank=16, max_running_requests=64, lora_gpu_memory_gb=0.5, **kw)  # fmt: skip


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


@torch.inference_mode()
def all_logits(llm: LLM, tokens: list[int], slot: int) -> torch.Tensor:
    """Float32 logits [T, V] of every position of `tokens` (one sequence, adapter id `slot`)."""
    r = llm.runner
    pages = list(range(-(-len(tokens) // r.cfg.page_size)))
    fb, indptr, slots = r._build_batch([SeqInput(tokens, 0, pages, slot)])
    fb = dataclasses.replace(fb, logits_indices=torch.arange(len(tokens), device=r.device))
    r.lora.prepare(indptr, slots)
    return r.model.forward(fb, r.kv, r.lora)


def quality(engines: dict[str, LLM], names: list[str], n: int, length: int, vocab: int) -> dict:
    """Mean KL(bf16 || fp8) over every position, and how often their top-1 tokens agree."""
    for llm in engines.values():  # adapter i at pool id i, rows 16 i ..
        for slot, name in enumerate(names):
            llm.runner.load_adapter(slot, llm.adapters[name], [(16 * slot, llm.adapters[name].rank)])
    if engines["bf16"].runner.device.type == "cuda":
        torch.cuda.synchronize()
    g = torch.Generator().manual_seed(1)
    kl_sum = agree = positions = 0.0
    for i in range(n):
        tokens = torch.randint(2, vocab, (length,), generator=g).tolist()
        slot = i % len(names)
        ref = torch.log_softmax(all_logits(engines["bf16"], tokens, slot), dim=-1)
        got = torch.log_softmax(all_logits(engines["fp8"], tokens, slot), dim=-1)
        kl_sum += (ref.exp() * (ref - got)).sum(dtype=torch.float64).item()
        agree += (ref.argmax(-1) == got.argmax(-1)).sum().item()
        positions += length
    return {"mean_kl": kl_sum / positions, "top1_agreement": agree / positions, "positions": int(positions)}


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
    (`fp8_linear`), and its parts: the per-token quantization, `_scaled_mm` alone, and `_scaled_mm` with
    fast accumulation (not used: it trades accuracy for speed). Each call takes the next of several
    copies of the weight, together larger than the L2 cache, so that every call reads its weight from
    device memory as in a forward."""
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
    p.add_argument("--device", default="cuda")
    p.add_argument("--scratch", type=Path)
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prefill", type=int, nargs=2, default=[4, 2048], metavar=("PROMPTS", "TOKENS"))
    p.add_argument("--quality", type=int, nargs=2, default=[32, 512], metavar=("PROMPTS", "TOKENS"))
    p.add_argument("--keep-checkpoints", action="store_true", help="leave the checkpoints in --scratch")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    scratch = a.scratch or Path(tempfile.gettempdir()) / "lorapipe-fp8-bench"
    cfg = build_config("llama", a.preset, dtype="bfloat16")
    vocab = min(cfg["vocab_size"], 32000)
    result: dict = {
        "preset": a.preset,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
    }
    result["gemm_us"] = gemms(cfg, a.device)
    t0 = time.perf_counter()
    model = make_checkpoint(scratch / f"llama-{a.preset}-random", a.preset, "random", a.device)
    paths = make_adapters(model, scratch / "adapters", n=4, ranks=(16,), dtype="bfloat16", seed=0)
    adapters = {q.name: q for q in paths}
    names = list(adapters)
    result["make_s"] = time.perf_counter() - t0
    engines = {k: engine(model, adapters, a.device, q, True) for k, q in (("bf16", None), ("fp8", "fp8"))}
    result["build_s"] = time.perf_counter() - t0 - result["make_s"]
    g = torch.Generator().manual_seed(0)
    for b in a.batches:
        prompts = [torch.randint(2, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(b)]
        mix = [names[i % len(names)] for i in range(b)]
        result[f"decode_b{b}"] = abba(engines, prompts, mix, a.output_len, b * a.output_len, a.device)
    n, length = a.prefill
    prompts = [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]
    mix = [names[i % len(names)] for i in range(n)]
    result["prefill"] = abba(engines, prompts, mix, 1, n * length, a.device)
    result["quality_random"] = quality(engines, names, *a.quality, vocab)
    for llm in engines.values():
        llm.close()
    del engines, llm
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()
    if not a.keep_checkpoints:  # one 8B checkpoint on disk at a time
        shutil.rmtree(model)
    structured = make_checkpoint(scratch / f"llama-{a.preset}-lowrank", a.preset, "lowrank", a.device)
    engines = {
        k: engine(structured, adapters, a.device, q, False) for k, q in (("bf16", None), ("fp8", "fp8"))
    }
    result["quality_lowrank"] = quality(engines, names, *a.quality, vocab)
    if not a.keep_checkpoints:
        shutil.rmtree(structured)
    result["total_s"] = time.perf_counter() - t0
    (a.out / "fp8_bench.json").write_text(json.dumps(result, indent=1))
    report(result, a.batches)


def report(r: dict, batches: list[int]) -> None:
    print(f"fp8 base vs bf16 base, {r['preset']}-shaped, 4 rank-16 adapters, {r['device']}")
    print(f"{'what':<26}{'bf16':>12}{'fp8':>12}{'fp8/bf16':>10}")
    for key in [f"decode_b{b}" for b in batches] + ["prefill"]:
        m = r[key]["median_tok_s"]
        print(f"{key + ' tok/s':<26}{m['bf16']:>12.0f}{m['fp8']:>12.0f}{r[key]['speedup']:>10.2f}")
    for key in ("quality_random", "quality_lowrank"):
        q = r[key]
        print(f"{key:<26} mean KL {q['mean_kl']:.2e}  top-1 agreement {q['top1_agreement']:.4f}")
    for row in r["gemm_us"]:
        print(
            f"gemm {row['proj']:<8} m={row['m']:<5} "
            f"bf16 {row['bf16_us']:8.1f} us  fp8 {row['fp8_us']:8.1f} us  (quant {row['quant_us']:.1f}, "
            f"scaled_mm {row['scaled_mm_us']:.1f}, fast accum {row['scaled_mm_fast_us']:.1f})"
        )


if __name__ == "__main__":
    main()
