set -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "tree: commit $(cat .cache/commit)"
COMMIT=$(cat .cache/commit) SCRATCH=/tmp/scratch PARTS="large" timeout 560 bash tools/run_overlap_bench.sh /tmp/ob > /tmp/ob.log 2>&1
echo "bench rc=$?"
cp /tmp/ob.log $OUT/bench.log
tar czf $OUT/ob.tgz -C /tmp --exclude=scratch ob
cat /tmp/ob/results.md 2>/dev/null | head -60
