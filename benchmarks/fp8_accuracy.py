"""Accuracy of the 8-bit adapter pools (`--lora-dtype fp8`, e4m3; `int8`) against the pool in the model's
dtype, on one GPU.

python -m benchmarks.fp8_accuracy OUT_DIR [--preset 1b] [--prompts 32] [--prompt-len 128] \
    [--output-len 1000] [--adapters 8] [--ranks 8,16,32,64] [--lora-dtypes fp8,int8] [--device cuda]

A random-weight model of the preset (bf16) and mixed-rank adapters on all seven projections
(`runtime/synthetic`, whose deltas are a quarter of each projection's output), request i on adapter
i mod n. Offline engines, eager (every LoRA launch runs from Python, so it can be observed): the
reference with a bf16 pool, and one for each 8-bit format. Measured, per format:
- each projection's LoRA delta: the reference engine's inputs of every LoRA launch go through both its
  own pool and an 8-bit pool loaded with the same adapters in the same rows; relative L2 error of the
  8-bit delta over all tokens and layers (target <= 3 %);
- teacher forcing on the reference's greedy outputs (prompt + output_len tokens, one prefill each):
  relative L2 error of the final logits at every output position, top-1 agreement with the reference
  (target >= 99 %); and once, how many positions the adapters change against base-only (the model
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
    """Runs every LoRA launch of a reference engine also on 8-bit pools (one per `lora_dtypes`) holding
    the same adapters in the same rows, and sums each projection's squared delta error per format and its
    squared reference delta."""

    def __init__(self, llm: LLM, lora_dtypes: list[str]):
        runner = llm.runner
        ref = runner.pool
        self.shadows = {
            d: LoraPool(ref.layout, ref.total_rows, ref.num_ids, ref.dtype, ref.device, d)
            for d in lora_dtypes
        }
        self.backends = {
            d: make_backend("triton", p, runner.cfg.max_tokens_per_step, runner.max_seqs)
            for d, p in self.shadows.items()
        }
        self.err2 = {d: dict.fromkeys(TARGET_MODULES, 0.0) for d in lora_dtypes}
        self.ref2 = dict.fromkeys(TARGET_MODULES, 0.0)
        self.active = False
        self._nested = False
        lora, load = runner.lora, ref.load
        prepare, apply, apply_act = lora.prepare, lora.apply, lora.apply_act

        def load_all(lora_id, adapter, runs, stream=None, layer_events=False):
            events = load(lora_id, adapter, runs, stream, layer_events)
            for shadow in self.shadows.values():
                shadow.load(lora_id, adapter, runs)
            return events

        def prepare_all(*args, **kw):
            prepare(*args, **kw)
            for backend in self.backends.values():
                backend.prepare(*args, **kw)

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
            load_all,
            prepare_all,
            apply_measured,
            apply_act_measured,
        )

    def _measure(self, apply, x, out, layer, group) -> None:
        want = torch.zeros_like(out)
        apply(x, want, layer, group)
        cols = list(zip(group.modules, group.out_offsets, group.out_dims, strict=True))
        for module, off, width in cols:
            self.ref2[module] += float(want[:, off : off + width].double().square().sum())
        for d, backend in self.backends.items():
            got = torch.zeros_like(out)
            backend.apply(x, got, layer, group)
            for module, off, width in cols:
                diff = got[:, off : off + width].double() - want[:, off : off + width].double()
                self.err2[d][module] += float(diff.square().sum())

    def errors(self, lora_dtype: str) -> dict[str, float | None]:
        e = self.err2[lora_dtype]
        return {m: (e[m] / self.ref2[m]) ** 0.5 if self.ref2[m] else None for m in TARGET_MODULES}


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
    ap.add_argument("--lora-dtypes", default="fp8,int8", help="the 8-bit pool formats measured")
    ap.add_argument(
        "--device", default="cuda", help="cpu: a smoke run (the 8-bit kernels under TRITON_INTERPRET=1)"
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
    dtypes = a.lora_dtypes.split(",")
    ref = LLM(str(model), **kw)
    engines = {d: LLM(str(model), lora_dtype=d, **kw) for d in dtypes}
    probe = DeltaProbe(ref, dtypes)
    g = torch.Generator().manual_seed(0)
    vocab = ref.runner.model_cfg.vocab_size
    prompts = [
        torch.randint(vocab // 8, vocab // 4, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)
    ]
    mix = [list(names)[i % len(names)] for i in range(a.prompts)]
    greedy = SamplingParams(max_tokens=a.output_len, ignore_eos=True)
    ref_out = [o.token_ids for o in ref.generate(prompts, adapters=mix, sampling=greedy)]
    first_diff = {}
    for d, llm in engines.items():
        outs = [o.token_ids for o in llm.generate(prompts, adapters=mix, sampling=greedy)]
        first_diff[d] = [
            next((i for i, (x, y) in enumerate(zip(r, f, strict=True)) if x != y), len(r))
            for r, f in zip(ref_out, outs, strict=True)
        ]

    agree, err2 = dict.fromkeys(dtypes, 0), dict.fromkeys(dtypes, 0.0)
    changed = positions = 0
    ref2 = 0.0
    for prompt, out, name in zip(prompts, ref_out, mix, strict=True):
        ids = prompt + out[:-1]
        lo = len(prompt) - 1  # the row predicting output token 0
        probe.active = True
        want = capture_logits(ref, ids, name)[lo:]
        probe.active = False
        top = want.argmax(-1)
        base = capture_logits(ref, ids, None)[lo:].argmax(-1)
        changed += int((base != top).sum())
        positions += top.numel()
        ref2 += float(want.double().square().sum())
        for d, llm in engines.items():
            got = capture_logits(llm, ids, name)[lo:]
            agree[d] += int((got.argmax(-1) == top).sum())
            err2[d] += float((got.double() - want.double()).square().sum())
            del got
        del want
    result = {
        "preset": a.preset,
        "prompts": a.prompts,
        "prompt_len": a.prompt_len,
        "output_len": a.output_len,
        "adapters": a.adapters,
        "ranks": ranks,
        "adapter_changed_top1_vs_base": changed / positions,
        "pool_row_bytes": {"auto": ref.runner.pool.row_nbytes},
        "formats": {},
    }
    for d, llm in engines.items():
        result["pool_row_bytes"][d] = llm.runner.pool.row_nbytes
        result["formats"][d] = {
            "delta_rel_l2": probe.errors(d),
            "logits_rel_l2": (err2[d] / ref2) ** 0.5,
            "top1_agreement_teacher_forced": agree[d] / positions,
            "free_running_identical_requests": sum(x == a.output_len for x in first_diff[d]) / a.prompts,
            "free_running_tokens_before_first_difference": sum(first_diff[d]) / (a.prompts * a.output_len),
        }
    result["seconds"] = round(time.perf_counter() - t0, 1)
    (a.out / "fp8_accuracy.json").write_text(json.dumps(result, indent=1))
    _print_table(result, dtypes)


def _print_table(result: dict, dtypes: list[str]) -> None:
    f = result["formats"]
    print("| measure | " + " | ".join(dtypes) + " | target |")
    print("|---" * (len(dtypes) + 2) + "|")

    def row(name: str, values, target: str = "") -> None:
        print(
            f"| {name} | " + " | ".join("-" if v is None else f"{v:.4f}" for v in values) + f" | {target} |"
        )

    for m in TARGET_MODULES:
        row(f"LoRA delta relative L2, {m}", [f[d]["delta_rel_l2"][m] for d in dtypes], "<= 0.03")
    row("final logits relative L2", [f[d]["logits_rel_l2"] for d in dtypes])
    row("top-1 agreement, teacher forced", [f[d]["top1_agreement_teacher_forced"] for d in dtypes], ">= 0.99")
    row("free-running: identical requests", [f[d]["free_running_identical_requests"] for d in dtypes])
    row(
        "free-running: tokens before the first difference",
        [f[d]["free_running_tokens_before_first_difference"] for d in dtypes],
    )
    print(
        f"adapters change base-only top-1 at {result['adapter_changed_top1_vs_base']:.3f} of positions "
        "(the model must let them change >= 0.20)"
    )


if __name__ == "__main__":
    main()
