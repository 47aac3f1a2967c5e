"""How much adapter-weight traffic S1 and S2 of issue 14 force, whatever the scheduler and kernels do
(session 13, CPU): a lower bound on their throughput against the adapter-free run.

A decode step reads every distinct adapter of the step once: x @ A needs all of A, (x A) @ B all of B,
and a step's working set (gigabytes) does not stay in the 50 MB L2 until the next step. An adapter whose
requests all run side by side is active in at least max(output length) steps, so over a burst at least
sum over adapters of bytes(a) * max_out(a) must be read, beside what the adapter-free run reads. At
the H100's copy bandwidth (3.0 TB/s measured by tools/bench_lora_step.py; 3.35 TB/s on the data sheet)
that is a time the adapter-free run does not spend, unless the LoRA kernels run beside memory-bound
base kernels (they contend; docs/benchmarks.md, tenth session) or inside compute-bound ones.

The workloads are rebuilt with tools/workload.py exactly as tools/run_churn_bench.sh builds them; the
adapter bytes are the 1B layout's 1.41 MB per rank row (all seven projections, bf16); S2's adapter i has
rank (8, 16, 32, 64)[i % 4] (make_adapters cycles the ranks over the 64 real adapters the names link to).
    python docs/results/session13_cpu_2026-11-26/lora_bytes_bound/bound.py   (from the repository root)"""

import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROW = 1.41e6  # bytes per rank row of the 1B layout
# Activation bytes the unfused LoRA kernels move per token (bench_lora_step's floor: per layer x read by
# the shrinks, 2 bytes x 14,336 inputs, and the outputs read and written by the expands, 4 x 23,552),
# over 16 layers. Counted for prompt tokens only (a decode step's outputs are small enough for L2).
ACT = 16 * (2 * 14_336 + 4 * 23_552)
TBPS = (3.0e12, 3.35e12)  # measured copy bandwidth, data sheet
# Adapter-free throughput of the same requests, tok/s: S1's 8-adapter runs and S2's base-only runs
# (medians, session 12 calls 6 and 7 and session 13 calls 5 and 6).
REFERENCE = {"S1": (36_540, 34_597), "S2": (30_335, 29_205)}
WORKLOADS = {
    "S1": (["--input-len", "256", "--output-len", "128", "--num-adapters", "2000",
            "--adapter-distribution", "uniform"], lambda a: 16),
    "S2": (["--input-len", "32:1024", "--output-len", "16:256", "--num-adapters", "1000",
            "--adapter-distribution", "zipf:1.0"], lambda a: (8, 16, 32, 64)[int(a[len("adapter"):]) % 4]),
}  # fmt: skip


def requests(name: str, args: list[str], tmp: Path) -> list[dict]:
    out = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "tools.workload", "--out", str(out), "--num-prompts", "1000",
           "--request-rate", "inf", "--seed", "0", *args]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    return [json.loads(line) for line in out.open()]


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        for name, (args, rank_of) in WORKLOADS.items():
            reqs = requests(name, args, Path(d))
            outs = collections.defaultdict(list)
            for r in reqs:
                outs[r["adapter"]].append(r["max_tokens"])
            tokens = sum(r["max_tokens"] for r in reqs)
            shared = sum(rank_of(a) * ROW * max(v) for a, v in outs.items())
            alone = sum(rank_of(a) * ROW * sum(v) for a, v in outs.items())
            steps = sum(max(v) for v in outs.values())
            print(f"{name}: {len(reqs)} requests, {tokens} output tokens, {len(outs)} distinct adapters "
                  f"({sum(len(v) == 1 for v in outs.values())} with one request)")  # fmt: skip
            print(f"  adapter-steps at least {steps}; weight bytes at least {shared / 1e12:.2f} TB "
                  f"({alone / 1e12:.2f} TB if no two requests of an adapter ran side by side)")  # fmt: skip
            act = ACT * sum(r["input_len"] for r in reqs)
            for ref in REFERENCE[name]:
                t = tokens / ref
                bounds = ", ".join(f"{t / (t + shared / bw):.3f} at {bw / 1e12:.2f} TB/s" for bw in TBPS)
                print(f"  adapter-free run at {ref} tok/s takes {t:.2f} s: ratio at most {bounds}")
                if name == "S2":  # S1's 8-adapter run moves the same activations, so they cancel there
                    unfused = ", ".join(f"{t / (t + (shared + act) / bw):.3f}" for bw in TBPS)
                    print(
                        f"    with the unfused kernels' {act / 1e12:.2f} TB of prompt activations: {unfused}"
                    )


if __name__ == "__main__":
    main()
