set -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "tree: commit $(cat .cache/commit)"
( timeout 300 python3 -m pytest -q -p no:cacheprovider tests/stages/worker/test_lora_slots.py \
   tests/integration/test_overlap_gpu.py tests/stages/worker/test_layer_waits_gpu.py \
   tests/runtime/test_offline_gpu.py > $OUT/gputests.log 2>&1; echo "gpu tests rc=$?" >> $OUT/gputests.log ) &
tp=$!
COMMIT=$(cat .cache/commit) SCRATCH=/tmp/scratch PARTS="h2d large itl" timeout 540 bash tools/run_overlap_bench.sh /tmp/ob > /tmp/ob.log 2>&1
echo "bench rc=$?"
wait $tp
tail -3 $OUT/gputests.log
cp /tmp/ob.log $OUT/bench.log
tar czf $OUT/ob.tgz -C /tmp --exclude=scratch ob
cat /tmp/ob/results.md 2>/dev/null | head -80
