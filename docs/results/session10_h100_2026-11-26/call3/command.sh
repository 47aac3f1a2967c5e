#!/usr/bin/env bash
# session 10, call 3: adapter affinity in admission (--adapter-affinity-steps N), one tree; S2 (issue 14's
# mix) on one fresh server per setting: N=0 (queue order, today's default), 100, 200, then 0 again, and the
# 60 % run on the N=200 server.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
export SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3
run() {  # $1 label, $2 affinity steps, $3 passes, $4 rate run
  SERVER_FLAGS="$F --adapter-affinity-steps $2" S2_PASSES="$3" S2_RATE_RUN=$4 timeout 200 bash tools/run_churn_bench.sh $OUT/$1 > $OUT/$1.txt 2>&1
  echo "$1 rc=$? at $((SECONDS - t0)) s"
}
run a0 0 "base mix" 0
run b100 100 "mix mix" 0
run c200 200 "mix mix base" 1
run d0 0 "mix" 0
python3 - $OUT <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*/s2_*.json")):
    d = json.loads(f.read_text()); s = d["summary"]; sm = d.get("server_metrics") or {}
    a, b = sm.get("start") or {}, sm.get("end") or {}
    def dl(k):
        return (b.get(k) or 0) - (a.get(k) or 0)
    n = dl("step_adapters_count")
    print(f"{f.parent.name}/{f.stem}: {s['output_throughput']:.0f} tok/s, TTFT P50 {s['ttft']['p50']:.3f} P99 {s['ttft']['p99']:.3f} s, "
          f"wait P99 {s.get('adapter_wait_p99_s')}, plans {dl('plans'):.0f}, distinct/plan "
          f"{dl('step_adapters_sum') / n if n else float('nan'):.1f}, step_s {dl('step_seconds_sum'):.1f}")
    d.pop("requests", None); f.write_text(json.dumps(d, indent=1))
PY
echo "done at $((SECONDS - t0)) s"
