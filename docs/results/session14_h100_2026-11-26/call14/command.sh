#!/usr/bin/env bash
# Session 14, call 14 (one H100): the review's mend: the fused kernel's rank chunks through the plain
# expand's rank_step/row_gather (B = this tree) against f633b02 (A, .base/f633b02), A-B-A, --act fused.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
P31=$(python3 -c "print(','.join(['256']*31))")
b() { (cd $1 && PYTHONPATH=/tmp/site:$1 python3 -m tools.bench_lora_step --act fused "${@:2}" | grep "us ") }
for side in A B A; do
  if [ $side = A ]; then T=$PWD/.base/f633b02; else T=$PWD; fi
  echo "== $side"
  b $T --adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $P31 --only "graphed bm16 (bound 768)"
  b $T --decodes 100 --prefill 1024,1024,1024,1024,512 --only "graphed bm16 (bound 576)"
  b $T --only "graphed bm16 (bound 320)"
done
