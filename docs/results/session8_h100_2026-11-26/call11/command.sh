#!/usr/bin/env bash
# session 8, call 11 (tree 8fea5a8), a repeat of call 10, then S2 on the same tree (base mix mix base and the 60 % run): issue 15's GPU-busy share of a served burst (1,000 requests 256/128 at
# once), the worker's step profiler over plans 800-999, base-only and with 32 resident rank-16 adapters
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/s8c11; mkdir -p $R
for run in base adapters; do
  extra=; [ $run = base ] && extra="BASE_ONLY=1"
  (env $extra PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 ORDER=B B_FLAGS="--profile-dir $R/$run/p --profile-steps 800:200" timeout 200 bash tools/run_ab_serving.sh $R/$run $PWD $PWD) > $R/$run.txt 2>&1
  tail -4 $R/$run.txt | head -2
  grep -h "step profile" $R/$run/server_B1.log | grep wall | cut -c1-400
  for t in $R/$run/p/*.json.gz; do PYTHONPATH=/tmp/site:$PWD python3 -m tools.gpu_timeline $t --top 25 > $R/$run/timeline.txt; done
  head -12 $R/$run/timeline.txt
  rm -rf $R/$run/p
  for f in $R/$run/run_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
done
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
(PYTHONPATH=/tmp/site:$PWD SCRATCH=/tmp/scratch TRITON_CACHE_DIR=/tmp/tcache METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3 SERVER_FLAGS="$F" timeout 330 bash tools/run_churn_bench.sh $R/s2) > $R/s2.txt 2>&1
grep -h "s2_throughput_ratio\|s2_ttft_ratio\|wait_p99\|^| s2" $R/s2.txt
for f in $R/s2/s2_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=abscratch --exclude=scratch s8c11
