"""Profile Planner.schedule on an S2-shaped drain on the CPU: 1,000 requests (input 32-1024, output 16-256)
over 1,000 adapters of ranks 8-64 with Zipf popularity, a 4 GB-shaped pool, one adapter staged every third
plan, loads reported ready a step later. Run from the tree root: PYTHONPATH=$PWD python bench.py"""

import cProfile
import pstats
import random
import sys
import time

from proto.plan import FinishedRequest, StepResult
from proto.sampling import SamplingParams
from stages.scheduler.planner import Planner, PlannerConfig

rng = random.Random(0)
N_AD, N_REQ = 1000, 1000
ranks = {f"adapter{i}": (8, 16, 32, 64)[i % 4] for i in range(N_AD)}
row_mb = 1.4
cfg = PlannerConfig(
    num_pages=40000,
    page_size=16,
    pool_rows=int(4096 / row_mb),
    pool_ids=256,
    max_lora_rank=64,
    max_running_requests=256,
    max_tokens_per_step=8192,
    max_model_len=2048,
    prefetch_depth=8,
    overlap_loading=True,
    overlap_min_bytes=int(sys.argv[1]) << 20 if len(sys.argv) > 1 else 128 << 20,
    max_loras_per_batch=256,
)
ready: set[str] = set()
planner = Planner(
    cfg,
    adapter_rows=ranks.__getitem__,
    adapter_ready=ready.__contains__,
    load_bytes=lambda n: int(ranks[n] * row_mb * 2**20),
)
w = [1 / (i + 1) for i in range(N_AD)]
names = list(ranks)
for i in range(N_REQ):
    a = rng.choices(names, w)[0]
    planner.add(f"r{i}", [1] * rng.randint(32, 1024), a, SamplingParams(max_tokens=rng.randint(16, 256)))
for a in names[:100]:
    ready.add(a)
pending = []
t_sched = 0.0
plans = 0
prof = cProfile.Profile()
while planner.has_work:
    plans += 1
    if plans % 3 == 0:
        for a in planner.adapters_needed()[:1]:
            ready.add(a)
    t0 = time.perf_counter()
    prof.enable()
    plan = planner.schedule()
    prof.disable()
    t_sched += time.perf_counter() - t0
    fin = []
    for r in planner.running:
        if r.num_tokens - len(r.prompt_ids) >= r.sampling.max_tokens:
            fin.append(
                FinishedRequest(
                    request_id=r.request_id, reason="length", num_output_tokens=r.sampling.max_tokens
                )
            )
    planner.update(StepResult(step=plan.step, finished=fin, slots_ready=pending))
    pending = [ld.slot for ld in plan.slot_loads]
print(f"plans {plans}, schedule {t_sched:.3f} s, {t_sched / plans * 1e3:.2f} ms/plan")
pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
