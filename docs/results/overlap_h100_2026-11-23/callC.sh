set -u
export S=/tmp/scratch; mkdir -p $S /tmp/oc
( python3 -m tools.make_tiny_model $S/m1b --preset 1b --dtype bfloat16 --seed 0 > /tmp/oc/gen.log 2>&1 &&
  python3 -m tools.make_adapters $S/m1b $S/a1b --n 8 --ranks 16 --targets all --dtype bfloat16 --seed 0 >> /tmp/oc/gen.log 2>&1; echo "gen rc=$?" >> /tmp/oc/gen.log ) &
gp=$!
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/stages/worker/test_lora_slots.py \
   tests/integration/test_overlap_gpu.py tests/stages/worker/test_layer_waits_gpu.py > /tmp/oc/gputests.log 2>&1; echo "gpu tests rc=$?" >> /tmp/oc/gputests.log
tail -2 /tmp/oc/gputests.log
mkdir -p /tmp/cfg8b && python3 -c "import json; from tools.make_tiny_model import build_config; json.dump(build_config('llama','8b',dtype='bfloat16'), open('/tmp/cfg8b/config.json','w'))"
wait $gp; tail -1 /tmp/oc/gen.log
timeout 60 python3 -m tools.bench_h2d --model /tmp/cfg8b --sizes-mb 16,64,335 --reps 30 --out /tmp/oc/h2d.json > /tmp/oc/h2d.md 2>&1
echo "h2d rc=$?"; cat /tmp/oc/h2d.md
timeout 150 python3 tools/profile_step.py --model $S/m1b --adapter-dir $S/a1b --slots 8 \
  --prefill --batch 8 --ctx 256 --steps 10 --cprofile 5 --out /tmp/oc/profile_prefill.json > /tmp/oc/profile_prefill.txt 2>&1
echo "profile rc=$?"; grep -A8 "^case" /tmp/oc/profile_prefill.txt
tar czf $OUT/oc.tgz -C /tmp oc
