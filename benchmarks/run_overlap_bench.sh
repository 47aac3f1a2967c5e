#!/usr/bin/env bash
# Overlapped adapter loading + prefetch against synchronous loading, on the GPU in one command (docs/benchmarks.md,
# "Large adapters loaded while serving"). Parts (PARTS, in this order):
#   h2d   host→device bandwidth of slot copies (benchmarks.bench_h2d)
#   large Llama-3.1-8B-shaped model, 32 rank-64 adapters (~335 MB), 8 slots, distinct adapters, short
#         requests: synchronous loading, then overlap + prefetch (a fresh server each, the same warm-up)
#   itl   decode ITL of requests on pinned adapters while the others load, then the identical workload
#         with every adapter resident (one server per mode in ITL_MODES)
#   small optional: 1b model, 32 rank-16 adapters, 8 slots, uniform (SGLang's worst case), both modes
# and writes OUT_DIR/results.md.
#   usage: bash benchmarks/run_overlap_bench.sh [OUT_DIR]     (knobs: the environment variables below)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${TMPDIR:-/tmp}/lorapipe-bench/overlap_bench}")
py=${PYTHON:-python3}
scratch=${SCRATCH:-$out/scratch}           # models and adapters, reused when complete (8b: 16 GB + 10.7 GB)
parts=${PARTS:-"h2d large itl"}
device=${DEVICE:-cuda} preset=${PRESET:-8b} dtype=${DTYPE:-bfloat16}  # cpu/tiny/float32: a smoke test
nad=${NUM_ADAPTERS:-32}
rank=${RANK:-64}
slots=${SLOTS:-8}                          # GPU slots of the large-adapter servers
num=${NUM_PROMPTS:-400}                    # large: requests, Poisson at RATE req/s (~50 s a mode)
rate=${RATE:-8}                            # ~2/3 of what 8 slots serve with distinct adapters (~12 req/s)
sat_num=${SAT_PROMPTS:-512}                # large: then this many all at once (saturation, ~8 s); 0: skip
in_len=${INPUT_LEN:-128} out_len=${OUTPUT_LEN:-32}
# the same warm-up workload before every large/small run: as many requests at once as the saturating run,
# so every kernel variant the measured runs need is compiled before them (a 64-request warm-up left one
# for the 512-request run: a 4 s compile stall inside it)
warm=${WARMUP_PROMPTS:-$((sat_num > 64 ? sat_num : 64))}
seed=${SEED:-0}
port=${PORT:-28100}
server_flags=${SERVER_FLAGS:-"--max-model-len 2048"}  # added to every server
max_ratio=${MAX_RATIO:-0.6}                # large: overlap/sync median TTFT and E2E must be <= this
h2d_sizes=${H2D_SIZES_MB:-16,64,335} h2d_reps=${H2D_REPS:-30}
itl_modes=${ITL_MODES:-overlap}            # add "sync" for a control run that shows what loads cost
itl_resident=${ITL_RESIDENT:-2}            # adapter0.. pinned; the other adapters load during the run
# 30 short requests over 192 decode steps: ~15% of the long requests' steps admit one (eager, slower), so
# their P95 sits inside that group (a synchronous load stalls exactly those steps), not on its edge
itl_long=${ITL_LONG_REQUESTS:-8} itl_long_out=${ITL_LONG_OUTPUT:-192}
itl_short_out=${ITL_SHORT_OUTPUT:-16} itl_rate=${ITL_RATE:-12} itl_start=${ITL_START:-0.5}
itl_tolerance=${ITL_TOLERANCE:-0.05}
itl_repeats=${ITL_REPEATS:-2}              # runs with loads (and as many without), A-B-B-A, pooled
itl_pool_gb=${ITL_POOL_GB:-}               # GPU adapter pool of the itl server (default: all adapters + 10 %)
# COMMIT: the commit named in results.md (default: git's HEAD; set it where the tree is a copy)
small_num=${SMALL_NUM_PROMPTS:-200}        # small: as docs/benchmarks.md runs 4-6 (256 in / 128 out, r=inf)
small_min=${SMALL_MIN_RATIO:-0.95}         # small: overlap/sync output tok/s must be >= this (run spread ~10%)
mkdir -p "$out" "$scratch"
has_mpl=$("$py" -c "import matplotlib" 2>/dev/null && echo 1 || true)
timings=()
part_start=$SECONDS
done_part() { timings+=("$1: $((SECONDS - part_start)) s"); echo "== $1 took $((SECONDS - part_start)) s"; part_start=$SECONDS; }
want() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# --- model and adapters (generated in parallel; a .complete marker makes a rerun reuse them) ------------
prepare() { # MODEL_PRESET RANK -> sets model, adir
  model=$scratch/llama-$1-$dtype adir=$scratch/adapters-$1-r$2-n$nad-$dtype
  local pid=
  if [ ! -f "$model/.complete" ]; then
    rm -rf "$model"
    ("$py" -m tools.make_tiny_model "$model" --preset "$1" --dtype "$dtype" --seed 0 && touch "$model/.complete") &
    pid=$!
    until [ -f "$model/config.json" ] || ! kill -0 "$pid" 2>/dev/null; do sleep 0.5; done
  fi
  if [ ! -f "$adir/.complete" ]; then
    rm -rf "$adir"
    "$py" -m tools.make_adapters "$model" "$adir" --n "$nad" --ranks "$2" --targets all --dtype "$dtype" \
      --seed 0 >/dev/null
    touch "$adir/.complete"
  fi
  [ -z "$pid" ] || wait "$pid" || { echo "make_tiny_model $1 failed" >&2; exit 1; }
}

