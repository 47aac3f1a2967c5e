#!/bin/bash
# Session 20, call 2 (nvidia-h100-x2): where does a two-GPU engine stop? A tiny model at TP=2 on CUDA
# with graphs, stacks of every process (py-spy) after 60 s.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
cat > /tmp/smoke.py <<'PY'
import sys, time, logging
logging.basicConfig(level=logging.INFO)
from runtime.synthetic.model import make_model
from tests.conftest import mixed_adapters
from runtime.offline import LLM
from proto.sampling import SamplingParams
from pathlib import Path
m = make_model(Path("/tmp/tiny/llama"), arch="llama", preset="tiny", seed=1)
ad = mixed_adapters(m, Path("/tmp/tiny/ad"))
t = time.time()
kw = dict(adapters=ad, dtype="float32", max_lora_rank=16, device="cuda", num_pages=512, lora_gpu_memory_gb=0.05)
if len(sys.argv) > 2: kw["cuda_graph_max_batch"] = 0; kw["cuda_graph_max_tokens"] = 0
with LLM(m, tensor_parallel_size=int(sys.argv[1]), **kw) as llm:
    print("built", time.time() - t, flush=True)
    out = llm.generate(["The river", "A quiet"], ["full8", None], SamplingParams(max_tokens=4, ignore_eos=True))
    print([o.token_ids for o in out], time.time() - t, flush=True)
print("closed", flush=True)
PY
for args in "2 eager" "2"; do
  echo "== tp $args"
  timeout 90 python3 /tmp/smoke.py $args > /tmp/smoke.log 2>&1 &
  pid=$!
  for i in $(seq 60); do sleep 1; kill -0 $pid 2>/dev/null || break; done
  if kill -0 $pid 2>/dev/null; then
    for p in $(pgrep -f "smoke.py|runtime.tp_ranks"); do echo "-- pid $p"; /tmp/site/bin/py-spy dump --pid $p 2>&1 | head -60; done
  fi
  wait $pid; echo "rc=$?"
  grep -v "^\[W\|^frame" /tmp/smoke.log | tail -30
done
