#!/usr/bin/env bash
# session 8, call 6: bc5b3a4 (graphed steps tile LoRA tokens by 16, tile bound from max_seqs) against
# d37fa34: the GPU tests that capture LoRA graphs and check the warm-up, then S2 (A = d37fa34 base+mix,
# B = bc5b3a4 mix+base and the 60 % run), then the resident 32-adapter run A-B-B-A
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/s8c6; mkdir -p $R
t0=$SECONDS
(PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider tests/stages/worker/test_warmup_gpu.py \
  tests/stages/worker/test_step_graphs_gpu.py tests/kernels/test_triton_backend.py tests/runtime/test_offline_gpu.py) > $R/gpu_tests.txt 2>&1
tail -3 $R/gpu_tests.txt; echo "tests done at $((SECONDS - t0)) s"
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
export SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3
(cd .base/d37fa34 && PYTHONPATH=/tmp/site:$PWD SERVER_FLAGS="$F" S2_PASSES="base mix" S2_RATE_RUN=0 timeout 150 bash tools/run_churn_bench.sh $R/a) > $R/a.txt 2>&1
(PYTHONPATH=/tmp/site:$PWD SERVER_FLAGS="$F" S2_PASSES="mix base" S2_RATE_RUN=1 timeout 170 bash tools/run_churn_bench.sh $R/b) > $R/b.txt 2>&1
echo "S2 done at $((SECONDS - t0)) s"
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
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 timeout $((575 - SECONDS + t0)) bash tools/run_ab_serving.sh $R/ab32 .base/d37fa34 $PWD) > $R/ab32.txt 2>&1
tail -9 $R/ab32.txt; echo "ab done at $((SECONDS - t0)) s"
for f in $R/ab32/run_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch --exclude=abscratch s8c6
