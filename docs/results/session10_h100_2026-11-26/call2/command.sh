#!/usr/bin/env bash
# session 10, call 2: LoRA shrinks on a side stream in captured graphs (--lora-shrink-stream), one tree,
# the flag off (A) against on (B): the GPU tests of step and decode graphs with it, S2 (issue 14's mix)
# on one server of each, then one decode step and one mixed step of 64 distinct adapters (profile_step).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
t0=$SECONDS
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/stages/worker/test_step_graphs_gpu.py \
  tests/stages/worker/test_warmup_gpu.py > $OUT/gpu_tests.txt 2>&1
echo "tests rc=$? at $((SECONDS - t0)) s"; tail -3 $OUT/gpu_tests.txt
F="--max-model-len 2048 --max-running-requests 256 --max-tokens-per-step 8192 --port 0"
export SCRATCH=/tmp/scratch METRICS_INTERVAL=0 PARTS=s2 PYTHON=python3 S2_RATE_RUN=0
SERVER_FLAGS="$F --no-lora-shrink-stream" S2_PASSES="mix base" timeout 150 bash tools/run_churn_bench.sh $OUT/a > $OUT/a.txt 2>&1
echo "A rc=$? at $((SECONDS - t0)) s"
SERVER_FLAGS="$F --lora-shrink-stream" S2_PASSES="mix base mix" timeout 150 bash tools/run_churn_bench.sh $OUT/b > $OUT/b.txt 2>&1
echo "B rc=$? at $((SECONDS - t0)) s"
python3 - $OUT <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*/s2_*.json")):
    d = json.loads(f.read_text()); s = d["summary"]; sm = d.get("server_metrics") or {}
    a, b = sm.get("start") or {}, sm.get("end") or {}
    def dl(k):
        return (b.get(k) or 0) - (a.get(k) or 0)
    n = dl("step_adapters_count")
    print(f"{f.parent.name}/{f.stem}: {s['output_throughput']:.0f} tok/s, TTFT P50 {s['ttft']['p50']:.3f} s, "
          f"plans {dl('plans'):.0f}, distinct/plan {dl('step_adapters_sum') / n if n else float('nan'):.1f}, "
          f"step_s {dl('step_seconds_sum'):.1f}, graphs {dl('decode_graph_replays'):.0f}+{dl('step_graph_replays'):.0f}")
    d.pop("requests", None); f.write_text(json.dumps(d, indent=1))
PY
P=$OUT/profile; mkdir -p $P
M=/tmp/scratch/llama-1b AD=/tmp/scratch/realmix
for s in no- "" no- ""; do
  for shape in "--batch 256" "--batch 190 --mix-prefill 768"; do
    [ $((SECONDS - t0)) -lt 520 ] || break 2
    tag=$(echo "${s}stream $shape" | tr -c 'a-z0-9\n' _)
    timeout 90 python3 tools/profile_step.py --model $M --adapter-dir $AD --ctx 256 --steps 30 --slots 64 --distinct 64 \
      --max-lora-rank 64 --lora-gpu-memory-gb 4 --${s}lora-shrink-stream $shape --out $P/$tag.{k}.json > $P/$tag.txt 2>&1
    echo "== ${s}lora-shrink-stream $shape (rc=$?)"; grep -E "graph|lora" $P/$tag.txt | tail -4
  done
done
echo "done at $((SECONDS - t0)) s"
