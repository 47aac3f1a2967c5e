#!/usr/bin/env bash
# session 7, call 1 (tree 7fa5372): S2 (issue 14) with the distinct-adapter bound per step swept:
# the default (as many as the pool has ids), then --max-loras-per-batch 32, 16 and 8, each a fresh server on
# the same model, adapters and requests; base-only first (default server) and last (bound-8 server);
# every run reports distinct adapters per plan (lorapipe_step_adapters)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/s7c1; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
export SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3
t0=$SECONDS
(SERVER_FLAGS="$F" S2_PASSES="base mix" timeout 300 bash tools/run_churn_bench.sh $R/def) > $R/def.txt 2>&1
echo "def done at $((SECONDS - t0)) s"
for m in 32 16 8; do
  passes="mix"; [ $m = 8 ] && passes="mix base"
  left=$((575 - (SECONDS - t0)))
  [ $left -gt 60 ] || { echo "no time for $m"; break; }
  (SERVER_FLAGS="$F --max-loras-per-batch $m" S2_PASSES="$passes" timeout $left bash tools/run_churn_bench.sh $R/m$m) > $R/m$m.txt 2>&1
  echo "m$m done at $((SECONDS - t0)) s"
done
cat $R/*/ready.txt
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
          f"step_s {dl('step_seconds_sum'):.1f}, graphs {dl('decode_graph_replays'):.0f}+{dl('step_graph_replays'):.0f}")
PY
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s7c1
