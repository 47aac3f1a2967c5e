"""The PEFT baseline: a workload file run through transformers + PEFT (all adapters in one PeftModel,
static mixed-adapter batches via `generate(adapter_names=...)`, greedy), honouring arrival times, with
the same records, summary table and JSON as bench_serving. `--no-adapters`: plain base-model generate."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tools.bench_report import Progress, RequestRecord, emit_report, jsonable, make_report
from tools.workload import WorkloadRequest, read_workload, workload_digest

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StepClock:
    """A generate() streamer that only records when each decoding step's tokens exist (the first put
    is the prompt). On CUDA generate hands it `next_tokens.cpu()`, so the times follow the device."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_model(model_dir: str, adapters: dict[str, str], device: str, dtype: str, attn: str) -> Any:
    """The base model, wrapped in one PeftModel holding every adapter (no adapters: the base model)."""
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {"attn_implementation": attn}
    if dtype != "auto":
        kw["dtype"] = DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw).to(device)
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop early, never mask EOS
    if adapters:
        from peft import PeftModel

        names = list(adapters)
        model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def encode_prompts(model_dir: str, workload: Sequence[WorkloadRequest]) -> list[list[int]]:
    """Token ids exactly as the lorapipe tokenizer stage makes them (tokenizer.json, special tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    out = []
    for r in workload:
        p = r.prompt_value()
        out.append(tok.encode(p, add_special_tokens=True).ids if isinstance(p, str) else list(p))
    return out


@torch.inference_mode()
def generate_batch(
    model: Any, rows: list[tuple[list[int], str | None, int]], pad_id: int, device: str, adapters: bool
) -> tuple[list[list[int]], list[float]]:
    """One static batch, left-padded to its longest prompt, run to its longest output (every row gets
    min_new_tokens = max_new_tokens tokens). Returns each row's own tokens and the per-step times."""
    width = max(len(ids) for ids, _, _ in rows)
    steps = max(n for _, _, n in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _, _ in rows], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _, _ in rows], device=device)
    kw: dict[str, Any] = {"adapter_names": [a or BASE for _, a, _ in rows]} if adapters else {}
    clock = StepClock()
    out = model.generate(
        input_ids=input_ids,  # [B, width]
        attention_mask=mask,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_id,
        streamer=clock,
        **kw,
    )  # [B, width + steps]
    tokens = [out[b, width : width + n].tolist() for b, (_, _, n) in enumerate(rows)]
    return tokens, clock.times


def run_static(
    model: Any,
    workload: Sequence[WorkloadRequest],
    prompts: list[list[int]],
    batch_size: int,
    *,
    device: str,
    pad_id: int,
    adapters: bool,
    progress: bool = False,
) -> tuple[list[RequestRecord], float]:
    """Serve the workload in arrival order: each batch takes up to `batch_size` requests that have
    arrived (waiting for the next arrival when none has). Latencies count from each request's arrival."""
    records = [RequestRecord(i, r.adapter, r.arrival, r.max_tokens) for i, r in enumerate(workload)]
    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    bar = Progress(len(workload), progress)
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        if workload[pending[0]].arrival > now:
            time.sleep(workload[pending[0]].arrival - now)
            now = time.perf_counter() - t0
        batch = [i for i in pending[:batch_size] if workload[i].arrival <= now]
        pending = pending[len(batch) :]
        bar.in_flight = len(batch)
        bar.show()
        rows = [(prompts[i], workload[i].adapter, workload[i].max_tokens) for i in batch]
        try:
            tokens, steps = generate_batch(model, rows, pad_id, device, adapters)
            error = None
        except torch.OutOfMemoryError as exc:
            tokens, steps, error = [[] for _ in batch], [], f"OutOfMemoryError: {exc}"
            torch.cuda.empty_cache()
        end = time.perf_counter() - t0
        for i, toks in zip(batch, tokens, strict=True):
            rec = records[i]
            rec.start, rec.end, rec.prompt_tokens, rec.error = now, end, len(prompts[i]), error
            if error is None:
                own = [s - t0 for s in steps[: len(toks)]]
                rec.token_ids, rec.output_tokens = toks, len(toks)
                rec.ttft, rec.e2e = own[0] - rec.arrival, end - rec.arrival
                rec.itl = [b - a for a, b in zip(own, own[1:], strict=False)]
                rec.finish_reason = "length"
        bar.done += len(batch)
        bar.failed += len(batch) if error else 0
    bar.in_flight = 0
    bar.show(final=True)
    return records, time.perf_counter() - t0