# --- one server at a time --------------------------------------------------------------------------------
server= endpoint= metrics= nserver=0
start_server() { # LOG FLAGS...
  local log=$1 i p=$((port + 2 * nserver))
  shift
  nserver=$((nserver + 1)) endpoint=tcp://127.0.0.1:$p metrics=http://127.0.0.1:$((p + 1))/metrics
  "$py" -m runtime.cli serve --model "$model" --device "$device" --dtype "$dtype" "$@" \
    --endpoint "$endpoint" --metrics-port $((p + 1)) >"$log" 2>&1 &
  server=$!
  for ((i = 0; ; i++)); do
    kill -0 "$server" 2>/dev/null || { echo "lorapipe serve exited; see $log" >&2; exit 1; }
    "$py" -c "import sys; from runtime.client import Client
with Client(sys.argv[1], timeout=2.0) as c: sys.exit(0 if c.health().ok else 1)" "$endpoint" 2>/dev/null && break
    [ "$i" -lt 900 ] || { echo "lorapipe serve not ready after 900 s; see $log" >&2; exit 1; }
    sleep 1
  done
}
stop_server() { if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -TERM "$server"; wait "$server" || true; fi; server=; }
trap stop_server EXIT
bench() { "$py" -m tools.bench_serving --endpoint "$endpoint" --metrics-url "$metrics" "$@"; }

# --- one scenario, synchronous then overlapped: a fresh server each, the same warm-up and workloads -------
run_pair() { # NAME RANK SLOTS TAG...: workloads NAME_warmup.jsonl, NAME_TAG.jsonl -> NAME_TAG_MODE.json
  local name=$1 r=$2 n=$3 mode extra plot adapters=() i tag
  shift 3
  for ((i = 0; i < nad; i++)); do adapters+=(--adapter "adapter$i=$adir/adapter$i"); done
  for mode in sync overlap; do
    extra=()
    [ "$mode" = overlap ] || extra=(--no-overlap-loading --prefetch-depth 0)
    # shellcheck disable=SC2086  # server_flags is a list of flags
    start_server "$out/server_${name}_$mode.log" --max-loras-per-batch "$n" --max-cpu-loras "$nad" \
      --max-lora-rank "$r" $server_flags "${extra[@]}" "${adapters[@]}"
    bench --workload "$out/${name}_warmup.jsonl" --quiet
    for tag in "$@"; do
      plot=()
      [ -z "$has_mpl" ] || plot=(--plot "$out/${name}_${tag}_$mode.png")
      bench --workload "$out/${name}_$tag.jsonl" --label "$name $tag $mode" --out "$out/${name}_${tag}_$mode.json" \
        "${plot[@]}"
    done
    stop_server
  done
}
compare_pair() { # NAME TAG SPEC...: overlap over sync -> NAME_TAG_compare.{json,md}
  local base=$out/$1_$2
  shift 2
  local specs=()
  for s in "$@"; do specs+=(--metric "$s"); done
  "$py" -m tools.bench_compare "${base}_overlap.json" "${base}_sync.json" "${specs[@]}" --out "${base}_compare.json" \
    >"${base}_compare.md"
  cat "${base}_compare.md"
}

