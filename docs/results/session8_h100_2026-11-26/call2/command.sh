#!/usr/bin/env bash
# session 8, call 2: S2 (issue 14) side by side, A = 7fa5372 with the flags that are now defaults
# (--cuda-graph-max-tokens 8192 --overlap-min-mb 128), B = d37fa34 (those defaults, plus the scheduler's
# staging pass that counts its holds once per pass, f4b91cc). Same model, adapters and requests.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/s8c2; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
export SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3
t0=$SECONDS
(cd .base/7fa5372 && PYTHONPATH=/tmp/site:$PWD SERVER_FLAGS="$F --cuda-graph-max-tokens 8192 --overlap-min-mb 128" S2_PASSES="base mix" S2_RATE_RUN=0 timeout 280 bash tools/run_churn_bench.sh $R/a) > $R/a.txt 2>&1
echo "A done at $((SECONDS - t0)) s"
(PYTHONPATH=/tmp/site:$PWD SERVER_FLAGS="$F" S2_PASSES="mix base" S2_RATE_RUN=1 timeout $((575 - SECONDS + t0)) bash tools/run_churn_bench.sh $R/b) > $R/b.txt 2>&1
echo "B done at $((SECONDS - t0)) s"
cat $R/*/ready.txt
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
          f"step_s {dl('step_seconds_sum'):.1f}, graphs {dl('decode_graph_replays'):.0f}+{dl('step_graph_replays'):.0f}, "
          f"sched busy {dl('scheduler_busy_s'):.2f} s")
    d.pop("requests", None); f.write_text(json.dumps(d, indent=1))
PY
grep -h "s2_throughput_ratio\|s2_ttft_ratio\|wait_p99" $R/*.txt
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s8c2
