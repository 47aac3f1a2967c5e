#!/usr/bin/env bash
# session 8, call 12 (tree 8fea5a8): the loader's disk(page cache)->host rate at rank 16 (22.5 MB) by the
# number of part-writer processes (the default is 8 on this 16-core host), order 8 16 12 12 16 8, then 16
# writers with 16 loads at once
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=$OUT/s8c12; mkdir -p $R /tmp/bl
k=0
for w in 8 16 12 12 16 8; do
  k=$((k + 1))
  timeout 80 python3 -m tools.bench_loader --preset 1b --ranks 16 --adapter-dtype bfloat16 --reps 7 --writers $w --work-dir /tmp/bl --out $R/w${w}_$k.json 2>&1 | tail -3 | tee -a $R/loader.txt
done
timeout 80 python3 -m tools.bench_loader --preset 1b --ranks 16 --adapter-dtype bfloat16 --reps 7 --writers 16 --parallel 16 --work-dir /tmp/bl --out $R/w16_p16.json 2>&1 | tail -3 | tee -a $R/loader.txt