def pick_batch_size(model: Any, workload, prompts, sizes: list[int], probe_tokens: int, **kw) -> dict:
    """Output tok/s of one batch per size (requests taken cyclically, outputs capped at probe_tokens,
    arrivals ignored); stops at the first size that runs out of memory."""
    results: dict[int, float] = {}
    for size in sizes:
        idx = [i % len(workload) for i in range(size)]
        rows = [(prompts[i], workload[i].adapter, min(workload[i].max_tokens, probe_tokens)) for i in idx]
        try:
            t = time.perf_counter()
            tokens, _ = generate_batch(model, rows, kw["pad_id"], kw["device"], kw["adapters"])
            results[size] = sum(map(len, tokens)) / (time.perf_counter() - t)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            break
    return results


def run(ns: argparse.Namespace) -> dict[str, Any]:
    workload = read_workload(ns.workload)[: ns.limit]
    adapters = {} if ns.no_adapters else _adapter_paths(ns)
    missing = {r.adapter for r in workload if r.adapter is not None} - set(adapters)
    if missing and not ns.no_adapters:
        raise SystemExit(f"the workload uses adapters with no --adapter/--adapter-dir: {sorted(missing)}")
    if any(r.sampling.get("temperature") for r in workload):
        print(
            "bench_peft: the workload asks for sampling; this baseline always decodes greedily",
            file=sys.stderr,
        )
    model = load_model(ns.model, adapters, ns.device, ns.dtype, ns.attn_implementation)
    cfg = model.config if not adapters else model.base_model.model.config
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (cfg.eos_token_id or 0)
    prompts = encode_prompts(ns.model, workload)
    kw = {"device": ns.device, "pad_id": pad_id, "adapters": bool(adapters)}
    generate_batch(model, [(prompts[0], workload[0].adapter, 2)], **kw)  # warm-up, not timed
    probe = None
    batch_size = ns.batch_size
    if ns.batch_size == "auto":
        sizes = [int(s) for s in ns.auto_sizes.split(",")]
        probe = pick_batch_size(model, workload, prompts, sizes, ns.probe_tokens, **kw)
        batch_size = max(probe, key=probe.__getitem__)
    records, duration = run_static(model, workload, prompts, int(batch_size), progress=not ns.quiet, **kw)
    config = jsonable(vars(ns))
    config.update(batch_size=int(batch_size), batch_size_probe=probe, adapters_loaded=sorted(adapters))
    config["ttft_method"] = "streamer: time the batch's first decoding step produced its tokens"
    meta = {"source": str(ns.workload), "num_requests": len(workload), "sha256": workload_digest(workload)}
    label = ns.label or (f"transformers base bs={batch_size}" if ns.no_adapters else f"peft bs={batch_size}")
    report = make_report("bench_peft", label, config, meta, records, duration)
    emit_report(report, ns)
    return report


def _adapter_paths(ns: argparse.Namespace) -> dict[str, str]:
    out = {}
    if ns.adapter_dir:
        for d in sorted(Path(ns.adapter_dir).iterdir()):
            if (d / "adapter_config.json").is_file():
                out[d.name] = str(d)
    for spec in ns.adapter:
        name, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"--adapter {spec!r}: expected NAME=PATH")
        out[name] = path
    return out


def _batch_size(text: str) -> int | str:
    return text if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_peft", description=__doc__)
    p.add_argument("--workload", type=Path, required=True, metavar="FILE")
    p.add_argument("--model", required=True, metavar="DIR")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--adapter-dir", metavar="DIR", help="every subdirectory with adapter_config.json")
    p.add_argument("--no-adapters", action="store_true", help="plain base-model generate")
    p.add_argument("--batch-size", type=_batch_size, default=8, metavar="N|auto")
    p.add_argument("--auto-sizes", default="8,16,32,64", metavar="A,B,..", help="sizes auto tries")
    p.add_argument("--probe-tokens", type=int, default=32, metavar="N", help="output cap while probing")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto")
    p.add_argument("--attn-implementation", default="sdpa")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N requests")
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, metavar="FILE")
    p.add_argument("--plot", type=Path, metavar="FILE.png")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
