"""How many decode rounds S1 needs under a given GPU adapter pool (session 19, CPU; a model, not a server).

The real Planner (stages/scheduler/planner.py, the server's defaults: affinity 200 steps, prefetch 8,
overlap from 128 MB) plans issue 14's S1 request lists: 1,000 requests of 256 prompt and 128 output
tokens over 8 or 2,000 rank-16 adapters (uniform), at most 256 running and 8,192 tokens a step, every
adapter staged on the host at once. Each plan counts as one step; every running request emits a token a
step. Only the planner is real: the figures count plans and what each one holds, not time.

Why the rounds: a request that is admitted runs every step until its 128 tokens are out, and its
adapter must stay resident for all of them. 1,000 requests over 2,000 uniform adapters name about 780
distinct adapters; a 4 GB pool holds about 190 rank-16 adapters (3,050 rank rows), so at least
ceil(780 / 190) = 5 adapters must take one pool place one after another: 5 rounds of 128 steps, against
ceil(1,000 / 256) = 4 for the 8-adapter requests, whatever the admission order. Only pausing requests
(and reloading their adapters) could spread the fifth round over the others.
    python docs/results/session19_cpu_2026-11-26/rounds/sim.py   (from the repository root)"""

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

ROW = 1.41e6  # bytes of one rank row of the 1B-shaped model over all layers and projections


def run(path: Path, pool_rows: int) -> dict:
    reqs = [json.loads(line) for line in path.open()]
    cfg = PlannerConfig(
        num_pages=100000, page_size=16, pool_rows=pool_rows, pool_ids=pool_rows // 4, max_lora_rank=16,
        max_loras_per_batch=pool_rows // 4, max_running_requests=256, max_tokens_per_step=8192,
        max_model_len=2048, overlap_loading=True, prefetch_depth=8, overlap_min_bytes=128 << 20,
        affinity_steps=200,
    )  # fmt: skip
    p = Planner(cfg, adapter_rows=lambda a: 16, load_bytes=lambda a: int(16 * ROW))
    out_len = {}
    for i, r in enumerate(reqs):  # a burst: every request is queued before the first plan
        p.add(f"r{i}", [1] * r["input_len"], r["adapter"], SamplingParams(max_tokens=r["max_tokens"]))
        out_len[f"r{i}"] = r["max_tokens"]
    running, distinct = [], []
    while p.has_work:
        plan = p.schedule()
        running.append(len(p.running))
        distinct.append(len({r.adapter for r in p.running if r.adapter}))
        done = []
        for r in p.running:
            n = r.num_tokens - len(r.prompt_ids)
            if n >= out_len[r.request_id]:
                done.append(FinishedRequest(request_id=r.request_id, reason="length", num_output_tokens=n))
        p.update(StepResult(step=plan.step, finished=done, slots_ready=[x.slot for x in plan.slot_loads]))
    return {
        "plans": len(running),
        "running / plan": round(statistics.mean(running), 1),
        "distinct adapters / plan": round(statistics.mean(distinct), 1),
        "running, every 32nd plan": running[::32],
    }


def main() -> None:
    g = ["--num-prompts", "1000", "--input-len", "256", "--output-len", "128", "--request-rate", "inf"]
    g += ["--seed", "0", "--adapter-distribution", "uniform"]
    with tempfile.TemporaryDirectory() as d:
        for n in (8, 2000):
            path = Path(d) / f"{n}.jsonl"
            cmd = [sys.executable, "-m", "tools.workload", "--out", str(path), *g, "--num-adapters", str(n)]
            subprocess.run(cmd, check=True, capture_output=True)
            names = {json.loads(line)["adapter"] for line in path.open()}
            print(f"{n} adapters: {len(names)} distinct among the requests", flush=True)
            for rows in (3050, 3120, 3300, 3500, 4570, 6100):
                label = f"pool {rows} rank rows ({rows // 16} rank-16 adapters)"
                print(f"  {label}: {run(path, rows)}", flush=True)


if __name__ == "__main__":
    main()
