"""The real Planner over S2's request lists with a step-cost model instead of a GPU (session 10, CPU).

Each plan costs A + B x tokens + C x (adapter bytes of its distinct adapters) x 1.56 (activations of
the LoRA kernels at the eighth session's measured ratio, 1.9 GB per 3.4 GB of adapter rows); A, B, C
were fitted so that the burst runs match the measured S2 throughputs of session 8 call 7 (base-only
30.4k tok/s, mix 18.8k tok/s). Adapter i has rank 8/16/32/64 as `tools/run_churn_bench.sh` makes them
(i mod 64, cycled), 1.41 MB a rank row, a 4 GB pool of 762 ids; host staging is taken as instant.
Only the planner is real: the figures say how admission order moves plans, distinct adapters per plan
and TTFT, not what a server measures.
    python docs/results/session10_cpu_2026-11-26/affinity_sim/sim.py   (from the repository root)"""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from proto.plan import FinishedRequest, StepResult  # noqa: E402
from proto.sampling import SamplingParams  # noqa: E402
from stages.scheduler.planner import Planner, PlannerConfig  # noqa: E402

ROW = 1.41e6
RANKS = [8, 16, 32, 64]
A, B, C = 0.0035, 3.0e-06, 5.43e-13


def rank_of(adapter: str) -> int:
    return RANKS[(int(adapter.removeprefix("adapter")) % 64) % 4]


def run(path: Path, affinity: int) -> dict:
    reqs = [json.loads(line) for line in path.open()]
    cfg = PlannerConfig(
        num_pages=100000, page_size=16, pool_rows=int(4e9 / ROW), pool_ids=762, max_lora_rank=64,
        max_loras_per_batch=762, max_running_requests=256, max_tokens_per_step=8192, max_model_len=2048,
        overlap_loading=True, prefetch_depth=8, overlap_min_bytes=128 << 20, affinity_steps=affinity,
    )  # fmt: skip
    now = [0.0]
    p = Planner(cfg, adapter_rows=rank_of, clock=lambda: now[0], load_bytes=lambda a: int(rank_of(a) * ROW))
    out_len, first, arrival = {}, {}, {}
    i = steps = distinct_sum = 0
    adapter_bytes = 0.0
    while i < len(reqs) or p.has_work:
        while i < len(reqs) and reqs[i]["arrival"] <= now[0]:
            r, rid = reqs[i], f"r{i}"
            p.add(rid, [1] * r["input_len"], r["adapter"], SamplingParams(max_tokens=r["max_tokens"]))
            out_len[rid], arrival[rid] = r["max_tokens"], r["arrival"]
            i += 1
        if not p.has_work:
            now[0] = reqs[i]["arrival"]
            continue
        plan = p.schedule()
        steps += 1
        listed = {x.request_id: x.num_scheduled_tokens for x in [*plan.new_requests, *plan.cached_requests]}
        tokens = sum(listed.values()) + sum(1 for r in p.running if r.request_id not in listed)
        distinct = {r.adapter for r in p.running if r.adapter}
        nbytes = sum(rank_of(a) * ROW for a in distinct)
        now[0] += A + B * tokens + C * nbytes * 1.56
        adapter_bytes += nbytes
        distinct_sum += len(distinct)
        done = []
        for r in p.running:
            n = r.num_tokens - len(r.prompt_ids)
            if n >= 1 and r.request_id not in first:
                first[r.request_id] = now[0] - arrival[r.request_id]
            if n >= out_len[r.request_id]:
                done.append(FinishedRequest(request_id=r.request_id, reason="length", num_output_tokens=n))
        p.update(StepResult(step=plan.step, finished=done, slots_ready=[x.slot for x in plan.slot_loads]))
    t = sorted(first.values())
    return {
        "plans": steps, "output tok/s": round(sum(out_len.values()) / now[0]),
        "TTFT P50 s": round(statistics.median(t), 3), "TTFT P99 s": round(t[int(0.99 * len(t))], 3),
        "distinct / plan": round(distinct_sum / steps, 1),
        "adapter GB / plan": round(adapter_bytes / steps / 1e9, 2),
    }  # fmt: skip


def main() -> None:
    g = ["--num-prompts", "1000", "--input-len", "32:1024", "--output-len", "16:256",
         "--num-adapters", "1000", "--adapter-distribution", "zipf:1.0", "--seed", "0"]  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        lists = {
            "base-only burst": ["--request-rate", "inf", "--base-share", "1.0"],
            "mix burst": ["--request-rate", "inf"],
            "mix at 56 req/s": ["--request-rate", "56"],
        }
        for name, extra in lists.items():
            path = Path(d) / f"{len(extra)}.jsonl"
            subprocess.run([sys.executable, "-m", "tools.workload", "--out", str(path), *g, *extra],
                           check=True, capture_output=True)  # fmt: skip
            for affinity in [0] if name.startswith("base") else [0, 25, 50, 100, 200, 400]:
                print(f"{name:<16} affinity {affinity:>3}: {run(path, affinity)}", flush=True)


if __name__ == "__main__":
    main()
