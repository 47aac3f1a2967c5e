#!/bin/bash
# Prepared for the next session with a multi-GPU machine (nvidia-h100-x2), not yet run: the 8B model
# first (about 2 min), then the tensor-parallel tests on two GPUs with room to compile, then TP=1 and TP=2
# A-B-B-A on the same machine, and the greedy tokens of the two sizes compared.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
t=$(date +%s); python3 tools/make_tiny_model.py /tmp/m8b --arch llama --preset 8b > /dev/null
python3 tools/make_adapters.py /tmp/m8b /tmp/a8b --n 4 --ranks 16 > /dev/null; echo "8B made in $(( $(date +%s) - t )) s"
(timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_tensor_parallel_gpu.py > $OUT/tests.txt 2>&1
 echo "pytest rc=$?" >> $OUT/tests.txt)
tail -3 $OUT/tests.txt
for tp in 1 2 2 1; do
  n=$((n + 1))
  timeout 200 python3 -m tools.bench_tp /tmp/m8b --tp $tp --adapters /tmp/a8b/* --batch 16 \
    --prompt-len 128 --output-len 256 --rounds 1 --out $OUT/b8_run${n}_tp$tp.json > $OUT/b8_run${n}.log 2>&1
  echo "run $n tp $tp rc=$?"; grep -v "^\[W\|^frame" $OUT/b8_run${n}.log | tail -1
done
python3 -m tools.compare_greedy $OUT/b8_run1_tp1.json $OUT/b8_run2_tp2.json | tee $OUT/greedy.txt
