set -u
export S=/tmp/scratch
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/stages/worker/test_lora_slots.py \
   tests/integration/test_overlap_gpu.py > $OUT/gputests.log 2>&1; echo "gpu tests rc=$?" >> $OUT/gputests.log
tail -2 $OUT/gputests.log
mkdir -p /tmp/cfg8b && python3 -c "import json; from tools.make_tiny_model import build_config; json.dump(build_config('llama','8b',dtype='bfloat16'), open('/tmp/cfg8b/config.json','w'))"
mkdir -p /tmp/ob
timeout 60 python3 -m tools.bench_h2d --model /tmp/cfg8b --sizes-mb 16,64,335 --reps 30 --out /tmp/ob/h2d.json > /tmp/ob/h2d.md 2>&1
echo "h2d rc=$?"; cat /tmp/ob/h2d.md
SCRATCH=$S PARTS="small" timeout 330 bash tools/run_overlap_bench.sh /tmp/ob > /tmp/ob/small.log 2>&1
echo "small rc=$?"
grep -A12 "Many small" /tmp/ob/results.md
timeout 100 python3 tools/profile_step.py --model $S/llama-1b-bfloat16 --adapter-dir $S/adapters-1b-r16-n32-bfloat16 \
  --prefill --batch 8 --ctx 256 --steps 10 --cprofile 5 --out /tmp/ob/profile_prefill.json > /tmp/ob/profile_prefill.txt 2>&1
echo "profile rc=$?"; grep -A8 "^case" /tmp/ob/profile_prefill.txt
tar czf $OUT/ob2.tgz -C /tmp --exclude=scratch ob
