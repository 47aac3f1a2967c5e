"""Accuracy of the fp8 adapter pool (`--lora-dtype fp8`) against the pool in the model's dtype, on one GPU.

python -m benchmarks.fp8_accuracy OUT_DIR [--preset 1b] [--prompts 32] [--prompt-len 128] \
    [--output-len 1000] [--adapters 8] [--ranks 8,16,32,64] [--device cuda]

A random-weight model of the preset (bf16) and mixed-rank adapters on all seven projections
(`runtime/synthetic`, whose deltas are a quarter of each projection's output), request i on adapter
i mod n. Two offline engines, eager (every LoRA launch runs from Python, so it can be observed): the
reference with a bf16 pool, and one with an fp8 pool. Measured:
- each projection's LoRA delta: the reference engine's inputs of every LoRA launch go through both its
  own pool and an fp8 pool loaded with the same adapters in the same rows; relative L2 error of the fp8
  delta over all tokens and layers (target <= 3 %);
- teacher forcing on the reference's greedy outputs (prompt + output_len tokens, one prefill each):
  relative L2 error of the final logits at every output position, top-1 agreement of fp8 with the
  reference (target >= 99 %), and how many positions the adapters change against base-only (the model
  must let them change >= 20 %);
- free-running greedy decoding: the share of requests identical over all output_len tokens, and the
  mean share of tokens before the first difference.
Writes OUT_DIR/fp8_accuracy.json and prints one table."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from proto.sampling import SamplingParams
from runtime.common.lora_layout import TARGET_MODULES
from runtime.offline import LLM
from runtime.synthetic.adapters import make_adapters
from runtime.synthetic.model import make_model
from stages.worker.lora.factory import make_backend
from stages.worker.lora.pool import LoraPool


class DeltaProbe:
    """Runs every LoRA launch of a reference engine also on an fp8 pool holding the same adapters in the
    same rows, and sums each projection's squared delta error and squared reference delta."""

    def __init__(self, llm: LLM):
        runner = llm.runner
        ref = runner.pool
        self.shadow = LoraPool(ref.layout, ref.total_rows, ref.num_ids, ref.dtype, ref.device, fp8=True)
        self.backend = make_backend("triton", self.shadow, runner.cfg.max_tokens_per_step, runner.max_seqs)
        self.err2 = dict.fromkeys(TARGET_MODULES, 0.0)
        self.ref2 = dict.fromkeys(TARGET_MODULES, 0.0)
        self.active = False
        self._nested = False
        lora, load = runner.lora, ref.load
        prepare, apply, apply_act = lora.prepare, lora.apply, lora.apply_act

        def load_both(lora_id, adapter, runs, stream=None, layer_events=False):
            events = load(lora_id, adapter, runs, stream, layer_events)
            self.shadow.load(lora_id, adapter, runs)
            return events

        def prepare_both(*args, **kw):
            prepare(*args, **kw)
            self.backend.prepare(*args, **kw)

        def apply_measured(x, out, layer, group):
            if self.active and not self._nested:
                self._measure(apply, x, out, layer, group)
            apply(x, out, layer, group)

        def apply_act_measured(x, gate_up, layer, group, act):
            if self.active:
                self._measure(apply, x, gate_up, layer, group)
            self._nested = True  # a backend's apply_act may call its apply: measured once above
            try:
                return apply_act(x, gate_up, layer, group, act)
            finally:
                self._nested = False

        ref.load, lora.prepare, lora.apply, lora.apply_act = (
            load_both,
            prepare_both,
            apply_measured,
            apply_act_measured,
        )

    def _measure(self, apply, x, out, layer, group) -> None:
        want, got = torch.zeros_like(out), torch.zeros_like(out)
        apply(x, want, layer, group)
        self.backend.apply(x, got, layer, group)
        for module, off, width in zip(group.modules, group.out_offsets, group.out_dims, strict=True):
            w, g = want[:, off : off + width].double(), got[:, off : off + width].double()
            self.err2[module] += float((g - w).square().sum())
            self.ref2[module] += float(w.square().sum())

    def errors(self) -> dict[str, float | None]:
        return {m: (self.err2[m] / self.ref2[m]) ** 0.5 if self.ref2[m] else None for m in TARGET_MODULES}


