#!/usr/bin/env bash
# Session 14, call 6 (one H100): the LoRA kernels loading their tile's metadata row beside the batch
# header instead of after it (B = this tree) against f7a856c (A, .base/f7a856c), A-B-A per step, graphed
# at the 16-token tile with the runner's bound; decode steps with the configs of their tile class.
# Before the call: mkdir -p .base/f7a856c && git archive f7a856c | tar -x -C .base/f7a856c; carry .whl and .base/f7a856c.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
P31=$(python3 -c "print(','.join(['256']*31))")
b() { (cd $1 && PYTHONPATH=/tmp/site:$1 python3 -m tools.bench_lora_step "${@:2}" | grep "us ") }
for side in A B A; do
  if [ $side = A ]; then T=$PWD/.base/f7a856c; else T=$PWD; fi
  echo "== $side"
  b $T --adapters 32 --ranks 16 --decodes 256 --prefill "" --only "graphed bm16 (bound 256)" --config-tiles 32
  b $T --adapters 8 --ranks 16 --decodes 256 --prefill "" --only "graphed bm16 (bound 256)" --config-tiles 32
  b $T --decodes 256 --prefill "" --only "graphed bm16 (bound 256)" --config-tiles 128
  b $T --only "graphed bm16 (bound 320)"
  b $T --adapters 32 --ranks 16 --pool-gb 7 --decodes 64 --prefill $P31 --only "graphed bm16 (bound 768)"
done
