#!/usr/bin/env bash
# Session 13, call 11 (one H100, tree ae496d2): the resident 32-adapter burst against the same requests
# without adapters, on this tree: tools/run_ab_serving.sh with BASE_ONLY=1, then with adapters, two
# servers each (ORDER="B B"; 1,000 requests 256/128, 32 rank-16 adapters).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
for mode in base lora; do
  if [ $mode = base ]; then b=1; else b=; fi
  BASE_ONLY=$b ORDER="B B" PYTHON=python3 SCRATCH=/tmp/scratch timeout 280 bash tools/run_ab_serving.sh $OUT/$mode \
    $PWD $PWD > $OUT/$mode.txt 2>&1
  echo "$mode rc=$? at $((SECONDS - t0)) s"; tail -5 $OUT/$mode.txt
  for f in $OUT/$mode/*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d.pop('requests',None); json.dump(d,open(sys.argv[1],'w'),indent=1)" $f; done
  rm -rf $OUT/$mode/scratch $OUT/$mode/*.jsonl $OUT/$mode/*.log
done