def capture_logits(llm: LLM, ids: list[int], adapter: str | None) -> torch.Tensor:
    """Float32 logits [len(ids), V] of every position of one prefill of `ids`."""
    model, captured = llm.runner.model, []
    own = model.logits

    def every_row(h, logits_indices):
        captured.append(own(h, torch.arange(h.shape[0], device=h.device)).float())
        return own(h, logits_indices)

    model.logits = every_row
    try:
        llm.generate([ids], adapters=[adapter], sampling=SamplingParams(max_tokens=1))
    finally:
        del model.logits
    # the prefill comes first; an overlapped engine may launch one more step that it then drops
    if not captured or captured[0].shape[0] != len(ids):
        raise RuntimeError(f"expected a prefill of {len(ids)} rows first, got {[c.shape for c in captured]}")
    return captured[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument(
        "--device", default="cuda", help="cpu: a smoke run (the fp8 kernels under TRITON_INTERPRET=1)"
    )
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = a.out / "scratch" / f"llama-{a.preset}"
    if not (model / "config.json").exists():
        make_model(model, preset=a.preset, dtype="bfloat16", seed=0)
    ranks = [int(r) for r in a.ranks.split(",")]
    adir = a.out / "scratch" / "adapters"
    paths = make_adapters(model, adir, n=a.adapters, ranks=ranks, dtype="bfloat16", seed=3)
    names = {p.name: str(p) for p in paths}
    seq_len = a.prompt_len + a.output_len
    kw = dict(
        adapters=names,
        device=a.device,
        dtype="bfloat16",
        max_lora_rank=max(ranks),
        lora_gpu_memory_gb=1.0,
        num_pages=a.prompts * (seq_len // 16 + 2) + 64,
        page_size=16,
        max_model_len=seq_len + 16,
        max_tokens_per_step=max(2048, seq_len + 16),
        max_running_requests=a.prompts,
        cuda_graph_max_batch=0,
        cuda_graph_max_tokens=0,
        warmup=False,
    )
    ref, fp8 = LLM(str(model), **kw), LLM(str(model), lora_dtype="fp8", **kw)
    probe = DeltaProbe(ref)
    g = torch.Generator().manual_seed(0)
    vocab = ref.runner.model_cfg.vocab_size
    prompts = [
        torch.randint(vocab // 8, vocab // 4, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)
    ]
    mix = [list(names)[i % len(names)] for i in range(a.prompts)]
    greedy = SamplingParams(max_tokens=a.output_len, ignore_eos=True)
    ref_out = [o.token_ids for o in ref.generate(prompts, adapters=mix, sampling=greedy)]
    fp8_out = [o.token_ids for o in fp8.generate(prompts, adapters=mix, sampling=greedy)]
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(r, f, strict=True)) if x != y), len(r))
        for r, f in zip(ref_out, fp8_out, strict=True)
    ]

    agree = changed = positions = 0
    err2 = ref2 = 0.0
    for prompt, out, name in zip(prompts, ref_out, mix, strict=True):
        ids = prompt + out[:-1]
        lo = len(prompt) - 1  # the row predicting output token 0
        probe.active = True
        want = capture_logits(ref, ids, name)[lo:]
        probe.active = False
        got = capture_logits(fp8, ids, name)[lo:]
        base = capture_logits(ref, ids, None)[lo:].argmax(-1)
        top = want.argmax(-1)
        agree += int((got.argmax(-1) == top).sum())
        changed += int((base != top).sum())
        positions += top.numel()
        err2 += float((got.double() - want.double()).square().sum())
        ref2 += float(want.double().square().sum())
        del want, got
    result = {
        "preset": a.preset,
        "prompts": a.prompts,
        "prompt_len": a.prompt_len,
        "output_len": a.output_len,
        "adapters": a.adapters,
        "ranks": ranks,
        "delta_rel_l2": probe.errors(),
        "logits_rel_l2": (err2 / ref2) ** 0.5,
        "top1_agreement_teacher_forced": agree / positions,
        "adapter_changed_top1_vs_base": changed / positions,
        "free_running_identical_requests": sum(d == a.output_len for d in first_diff) / a.prompts,
        "free_running_tokens_before_first_difference": sum(first_diff) / (a.prompts * a.output_len),
        "pool_row_bytes": {"bf16": ref.runner.pool.row_nbytes, "fp8": fp8.runner.pool.row_nbytes},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (a.out / "fp8_accuracy.json").write_text(json.dumps(result, indent=1))
    print("| measure | value | target |")
    print("| --- | --- | --- |")
    for m, e in result["delta_rel_l2"].items():
        print(f"| LoRA delta relative L2, {m} | {e:.4f} | <= 0.03 |" if e is not None else f"| {m} | - | |")
    print(f"| final logits relative L2 | {result['logits_rel_l2']:.4f} | |")
    print(f"| top-1 agreement, teacher forced | {result['top1_agreement_teacher_forced']:.4f} | >= 0.99 |")
    print(f"| adapters change base-only top-1 | {result['adapter_changed_top1_vs_base']:.3f} | >= 0.20 |")
    print(f"| free-running: identical requests | {result['free_running_identical_requests']:.3f} | |")
    print(
        f"| free-running: tokens before first difference | "
        f"{result['free_running_tokens_before_first_difference']:.3f} | |"
    )


if __name__ == "__main__":
    main()