# --- decode ITL of resident requests while the other adapters load -----------------------------------------
run_itl() { # MODE
  local mode=$1 extra=() res=() load=() specs=() i
  [ "$mode" = overlap ] || extra=(--no-overlap-loading --prefetch-depth 0)
  for ((i = 0; i < nad; i++)); do
    if ((i < itl_resident)); then res+=("adapter$i"); else load+=("adapter$i") specs+=("adapter$i=$adir/adapter$i"); fi
  done
  local resident=$(IFS=,; echo "${res[*]}") loading=$(IFS=,; echo "${load[*]}")
  local gen=(--resident "$resident" --loading "$loading" --resident-requests "$itl_long" --seed "$seed"
    --resident-input-len "$in_len" --resident-output-len "$itl_long_out" --loading-input-len "$in_len"
    --loading-output-len "$itl_short_out" --loading-rate "$itl_rate" --loading-start "$itl_start")
  "$py" -m benchmarks.itl_workload --out "$out/itl_workload.jsonl" "${gen[@]}"
  "$py" -m benchmarks.itl_workload --out "$out/itl_warmup.jsonl" "${gen[@]}" --as-resident
  local args=()
  for i in "${res[@]}"; do args+=(--adapter "$i=$adir/$i" --pin-adapter "$i"); done
  evict_loading() { "${ops[@]}" unload "${load[@]}" && "${ops[@]}" load "${specs[@]}"; }
  # every adapter fits a slot, so a run without loads follows one with; only the resident ones are
  # registered at start-up, the loading ones are registered (staged in host memory) by adapter_ops
  # every adapter must fit the pool at once, or the resident runs copy too (the default pool, a share of
  # free memory, holds fewer than 32 of 335 MB on an H100); after server_flags, so it wins over theirs
  local pool_gb=${itl_pool_gb:-$(du -sb "$adir" | awk '{v = $1 * 1.1 / 2^30; printf "%.4f", v < 0.01 ? 0.01 : v}')}
  # shellcheck disable=SC2086
  start_server "$out/server_itl_$mode.log" --max-loras-per-batch "$nad" --max-cpu-loras "$nad" --adapter-root "$adir" \
    --max-lora-rank "$rank" $server_flags --lora-gpu-memory-gb "$pool_gb" "${extra[@]}" "${args[@]}"
  local ops=("$py" -m tools.adapter_ops --endpoint "$endpoint") k loads=() quiet=()
  # warm-up: the workload itself, so every kernel variant its batches need is compiled (a first-time
  # compile stalls every request for up to seconds)
  bench --workload "$out/itl_warmup.jsonl" --quiet
  "${ops[@]}" load "${specs[@]}"
  bench --workload "$out/itl_workload.jsonl" --quiet
  # repeats in A-B-B-A order (loads, resident, resident, loads, ...) so drift between runs cancels; before
  # each run with loads the loading adapters leave their slots and are staged again into host memory only
  for ((k = 1; k <= itl_repeats; k++)); do
    loads+=("$out/itl_${mode}_loads$k.json") quiet+=("$out/itl_${mode}_quiet$k.json")
    if ((k % 2)); then
      evict_loading
      bench --workload "$out/itl_workload.jsonl" --label "itl $mode: loads $k" --out "${loads[-1]}"
      bench --workload "$out/itl_workload.jsonl" --label "itl $mode: resident $k" --out "${quiet[-1]}"
    else
      bench --workload "$out/itl_workload.jsonl" --label "itl $mode: resident $k" --out "${quiet[-1]}"
      evict_loading
      bench --workload "$out/itl_workload.jsonl" --label "itl $mode: loads $k" --out "${loads[-1]}"
    fi
  done
  stop_server
  "$py" -m benchmarks.itl_under_load --loads "${loads[@]}" --quiet "${quiet[@]}" --adapters "$resident" \
    --tolerance "$itl_tolerance" --out "$out/itl_$mode.json" >"$out/itl_$mode.md"
  cat "$out/itl_$mode.md"
}

if want h2d || want large || want itl; then
  prepare "$preset" "$rank"
  done_part "generate $preset model + $nad rank-$rank adapters"
fi
if want h2d; then
  "$py" -m benchmarks.bench_h2d --model "$model" --device "$device" --dtype "$dtype" --sizes-mb "$h2d_sizes" \
    --reps "$h2d_reps" --work-dir "$scratch" --out "$out/h2d.json" | tee "$out/h2d.md"
  done_part "h2d"
