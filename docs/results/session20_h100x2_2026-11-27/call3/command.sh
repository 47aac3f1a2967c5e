#!/bin/bash
# Session 20, call 3 (nvidia-h100-x2): the tensor-parallel tests on two GPUs (after the teardown fix),
# then generation throughput of an 8B-shaped model at TP=1 and TP=2 (tools/bench_tp.py), base-only and
# with 4 rank-16 adapters, and the greedy tokens of the two sizes compared; then the 1B-shaped at TP=2.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
env | grep -E "NCCL|MULTICAST|NVSHMEM" | sort
(timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_tensor_parallel_gpu.py \
  tests/runtime/test_tensor_parallel.py > $OUT/tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/tests.txt)
tail -4 $OUT/tests.txt
t=$(date +%s); python3 tools/make_tiny_model.py /tmp/m8b --arch llama --preset 8b > /dev/null
python3 tools/make_adapters.py /tmp/m8b /tmp/a8b --n 4 --ranks 16 > /dev/null; echo "8B made in $(( $(date +%s) - t )) s"
for tp in 1 2; do
  timeout 200 python3 -m tools.bench_tp /tmp/m8b --tp $tp --adapters /tmp/a8b/* --batch 16 \
    --prompt-len 128 --output-len 256 --rounds 1 --out $OUT/b8_tp$tp.json 2>&1 | grep -v "^\[W\|^frame" | tail -3
done
python3 -m tools.compare_greedy $OUT/b8_tp1.json $OUT/b8_tp2.json
python3 tools/make_tiny_model.py /tmp/m1b --arch llama --preset 1b > /dev/null
python3 tools/make_adapters.py /tmp/m1b /tmp/a1b --n 4 --ranks 16 > /dev/null
timeout 120 python3 -m tools.bench_tp /tmp/m1b --tp 2 --adapters /tmp/a1b/* --batch 16 \
  --prompt-len 128 --output-len 256 --rounds 1 --out $OUT/b1_tp2.json 2>&1 | grep -v "^\[W\|^frame" | tail -3
