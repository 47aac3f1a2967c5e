#!/usr/bin/env bash
# session 8, call 7: S2 side by side, A = d37fa34, B = bc5b3a4 (graphed steps tile LoRA tokens by 16, tile
# bound from max_seqs), fresh server per run, order A B B A (base-only on the first and last server)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/s8c7; mkdir -p $R
t0=$SECONDS
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
export SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3 S2_RATE_RUN=0
i=0
for side in A B B A; do
  i=$((i + 1)); passes=mix; [ $i = 1 ] && passes="base mix"; [ $i = 4 ] && passes="mix base"
  if [ $side = A ]; then dir=.base/d37fa34; else dir=.; fi
  (cd $dir && PYTHONPATH=/tmp/site:$PWD SERVER_FLAGS="$F" S2_PASSES="$passes" timeout $([ $i = 1 ] && echo 280 || echo 150) bash tools/run_churn_bench.sh $R/$i$side) > $R/$i$side.txt 2>&1
  echo "$i$side done at $((SECONDS - t0)) s"
done
PYTHONPATH=/tmp/site:$PWD python3 - $R <<'PY'
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
    d.pop("requests", None); f.write_text(json.dumps(d, indent=1))
PY
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s8c7
