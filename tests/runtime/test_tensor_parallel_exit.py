"""Tensor parallelism's all-reduce paths and its ways out (gloo, two processes on the CPU): which path a
message of each size takes, a close that ends every rank with status 0, a second engine in one process
after close() (stepping serially, where the first overlapped its steps), a clear refusal of a second
engine while the first is open, and a rank killed mid-generation that ends every process in bound."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from proto.sampling import SamplingParams
from runtime.offline import LLM
from stages.worker.tp.allreduce import (
    ONE_SHOT_MAX_BYTES,
    SYMM_MEM_WORLD_SIZES,
    TWO_SHOT_MAX_BYTES,
    AllReducePaths,
    peer_capable,
)
from tests.runtime.test_offline_vs_peft import PROMPTS

SAMPLING = SamplingParams(max_tokens=4, ignore_eos=True)


def test_each_size_takes_one_path_with_inclusive_thresholds():
    paths = AllReducePaths(peer=True, one_shot_max=1024, two_shot_max=8192)
    want = {1: "one_shot", 1024: "one_shot", 1025: "two_shot", 8192: "two_shot", 8193: "nccl"}
    assert {n: paths.path(n) for n in want} == want
    assert {AllReducePaths(peer=False).path(n) for n in (1, ONE_SHOT_MAX_BYTES, 1 << 30)} == {"nccl"}
    # the defaults keep the order the crossovers need, and two-shot's largest message fits the buffer
    assert 0 < ONE_SHOT_MAX_BYTES < TWO_SHOT_MAX_BYTES


def test_peer_memory_is_refused_with_its_reason():
    cpu = torch.device("cpu")
    assert peer_capable(cpu, 2, disabled=True) == (False, "disabled (--disable-custom-all-reduce)")
    assert peer_capable(cpu, 2, disabled=False) == (False, "not on CUDA")
    odd = next(n for n in range(2, 9) if n not in SYMM_MEM_WORLD_SIZES)
    ok, why = peer_capable(torch.device("cuda:0"), odd, disabled=False)
    assert not ok and f"a group of {odd} ranks" in why


ROOT = Path(__file__).resolve().parents[2]
EXIT_BOUND_S = 10.0  # a killed rank: every process ends within this


def _engine(model, adapters, **kw) -> LLM:
    return LLM(
        model, device="cpu", adapters=adapters, dtype="float32", max_lora_rank=16, tensor_parallel_size=2,
        **kw,
    )  # fmt: skip


def test_close_ends_every_rank_cleanly_and_a_second_engine_runs(tiny_llama, llama_adapters):
    mix = ["full8", None, "qv5"]
    llm = _engine(tiny_llama, llama_adapters)
    first = llm.generate(PROMPTS[:3], adapters=mix, sampling=SAMPLING)
    (proc,) = llm.ranks.procs
    llm.close()
    assert proc.returncode == 0, f"rank 1 ended with status {proc.returncode}"
    with pytest.raises(RuntimeError, match="engine is closed"):
        llm.generate(PROMPTS[:1], sampling=SAMPLING)
    # serially: each step is finished before the next launch, which tells the rank to finish it first
    with _engine(tiny_llama, llama_adapters, overlap_schedule=False) as again:
        (proc,) = again.ranks.procs
        second = again.generate(PROMPTS[:3], adapters=mix, sampling=SAMPLING)
    assert proc.returncode == 0
    assert [o.token_ids for o in second] == [o.token_ids for o in first]


def test_a_second_open_engine_is_refused_by_name_and_the_first_goes_on(tiny_llama, llama_adapters):
    with _engine(tiny_llama, llama_adapters) as llm:
        before = llm.generate(PROMPTS[:2], adapters=["full8", None], sampling=SAMPLING)
        with pytest.raises(RuntimeError, match="already belongs to a tensor-parallel group: close"):
            _engine(tiny_llama, llama_adapters)
        after = llm.generate(PROMPTS[:2], adapters=["full8", None], sampling=SAMPLING)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


KILL_MID_RUN = textwrap.dedent("""
    import sys, threading, time
    from proto.sampling import SamplingParams
    from runtime.offline import LLM
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
    (rank1,) = llm.ranks.procs
    steps = lambda: llm.last_planner.stats.steps if llm.last_planner is not None else 0
    def kill_when_running():
        while steps() < 3:
            threading.Event().wait(0.01)
        rank1.kill()
        print("KILLED", time.monotonic(), flush=True)
    threading.Thread(target=kill_when_running, daemon=True).start()
    try:
        llm.generate([[5, 6, 7]] * 4, sampling=SamplingParams(max_tokens=200, ignore_eos=True))
    except Exception as e:
        print("RAISED", time.monotonic(), type(e).__name__, str(e)[:200].replace(chr(10), " "), flush=True)
        llm.close()
        print("RANK1", rank1.returncode, flush=True)
        sys.exit(3)
    print("FINISHED", flush=True)
""")


def test_a_rank_killed_mid_generation_ends_every_process_in_bound(tiny_llama):
    """Rank 0 never waits on rank 1 to hand it a step, so it learns of the death in the step's
    collectives (gloo fails them when the peer's connection drops), fails the generation, and exits."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", KILL_MID_RUN, str(tiny_llama)], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    ended = time.monotonic()
    assert proc.returncode == 3, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    lines = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()}
    killed = float(lines["KILLED"][0])
    assert float(lines["RAISED"][0]) - killed < EXIT_BOUND_S, lines
    assert ended - killed < EXIT_BOUND_S, f"rank 0's process ended {ended - killed:.1f} s after the kill"
    assert lines["RANK1"] == ["-9"], lines
