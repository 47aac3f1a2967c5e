#!/usr/bin/env bash
# Session 16, call 6 (one H100): call 5's failures, each in a process of its own: the Triton variants of
# test_offline_vs_peft.py (now on the GPU where there is one), and the step profiler's window test, one
# parameter alone and then the whole file.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tcache
P="python3 -m pytest -q -p no:randomly -p no:cacheprovider"
timeout 300 $P tests/runtime/test_offline_vs_peft.py -k triton > $OUT/offline_vs_peft.txt 2>&1; echo "peft rc $?"; tail -2 $OUT/offline_vs_peft.txt
timeout 60 $P "tests/stages/worker/test_step_profiler.py::test_the_trace_holds_exactly_the_window[False]" > $OUT/prof_false.txt 2>&1; echo "prof[False] rc $?"; tail -1 $OUT/prof_false.txt
timeout 60 $P tests/stages/worker/test_step_profiler.py > $OUT/prof_file.txt 2>&1; echo "prof file rc $?"; grep -E "^(FAILED|ERROR)" $OUT/prof_file.txt; tail -1 $OUT/prof_file.txt
