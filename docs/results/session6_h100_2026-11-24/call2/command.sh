#!/usr/bin/env bash
# session 6, call 2: where the host time goes in a base-only burst on 400263a: the server (all stages) and
# the benchmark client under py-spy (on-CPU samples, 200 Hz), /metrics before and after; then one run with
# the step profiler (steps 800-999) for the GPU-busy share and the top kernels
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PATH=/tmp/site/bin:$PATH
R=/tmp/r2; mkdir -p $R
T=$PWD/.base/400263a S=/tmp/abscratch
model=$S/llama-1b
cd $T; export PYTHONPATH=/tmp/site:$T TRITON_CACHE_DIR=/tmp/tcache
[ -f $model/config.json ] || python3 -m tools.make_tiny_model $model --preset 1b --dtype bfloat16 --seed 0 > /dev/null
python3 -m tools.workload --out $R/w.jsonl --num-prompts 1000 --input-len 256 --output-len 128 --num-adapters 32 --request-rate inf --seed 0 --base-share 1.0
F="--model $model --device cuda --dtype bfloat16 --max-loras-per-batch 32 --max-cpu-loras 32 --max-lora-rank 16 --max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --endpoint tcp://127.0.0.1:29000 --metrics-port 29001"
B="python3 -m tools.bench_serving --endpoint tcp://127.0.0.1:29000 --metrics-url http://127.0.0.1:29001/metrics --metrics-interval 0 --workload $R/w.jsonl"
scrape() { python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:29001/metrics').read().decode())" > $1; }
one() {  # $1 label, $2 extra server flags, $3 1 = under py-spy
  local L=$1
  if [ "$3" = 1 ]; then
    py-spy record --subprocesses --nonblocking -r 200 --format raw -o $R/$L.server.raw -- python3 -m runtime.cli serve $F $2 > $R/$L.server.log 2>&1 &
  else
    python3 -m runtime.cli serve $F $2 > $R/$L.server.log 2>&1 &
  fi
  local P=$!
  timeout 200 python3 -m tools.wait_ready tcp://127.0.0.1:29000 --since "$(date +%s.%N)" --pid $P
  $B --quiet --label warm-up
  scrape $R/$L.metrics_before.txt
  if [ "$3" = 1 ]; then
    py-spy record --nonblocking -r 200 --format raw -o $R/$L.client.raw -- $B --label $L --out $R/$L.run.json | tail -4
  else
    $B --label $L --out $R/$L.run.json | tail -4
  fi
  scrape $R/$L.metrics_after.txt
  pkill -TERM -f "runtime.cli serve"; timeout 60 tail --pid=$P -f /dev/null
}
one spy "" 1
one plain "" 0
one prof "--profile-dir $R/prof --profile-steps 800:200" 0
grep -h "step profile" $R/prof.server.log | grep wall | cut -c1-300
for t in $R/prof/*.json.gz; do python3 -m tools.gpu_timeline $t --top 25 > $R/prof_timeline.txt; done
head -60 $R/prof_timeline.txt
rm -f $R/prof/*.json.gz $R/w.jsonl
tar -czf $OUT/results.tgz -C /tmp r2
