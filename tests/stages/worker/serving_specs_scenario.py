"""Run by test_warmup_specs.py in a fresh process (the test session runs Triton's interpreter, which
specialises nothing): on the CPU, for an explicit CUDA target and a Hopper GPU's device facts (SM count,
shared memory, dependent launches), records the LoRA kernel specializations of
- the warm-up: the plan's LoRA launches (`warmup._lora` over `lora_launches`), as the worker runs them;
- serving: eager steps of the real runner (`ModelRunner.execute`) over a sweep of batches: every token
  count of a decode batch and of a prefill batch up to 80 tokens (past the runner's sequence bound, where
  the gate_up expand fuses with the activation), then each count next to a multiple of 16 up to the step
  limit, and seeded random mixes, with adapters of every rank class and base-only sequences;
and writes, as JSON to argv[1], per device each serving specialization the warm-up did not record (Triton
specialises integer arguments on being 1 or a multiple of 16, and pointers on 16-byte alignment, beyond
the constexprs the configs name). argv[2]: a scratch directory; argv[3:]: the devices, each "hopper"
(132 SMs, 227 KiB of shared memory a program, dependent launches: an H100's or H200's) or "default"
(`device_info`'s answers for the CPU).

The runner is the one of tests/stages/worker/test_warmup_gpu.py: the tiny llama in bf16, max LoRA rank
64, 512 tokens a step, 64 running requests, adapters of ranks 8/24/40/64. Steps on graphs are not
swept: a replayed graph launches nothing, and its capture launches the padded batches the plan holds.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from kernels import device_info  # noqa: E402
from runtime.synthetic.adapters import make_adapters  # noqa: E402
from runtime.synthetic.model import make_model  # noqa: E402
from stages.loader.adapter_reader import read_adapter  # noqa: E402
from stages.worker.compile_pool import Spec, TargetDriver, recording  # noqa: E402
from stages.worker.decode_graphs import batch_buckets  # noqa: E402
from stages.worker.lora.backend import PADDED_BLOCK_M  # noqa: E402
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput  # noqa: E402
from stages.worker.step_inputs import token_buckets  # noqa: E402
from stages.worker.warmup import _lora  # noqa: E402
from stages.worker.warmup_plan import lora_launches  # noqa: E402

PAGE, MAX_TOKENS, MAX_SEQS, GRAPH_BATCH = 16, 512, 64, 32
RANKS = (8, 24, 40, 64)  # one adapter of each rank class (16, 32, 64) and a second of the largest
HOPPER_SMS = 132  # H100 SXM and H200


def runner(scratch: Path) -> ModelRunner:
    """test_warmup_gpu.py's runner on the CPU (no graphs there), its adapters loaded into slots 0-3."""
    model = make_model(
        scratch / "llama2k", arch="llama", preset="tiny", seed=1, overrides={"max_position_embeddings": 2048}
    )
    cfg = RunnerConfig(
        model_dir=str(model), device="cpu", dtype="bfloat16", max_lora_rank=64, lora_backend="triton",
        page_size=PAGE, num_pages=4096, max_tokens_per_step=MAX_TOKENS, max_model_len=2048,
        cuda_graph_max_batch=GRAPH_BATCH, cuda_graph_max_tokens=MAX_TOKENS, max_running_requests=MAX_SEQS,
        warmup=False, lora_gpu_memory_gb=0.05,
    )  # fmt: skip
    r = ModelRunner(cfg)
    row = 0
    for slot, path in enumerate(make_adapters(model, scratch, n=len(RANKS), ranks=RANKS, seed=5)):
        packed = read_adapter(path.name, path, r.model_cfg, r.lora_layout, r.dtype)
        r.load_adapter(slot, packed, [(row, packed.rank)])
        row += packed.rank
    return r


def batches(rng: random.Random):
    """Lists of (new tokens, context before them, slot; -1: base only)."""
    slots = len(RANKS)
    counts = [t for t in range(1, MAX_TOKENS + 1) if t <= 80 or t % 16 in (0, 1, 15)]
    for t in counts:
        s = t % slots  # one adapter (its rank class) per count, and base-only sequences beside it
        if t <= MAX_SEQS:
            yield [(1, 30 + i, s if i % 3 else -1) for i in range(t)]  # decodes
        k = t % 9  # decodes beside a prefill run: other tile counts
        yield [(t - k, 0, s), *((1, 40 + i, s if i % 2 else -1) for i in range(k))]
    for _ in range(40):  # mixes of every rank class, as the GPU test draws them
        seqs, budget = [], rng.randint(1, MAX_TOKENS)
        while budget > 0 and len(seqs) < MAX_SEQS:
            n = 1 if rng.random() < 0.6 else rng.randint(1, budget)
            seqs.append((n, rng.choice([0, rng.randint(1, 1500)]), rng.randint(-1, slots - 1)))
            budget -= n
        yield seqs


def describe(spec: Spec) -> str:
    """A specialization as its kernel, constexprs and the arguments it takes as 16-divisible/aligned."""
    data = json.loads(spec.data)
    names = list(data["signature"])
    consts = {names[k[0]]: v for k, v in zip(data["constant_keys"], data["constant_vals"], strict=True)}
    aligned = [names[k[0]] for k, v in zip(data["attrs_keys"], data["attrs_vals"], strict=True) if v]
    return f"{spec.name} {consts} divisible by 16: {aligned}"


def record(r: ModelRunner) -> dict:
    """What the warm-up's launches and the sweep's eager steps ask of Triton, and what the first lack."""
    # the graphs' padded batches, as the GPU runner's `graphs_sizes` gives them
    padded = (*batch_buckets(GRAPH_BATCH), *((t, PADDED_BLOCK_M) for t in token_buckets(MAX_TOKENS)))
    with recording() as planned, torch.inference_mode():
        _lora(r, lora_launches(r.lora, padded), None)
    warm = {s.data for s in planned}
    missing: dict[str, list[int]] = {}  # description -> token counts of the steps that needed it
    served: set[str] = set()
    next_page, steps = 0, 0
    for batch in batches(random.Random(0)):
        seqs = []
        for n, ctx, slot in batch:
            pages = -(-(ctx + n) // PAGE)
            if next_page + pages > r.num_pages:
                next_page = 0  # the cache's contents do not matter: nothing runs, launches are recorded
            seqs.append(SeqInput([7] * n, ctx, list(range(next_page, next_page + pages)), slot))
            next_page += pages
        with recording() as specs, torch.inference_mode():
            r.execute(seqs)
        steps += 1
        for s in specs:
            served.add(s.name)
            if s.data not in warm:
                missing.setdefault(describe(s), []).append(sum(n for n, _, _ in batch))
    return {"planned": len(warm), "steps": steps, "served": sorted(served), "missing": missing}


def main(out_path: str, scratch: str, devices: list[str]) -> None:
    driver.set_active(TargetDriver(GPUTarget("cuda", 90, 32)))
    r = runner(Path(scratch))
    own = device_info.num_sms, device_info.max_shared_memory, device_info.pdl
    result = {}
    for device in devices:
        if device == "hopper":  # the heuristics ask the device of their tensors (the CPU): answer as Hopper
            device_info.num_sms = lambda _device: HOPPER_SMS
            device_info.max_shared_memory = lambda _device: device_info.HOPPER_MAX_SHARED
            device_info.pdl = lambda _device: True
        else:
            device_info.num_sms, device_info.max_shared_memory, device_info.pdl = own
        result[device] = record(r)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
