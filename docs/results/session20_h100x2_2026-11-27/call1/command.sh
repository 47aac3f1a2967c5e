#!/bin/bash
# Session 20, call 1 (nvidia-h100-x2): the tensor-parallel tests on two GPUs, then the 1B-shaped
# generation benchmark at TP=1 and TP=2 (tools/bench_tp.py), each base-only and with 4 rank-16 adapters.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
set -x
nvidia-smi -L
env | grep -E "NCCL|MULTICAST|NVSHMEM" | sort
timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_tensor_parallel_gpu.py \
  tests/runtime/test_tensor_parallel.py 2>&1 | tail -40 > $OUT/tests.txt
tail -3 $OUT/tests.txt
python3 tools/make_tiny_model.py /tmp/m1b --arch llama --preset 1b > /dev/null
python3 tools/make_adapters.py /tmp/m1b /tmp/a1b --n 4 --ranks 16 > /dev/null
ls /tmp/a1b
for tp in 1 2; do
  timeout 240 python3 -m tools.bench_tp /tmp/m1b --tp $tp --adapters /tmp/a1b/* --batch 16 \
    --prompt-len 128 --output-len 256 --rounds 2 --out $OUT/b1_tp$tp.json 2>&1 | tail -5
done
python3 -m tools.compare_greedy $OUT/b1_tp1.json $OUT/b1_tp2.json
