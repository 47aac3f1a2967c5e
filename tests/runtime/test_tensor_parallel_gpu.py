"""Tensor parallelism on two GPUs: the Triton LoRA kernels, CUDA graphs with the ranks' collectives
captured in them, every logit against transformers + PEFT and the one-GPU engine; the peer-memory
all-reduce's sums against a float64 reference, the same bits on both ranks, eager and graphed, on each
path; a close that ends every rank with status 0 and lets a second engine start (stepping serially,
where the first overlapped its steps); a rank killed mid-generation that ends the engine instead of
hanging it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from proto.sampling import SamplingParams
from runtime.base.endpoints import free_port
from runtime.offline import LLM
from stages.worker.tp.allreduce import ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES
from stages.worker.tp.group import TPGroup, TPSpec
from tests.runtime import test_tensor_parallel as tp
from tests.runtime.test_offline_vs_peft import PROMPTS
from tests.stages.worker.graph_tolerances import TOL as GRAPH_TOL

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 4096
ROW_BYTES = HIDDEN * 2  # one bf16 row
# rows per message: one-shot (its largest included), two-shot (both ends), NCCL
ROWS = (1, 16, ONE_SHOT_MAX_BYTES // ROW_BYTES, ONE_SHOT_MAX_BYTES // ROW_BYTES + 1,
        TWO_SHOT_MAX_BYTES // ROW_BYTES, TWO_SHOT_MAX_BYTES // ROW_BYTES + 1)  # fmt: skip


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_two_gpus_match_peft_and_one_gpu(model, request, recorded_logits):
    model_dir = request.getfixturevalue(f"tiny_{model}")
    adapters = request.getfixturevalue(f"{model}_adapters")
    kw = dict(device="cuda", lora_backend="triton", num_pages=512, lora_gpu_memory_gb=0.05)
    tp._check(model_dir, adapters, recorded_logits, tol=GRAPH_TOL, **kw)
    assert tp._generate.last_replays > 0, "no decode step replayed a CUDA graph on two GPUs"


def _part(rank: int, rows: int, round_: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rows + 10 * round_ + rank)
    return torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)


def _sum_on_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    device = torch.device(f"cuda:{rank}")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True) if rank == 0 else None
    group = TPGroup(TPSpec(rank=rank, size=2, host="127.0.0.1", port=port, timeout_s=60), device, store)
    got = {"peer": group.peer is not None}
    for rows in ROWS:
        got[("eager", rows)] = group.all_reduce(_part(rank, rows, 0).to(device)).cpu()
        static = _part(rank, rows, 1).to(device)
        group.all_reduce(static.clone())  # the path's first use happens outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            summed = group.all_reduce(static)
        static.copy_(_part(rank, rows, 2).to(device))
        graph.replay()
        got[("graph", rows)] = summed.cpu()
    torch.save(got, Path(out) / f"rank{rank}.pt")
    del graph, summed, static
    group.close(graceful=True)


def test_every_all_reduce_path_sums_like_float64_and_alike_on_both_ranks(tmp_path):
    mp.spawn(_sum_on_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["peer"] and r1["peer"], "two GPUs with peer access did not set up the peer all-reduce"
    for mode, round_ in (("eager", 0), ("graph", 2)):
        for rows in ROWS:
            a, b = r0[(mode, rows)], r1[(mode, rows)]
            assert torch.equal(a, b), f"{mode} {rows} rows: the ranks' sums differ"
            want = (_part(0, rows, round_).double() + _part(1, rows, round_).double()).to(torch.bfloat16)
            torch.testing.assert_close(a, want, rtol=2**-8, atol=0, msg=f"{mode} {rows} rows")


def test_close_ends_both_gpus_ranks_cleanly_and_a_second_engine_runs(tiny_llama, llama_adapters):
    kw = dict(device="cuda", adapters=llama_adapters, dtype="float32", max_lora_rank=16,
              tensor_parallel_size=2, num_pages=256, lora_gpu_memory_gb=0.05)  # fmt: skip
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    mix = ["full8", None, "qv5"]
    llm = LLM(tiny_llama, **kw)
    first = llm.generate(PROMPTS[:3], adapters=mix, sampling=sampling)
    (proc,) = llm.ranks.procs
    llm.close()
    assert proc.returncode == 0, f"rank 1 ended with status {proc.returncode}"
    # serially: each step is finished before the next launch, which tells rank 1 to finish it first
    with LLM(tiny_llama, **kw, overlap_schedule=False) as again:
        (proc,) = again.ranks.procs
        second = again.generate(PROMPTS[:3], adapters=mix, sampling=sampling)
    assert proc.returncode == 0
    assert [o.token_ids for o in second] == [o.token_ids for o in first]


KILL_MID_RUN = textwrap.dedent("""
    import sys, threading, time
    from proto.sampling import SamplingParams
    from runtime.offline import LLM
    llm = LLM(sys.argv[1], device="cuda", tensor_parallel_size=2, num_pages=512)
    (rank1,) = llm.ranks.procs
    planner_steps = lambda: llm.last_planner.stats.steps if llm.last_planner is not None else 0
    def kill_when_running():
        while planner_steps() < 20:
            threading.Event().wait(0.01)
        rank1.kill()
        print("KILLED", time.monotonic(), flush=True)
    threading.Thread(target=kill_when_running, daemon=True).start()
    try:
        llm.generate([[5, 6, 7]] * 8, sampling=SamplingParams(max_tokens=500, ignore_eos=True))
    except Exception as e:
        print("RAISED", time.monotonic(), type(e).__name__, e, flush=True)
        sys.exit(3)
    print("FINISHED", flush=True)
""")


def test_a_rank_killed_mid_generation_ends_the_engine_in_bounded_time(tiny_llama):
    """Either the step fails (the group is aborted) or, if it cannot return, the process exits; it never
    waits out the group's 300 s timeout."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", KILL_MID_RUN, str(tiny_llama)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert "FINISHED" not in proc.stdout, "generation outlived its killed rank"
    assert proc.returncode in (3, 70), (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    if proc.returncode == 3:  # the step failed: within the watchdog's bound of the kill
        times = {w.split()[0]: float(w.split()[1]) for w in proc.stdout.splitlines() if w[:1] in "KR"}
        assert times["RAISED"] - times["KILLED"] < 10, (times, proc.stderr[-4000:])
