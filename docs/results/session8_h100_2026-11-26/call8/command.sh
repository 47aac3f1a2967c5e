#!/usr/bin/env bash
# session 8, call 8: the resident 32-adapter run (issue 14's no-regression pair) in the order B A A B,
# A = d37fa34, B = bc5b3a4 (calls 1 and 6, in the order A B B A, had their second run lowest), then
# tools/bench_lora_step.py on bc5b3a4's own graphed preparation (16-token tile and the tighter bound)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
R=/tmp/s8c8; mkdir -p $R
t0=$SECONDS
(PYTHONPATH=/tmp/site SCRATCH=/tmp/abscratch TRITON_CACHE_DIR=/tmp/tcache PYTHON=python3 ORDER="B A A B" timeout 420 bash tools/run_ab_serving.sh $R/ab32 .base/d37fa34 $PWD) > $R/ab32.txt 2>&1
tail -9 $R/ab32.txt; cat $R/ab32/ready.txt; echo "ab done at $((SECONDS - t0)) s"
for f in $R/ab32/run_*.json; do python3 -c "
import json,sys;p=sys.argv[1];d=json.load(open(p));d.pop('requests',None);json.dump(d,open(p,'w'),indent=1)" $f; done
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
timeout 60 python3 -m tools.bench_lora_step --out $R/mixed.json 2>&1 | grep -v Warn
timeout 60 python3 -m tools.bench_lora_step --decodes 256 --prefill "" --out $R/decode.json 2>&1 | grep -v Warn
tar -czf $OUT/results.tgz -C /tmp --exclude='*.jsonl' --exclude=abscratch s8c8
