#!/usr/bin/env bash
# What the per-request sampling features cost on one GPU ("Sampling features" in docs/benchmarks.md):
# the offline engine (the server's planner, executor and runner) on a 1b-shaped model with 32 resident
# rank-16 adapters, 256 requests of 128 tokens in, 128 out, all at once. The model's tokenizer is a
# 128k-token BPE (benchmarks/bpe_tokenizer.py), so grammar masks cost what a real vocabulary costs.
#   usage: bash benchmarks/run_sampling_features.sh OUT_DIR [OLD_TREE]
# OLD_TREE: a checkout of the commit before the features (e.g. `git archive COMMIT | tar -x -C OLD_TREE`);
# given, `plain` runs A-B-B-A, A on OLD_TREE and B here, each its own process. This tree also runs
# top_logprobs=5, a JSON schema on every request, and a bounded schema whose every output must validate.
# Knobs: NUM_PROMPTS (256), INPUT_LEN (128), OUTPUT_LEN (128), PRESET (1b), DEVICE (cuda), DTYPE
# (bfloat16), SCRATCH, VARIANTS (without OLD_TREE: this tree's variants in order, e.g.
# plain,logprobs5,logprobs5,plain); PRESET=tiny DEVICE=cpu DTYPE=float32 NUM_PROMPTS=8 is a plumbing check.
# PROFILE=1: one more process of this tree runs each variant under torch.profiler and cProfile too
# (bench_sampling_features.py --profile), into OUT_DIR/profile.json; it is not counted in the table.
# GUIDED_STEP=1: benchmarks/bench_guided_step.py on the model's tokenizer too (CPU only: one step's
# grammar feed and masks for 256 requests, one template against one per thread), into OUT_DIR/guided_step.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
out=$(realpath -m "${1:?usage: run_sampling_features.sh OUT_DIR [OLD_TREE]}")
old=${2:+$(realpath "$2")}
py=${PYTHON:-python3}
preset=${PRESET:-1b} device=${DEVICE:-cuda} nad=32
scratch=${SCRATCH:-${TMPDIR:-/tmp}/lorapipe_sampling_scratch}
mkdir -p "$out" "$scratch"
model=$scratch/llama-$preset adir=$scratch/adapters-$preset
if [ ! -f "$model/.complete" ]; then
  rm -rf "$model"
  "$py" -m tools.make_tiny_model "$model" --preset "$preset" --dtype bfloat16 --seed 0
  [ "$preset" = tiny ] || "$py" -m benchmarks.bpe_tokenizer "$model"  # 128k tokens: the 1b/8b vocab holds them
  touch "$model/.complete"
fi
if [ ! -f "$adir/.complete" ]; then
  rm -rf "$adir"
  "$py" -m tools.make_adapters "$model" "$adir" --n "$nad" --ranks 16 --targets all --dtype bfloat16 --seed 0 \
    >/dev/null && touch "$adir/.complete"
fi
args=(--model "$model" --adapter-dir "$adir" --num-adapters "$nad" --num-prompts "${NUM_PROMPTS:-256}"
  --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}" --device "$device" --dtype "${DTYPE:-bfloat16}")
bench=$here/benchmarks/bench_sampling_features.py
run() { # LABEL TREE VARIANTS [OUT_FILE [EXTRA_ARG]]
  (cd "$2" && PYTHONPATH=$2${PYTHONPATH:+:$PYTHONPATH} "$py" "$bench" "${args[@]}" --label "$1" --variants "$3" \
    "${4:-$out/run_$1.json}" ${5:+"$5"})
}
if [ -n "$old" ]; then
  run A1 "$old" plain
  run B2 "$here" plain,logprobs5,guided,guided_check
  run B3 "$here" plain,logprobs5,guided
  run A4 "$old" plain
else
  run B1 "$here" "${VARIANTS:-plain,logprobs5,guided,guided_check,plain}"
fi
if [ "${PROFILE:-0}" = 1 ]; then run P "$here" plain,logprobs5,guided "$out/profile.json" --profile; fi
if [ "${GUIDED_STEP:-0}" = 1 ] && [ "$preset" != tiny ]; then  # the host's grammar work a step, alone
  "$py" -m benchmarks.bench_guided_step --tokenizer "$model" --templates 1,0 --busy-ms 2 "$out/guided_step"
fi
"$py" - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [r for f in sorted(out.glob("run_*.json")) for r in json.loads(f.read_text())]
tput, step_ms = {}, {}
for r in rows:
    tput.setdefault((r["label"][0], r["variant"]), []).append(r["tok_s"])
    if "ms_per_step" in r:
        step_ms.setdefault((r["label"][0], r["variant"]), []).append(r["ms_per_step"])
print("| build | variant | output tok/s (each run) | median |\n| --- | --- | --- | --- |")
for (side, variant), v in sorted(tput.items()):
    print(f"| {side} | {variant} | {', '.join(f'{x:.0f}' for x in v)} | {statistics.median(v):.0f} |")
med = {k: statistics.median(v) for k, v in tput.items()}
plain = med[("B", "plain")]
summary = {"median": {f"{s}/{v}": x for (s, v), x in med.items()}}
summary["median_ms_per_step"] = {f"{s}/{v}": statistics.median(x) for (s, v), x in step_ms.items()}
if ("A", "plain") in med:
    summary["B_plain_over_A_plain"] = plain / med[("A", "plain")]
for v in ("logprobs5", "guided"):
    if ("B", v) in med:
        summary[f"{v}_over_plain"] = med[("B", v)] / plain
checks = [r for r in rows if r["variant"] == "guided_check"]
summary["guided_check_valid"] = [f"{r['valid']}/{r['requests']}" for r in checks]
summary["errors"] = sum(r.get("errors", 0) for r in rows)
print(json.dumps(summary, indent=1))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
EOF
