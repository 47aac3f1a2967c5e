#!/usr/bin/env bash
# session 8, call 15 (tree 46f1f08): does the 4 GB pool's ceiling on resident adapters cost S2 plans, as it
# does S1? S2's mix on a server with an 8 GB GPU adapter pool (POOL_GB=8) between two with the target's 4 GB
# (base-only on the first); same model, adapters and requests
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/s8c15; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
export SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3 S2_RATE_RUN=0
t0=$SECONDS
(SERVER_FLAGS="$F" S2_PASSES="base mix" timeout 280 bash tools/run_churn_bench.sh $R/p4a) > $R/p4a.txt 2>&1; echo "p4a at $((SECONDS - t0)) s"
(SERVER_FLAGS="$F" S2_PASSES="mix" POOL_GB=8 timeout 150 bash tools/run_churn_bench.sh $R/p8) > $R/p8.txt 2>&1; echo "p8 at $((SECONDS - t0)) s"
(SERVER_FLAGS="$F" S2_PASSES="mix" timeout 150 bash tools/run_churn_bench.sh $R/p4b) > $R/p4b.txt 2>&1; echo "p4b at $((SECONDS - t0)) s"
python3 - $R <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*/s2_*.json")):
    d = json.loads(f.read_text()); s = d["summary"]; sm = d.get("server_metrics") or {}
    a, b = sm.get("start") or {}, sm.get("end") or {}
    def dl(k):
        return (b.get(k) or 0) - (a.get(k) or 0)
    n = dl("step_adapters_count")
    print(f"{f.parent.name}/{f.stem}: {s['output_throughput']:.0f} tok/s, TTFT P50 {s['ttft']['p50']:.3f} s, "
          f"wait P99 {s.get('adapter_wait_p99_s')}, plans {dl('plans'):.0f}, distinct/plan "
          f"{dl('step_adapters_sum') / n if n else float('nan'):.1f}, loads {dl('adapter_loads'):.0f}, "
          f"slot loads {dl('slot_loads'):.0f}, step_s {dl('step_seconds_sum'):.1f}")
    d.pop("requests", None); f.write_text(json.dumps(d, indent=1))
PY
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s8c15
