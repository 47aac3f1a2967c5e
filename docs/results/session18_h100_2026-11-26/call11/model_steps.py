"""Whole model steps (1B shapes, bf16, graphed) with the LoRA kernels in plain stream order against the
same steps with them as programmatic dependents, in one process: two ModelRunners over one model and the
same 62 adapters of ranks 8-64, one built and captured with LORAPIPE_PDL=0, the other with it on; their
steps timed in the order off on on off, twice (median GPU ms of 30 executions each). Base-only steps
(no LoRA kernel) are the noise control. A measurement script, not runtime code.
    python docs/results/session18_h100_2026-11-26/call11/model_steps.py MODEL_DIR ADAPTER_DIR"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())

from kernels import device_info  # noqa: E402
from stages.loader.adapter_reader import read_adapter  # noqa: E402
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput  # noqa: E402
from tools.profile_step import _step_times  # noqa: E402

CTX, BATCH, DECODES, CHUNKS, ADAPTERS = 256, 256, 190, [256, 256, 256], 62
PAGES_PER = CTX // 16 + 2


def set_pdl(on: bool) -> None:
    os.environ[device_info.PDL_ENV] = "1" if on else "0"
    device_info.pdl.cache_clear()


def build(model: str, adir: str, on: bool) -> ModelRunner:
    set_pdl(on)
    cfg = RunnerConfig(model_dir=model, device="cuda", dtype="bfloat16", max_lora_rank=64,
                       lora_gpu_memory_gb=4, num_pages=(BATCH + len(CHUNKS)) * PAGES_PER + 16,
                       max_model_len=PAGES_PER * 16, max_tokens_per_step=2048,
                       max_running_requests=BATCH + len(CHUNKS), cuda_graph_max_batch=BATCH,
                       cuda_graph_max_tokens=DECODES + sum(CHUNKS))  # fmt: skip
    runner = ModelRunner(cfg)
    row = 0
    for slot, d in enumerate(sorted(p for p in Path(adir).iterdir() if p.is_dir())[:ADAPTERS]):
        packed = read_adapter(d.name, d, runner.model_cfg, runner.lora_layout, runner.dtype, pin_memory=True)
        runner.load_adapter(slot, packed, [(row, packed.rank)])
        row += packed.rank
    return runner


def seqs_for(case: str) -> list[SeqInput]:
    lora = case.startswith("lora")
    slot_of = (lambda i: i % ADAPTERS) if lora else (lambda i: -1)
    n = BATCH if case.endswith("decode") else DECODES
    seqs = [SeqInput([7], CTX, list(range(i * PAGES_PER, (i + 1) * PAGES_PER)), slot_of(i)) for i in range(n)]
    if case.endswith("mixed"):
        seqs += [
            SeqInput([7] * c, 0, list(range((n + j) * PAGES_PER, (n + j + 1) * PAGES_PER)), slot_of(n + j))
            for j, c in enumerate(CHUNKS)
        ]
    seqs.sort(key=lambda s: s.slot)
    return seqs


def main() -> None:
    model, adir = sys.argv[1], sys.argv[2]
    runners = {False: build(model, adir, False), True: build(model, adir, True)}
    cases = ("lora decode", "lora mixed", "base decode", "base mixed")
    times: dict[tuple[str, bool], list[float]] = {}
    for on in (False, True):  # warm-up: compiles, captures
        set_pdl(on)
        for case in cases:
            _step_times(runners[on], seqs_for(case), 3)
    for _round in range(2):
        for on in (False, True, True, False):
            set_pdl(on)
            for case in cases:
                times.setdefault((case, on), []).append(_step_times(runners[on], seqs_for(case), 30)[1])
    for case in cases:
        off, on = times[(case, False)], times[(case, True)]
        mo, mn = statistics.median(off), statistics.median(on)
        print(f"{case:12s} off {' '.join(f'{t:.3f}' for t in off)}  on {' '.join(f'{t:.3f}' for t in on)}"
              f"  medians {mo:.3f} / {mn:.3f} ms ({(mn / mo - 1) * 100:+.1f} %)")  # fmt: skip


if __name__ == "__main__":
    main()