fi
large_tags=("r$rate")
[ "$sat_num" -eq 0 ] || large_tags+=(rinf)
large_specs=("ttft.p50<=$max_ratio" "e2e.p50<=$max_ratio" ttft.p95 e2e.p95 output_throughput)
if want large; then
  gen=(--num-adapters "$nad" --adapter-distribution distinct --input-len "$in_len" --output-len "$out_len")
  "$py" -m tools.workload --out "$out/large_r$rate.jsonl" "${gen[@]}" --num-prompts "$num" --request-rate "$rate" \
    --seed "$seed"
  [ "$sat_num" -eq 0 ] || "$py" -m tools.workload --out "$out/large_rinf.jsonl" "${gen[@]}" --num-prompts "$sat_num" \
    --seed "$seed"
  "$py" -m tools.workload --out "$out/large_warmup.jsonl" "${gen[@]}" --num-prompts "$warm" --seed $((seed + 999))
  run_pair large "$rank" "$slots" "${large_tags[@]}"
  for tag in "${large_tags[@]}"; do compare_pair large "$tag" "${large_specs[@]}"; done
  done_part "large (2 servers)"
fi
if want itl; then
  for m in $itl_modes; do run_itl "$m"; done
  done_part "itl ($itl_modes)"
fi
if want small; then
  prepare 1b 16
  gen=(--num-adapters "$nad" --adapter-distribution uniform --input-len 256 --output-len 128)
  "$py" -m tools.workload --out "$out/small_rinf.jsonl" "${gen[@]}" --num-prompts "$small_num" --seed "$seed"
  "$py" -m tools.workload --out "$out/small_warmup.jsonl" "${gen[@]}" --num-prompts "$warm" --seed $((seed + 999))
  run_pair small 16 "$slots" rinf
  compare_pair small rinf "output_throughput>=$small_min" ttft.p50 e2e.p50
  done_part "small (2 servers)"
fi

# --- results.md from whatever results exist ----------------------------------------------------------------
section() { # TITLE FILE...: the files' contents, or a note that the part did not run
  local f shown=
  echo "## $1"
  echo
  shift
  for f in "$@"; do if [ -f "$f" ]; then cat "$f"; echo; shown=1; fi; done
  [ -n "$shown" ] || { echo "_not run_"; echo; }
}
pair_tables() { # NAME TITLE TAG...: the runs' table, then each tag's comparison
  local name=$1 title=$2 files=() f tag
  shift 2
  for tag in "$@"; do
    for f in "$out/${name}_${tag}_sync.json" "$out/${name}_${tag}_overlap.json"; do [ ! -f "$f" ] || files+=("$f"); done
  done
  [ "${#files[@]}" -gt 0 ] || return 0
  echo "## $title"
  echo
  "$py" -m tools.bench_report "${files[@]}"
  for tag in "$@"; do
    [ -f "$out/${name}_${tag}_compare.md" ] || continue
    echo
    echo "Overlap + prefetch over synchronous, $tag:"
    echo
    cat "$out/${name}_${tag}_compare.md"
  done
  echo
}
{
  echo "# Overlapped adapter loading: $(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' || true
  "$py" -c "import torch; print(f'torch {torch.__version__}')"
  echo
  echo "Knobs: PRESET=$preset DTYPE=$dtype NUM_ADAPTERS=$nad RANK=$rank SLOTS=$slots NUM_PROMPTS=$num RATE=$rate SAT_PROMPTS=$sat_num" \
    "INPUT_LEN=$in_len OUTPUT_LEN=$out_len WARMUP_PROMPTS=$warm SEED=$seed; SERVER_FLAGS=\"$server_flags\";" \
    "ITL: resident=$itl_resident long=${itl_long}x$itl_long_out short_out=$itl_short_out rate=$itl_rate start=$itl_start." \
    "Part times: ${timings[*]/%/;}"
  echo
  section "Host→device: slot copies vs pinned bandwidth (target: ≥16 MB adapters at ≥0.85× and ≥46 GB/s)" "$out/h2d.md"
  pair_tables large "Large adapters: $nad × rank $rank, $slots slots, distinct, $in_len in / $out_len out; $num requests at $rate req/s (r$rate), $sat_num all at once (rinf). Target: median TTFT and E2E ≤ $max_ratio× synchronous" "${large_tags[@]}"
  section "Decode ITL of resident requests while other adapters load (target: P95 with loads ≤ (1 + $itl_tolerance)× without)" \
    "$out/itl_overlap.md" "$out/itl_sync.md"
  pair_tables small "Many small adapters: 1b, rank 16, $nad adapters, $slots slots, uniform, 256 in / 128 out, $small_num all at once. Target: no worse than synchronous (output tok/s ≥ $small_min×)" rinf
} >"$out/results.md"
cat "$out/results.md"
