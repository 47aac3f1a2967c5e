#!/usr/bin/env bash
# session 7, call 2 (tree 7fa5372 + results of call 1): S2 (issue 14) with steps of up to 8,192 tokens in
# CUDA graphs (--cuda-graph-max-tokens 8192; the default graphs steps up to 2,048) and with every S2
# adapter (up to 90 MB) copied whole before its step rather than layer by layer (--overlap-min-mb 128),
# so that steps carrying loads replay graphs too. Three fresh servers, same model, adapters and requests.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/s7c2; mkdir -p $R
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
export SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3 S2_RATE_RUN=0
t0=$SECONDS
(SERVER_FLAGS="$F" S2_PASSES="base mix" timeout 300 bash tools/run_churn_bench.sh $R/def) > $R/def.txt 2>&1
echo "def done at $((SECONDS - t0)) s"
left=$((570 - (SECONDS - t0)))
(SERVER_FLAGS="$F --cuda-graph-max-tokens 8192" S2_PASSES="base mix" timeout $left bash tools/run_churn_bench.sh $R/g8k) > $R/g8k.txt 2>&1
echo "g8k done at $((SECONDS - t0)) s"
left=$((570 - (SECONDS - t0)))
(SERVER_FLAGS="$F --cuda-graph-max-tokens 8192 --overlap-min-mb 128" S2_PASSES="mix base" S2_RATE_RUN=1 timeout $left bash tools/run_churn_bench.sh $R/g8k_whole) > $R/g8k_whole.txt 2>&1
echo "g8k_whole done at $((SECONDS - t0)) s"
cat $R/*/ready.txt; grep -h "graph" $R/*/server_s2.log | grep -i "captured\|memory pool" | cut -c1-250
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
          f"step_s {dl('step_seconds_sum'):.1f}, graphs {dl('decode_graph_replays'):.0f}+{dl('step_graph_replays'):.0f}, "
          f"sched busy {dl('scheduler_busy_s'):.2f} s")
    d.pop("requests", None); f.write_text(json.dumps(d, indent=1))
PY
grep -h "s2_throughput_ratio\|s2_ttft_ratio\|wait_p99" $R/*.txt
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s7c2
