#!/bin/bash
# Session 20, call 4 (nvidia-h100-x2): after the teardown change (abort on NCCL): the two-GPU tests,
# then the 8B-shaped float32 model (weight-bound at batch 16) at TP=2, then TP=1 on the same machine.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
(timeout 110 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_tensor_parallel_gpu.py > $OUT/tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/tests.txt)
tail -3 $OUT/tests.txt
t=$(date +%s); python3 tools/make_tiny_model.py /tmp/m8b --arch llama --preset 8b > /dev/null
python3 tools/make_adapters.py /tmp/m8b /tmp/a8b --n 4 --ranks 16 > /dev/null; echo "8B made in $(( $(date +%s) - t )) s" | tee $OUT/made.txt
for tp in 2 1; do
  t=$(date +%s)
  timeout 120 python3 -m tools.bench_tp /tmp/m8b --tp $tp --adapters /tmp/a8b/* --batch 16 \
    --prompt-len 128 --output-len 256 --rounds 1 --out $OUT/b8_tp$tp.json > $OUT/b8_tp$tp.log 2>&1
  echo "tp $tp rc=$? in $(( $(date +%s) - t )) s"; tail -2 $OUT/b8_tp$tp.log
done
python3 -m tools.compare_greedy $OUT/b8_tp1.json $OUT/b8_tp2.json | tee $OUT/greedy.txt
