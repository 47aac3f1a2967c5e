#!/usr/bin/env bash
# Session 17, call 1 (one H100, tree 8efb6c0): where S2's mix spends its extra time. Issue 14's S2 (1,000
# adapters of ranks 8/16/32/64, Zipf 1.0, 32:1024 in, 16:256 out, GPU pool 4 GB, host cache 8 GB; 1B shape),
# one fresh server for the mix and one for base-only, each with the worker's step profiler over plans
# 350-799 (after the 256-request warm-up burst), then tools.gpu_timeline on each trace. The profiler slows
# the runs: their throughput is not a result. The warm-up's variant count is in each server log.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/s17c1; mkdir -p $R
t0=$SECONDS
for run in mix base; do
  if [ $run = mix ]; then lim=370; else lim=$((585 - SECONDS + t0)); fi
  F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0 --profile-dir $R/$run/p --profile-steps 350:450"
  (PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 \
    PYTHON=python3 SERVER_FLAGS="$F" S2_PASSES="$run" S2_RATE_RUN=0 \
    timeout $lim bash tools/run_churn_bench.sh $R/$run) > $R/$run.txt 2>&1
  echo "$run rc=$? at $((SECONDS - t0)) s"
  grep -h "warm-up: [0-9]* LoRA" $R/$run/server_s2.log | cut -c1-200
  grep -h "step profile" $R/$run/server_s2.log | cut -c1-600
  for t in $R/$run/p/*.json.gz; do PYTHONPATH=/tmp/site:$PWD python3 -m tools.gpu_timeline $t --top 30 > $R/$run/timeline.txt; done
  head -40 $R/$run/timeline.txt
  PYTHONPATH=/tmp/site:$PWD python3 -m tools.bench_runs $R/$run/s2_*.json 2>/dev/null
  rm -rf $R/$run/p
  for f in $R/$run/s2_*.json; do python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=scratch s17c1
