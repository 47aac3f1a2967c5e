"""`lorapipe serve` and the offline engine build their engine from one derivation (runtime/engine_args.py):
from the same arguments they get the same runner config and the same planner config, and their defaults
agree (a knob left out of one derivation would plan with another value without failing)."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.base.endpoints import Endpoints
from runtime.engine_args import EngineArgs, planner_policy
from runtime.offline import LLM
from runtime.serve_args import ServeArgs
from runtime.serve_checks import parse_serve_args, validate
from runtime.stage_configs import stage_configs
from stages.scheduler.config import plan_limit
from stages.scheduler.planner import PlannerConfig
from stages.worker.lora.pool import row_bytes

pytestmark = pytest.mark.timeout(120)

SHARED = dict(
    dtype="float32",
    max_loras_per_batch=3,
    lora_gpu_memory_gb=0.01,
    max_adapter_bypass=5,
    adapter_affinity_steps=9,
    max_lora_rank=16,
    max_running_requests=8,
    max_tokens_per_step=64,
    max_model_len=256,
    page_size=4,
    num_pages=128,
    pinned_adapters=("qv5",),
    overlap_loading=False,
    prefetch_depth=3,
    overlap_min_mb=0.5,
    cuda_graph_max_batch=4,
    cuda_graph_max_tokens=32,
    seed=7,
    overlap_schedule=False,
    warmup=False,
)


def _argv(model, adapters) -> list[str]:
    """The SHARED values as `lorapipe serve` flags (the CLI path, not a hand-built ServeArgs)."""
    argv = ["--model", str(model), "--device", "cpu", "--metrics-port", "-1", "--port", "0", "--no-warmup"]
    for key, value in SHARED.items():
        flag = "--" + {"pinned_adapters": "pin_adapter", "max_adapter_bypass": "max_adapter_bypass"}.get(
            key, key
        ).replace("_", "-")
        if key == "warmup":
            continue
        if key in ("overlap_loading", "overlap_schedule"):
            argv.append(flag if value else flag.replace("--", "--no-", 1))
        elif key == "pinned_adapters":
            for name in value:
                argv += [flag, name]
        else:
            argv += [flag, str(value)]
    for name, path in adapters.items():
        argv += ["--adapter", f"{name}={path}"]
    return argv


def test_serve_and_offline_derive_the_same_engine(tiny_llama, llama_adapters, tmp_path):
    args = parse_serve_args(_argv(tiny_llama, llama_adapters))
    configs = stage_configs(args, validate(args), Endpoints.in_run_dir(tmp_path), "pool-x", 4096)
    llm = LLM(tiny_llama, adapters=dict(llama_adapters), device="cpu", **SHARED)

    assert configs["worker"].runner == llm.runner.cfg
    # the serial path on both sides; the scheduler keeps two plans at a serial worker, not three
    assert configs["worker"].overlap_schedule is llm.engine_args.overlap_schedule is False
    assert configs["scheduler"].max_plans_in_flight == 2
    sched, pool, r = configs["scheduler"], llm.runner.pool, llm.runner
    # what the scheduler derives once the worker reports this runner's KV cache and adapter pool
    served = PlannerConfig.from_policy(
        sched.policy,
        num_pages=r.num_pages,
        page_size=r.cfg.page_size,
        pool_rows=pool.total_rows,
        pool_ids=pool.num_ids,
        pool_row_bytes=row_bytes(pool.layout, pool.dtype),
        max_lora_rank=pool.layout.max_rank,
        max_model_len=min(sched.max_model_len, configs["worker"].max_model_len),
    )
    assert served == llm.planner_cfg
    assert served.overlap_min_bytes == int(0.5 * 2**20) and served.max_loras_per_batch == 3
    assert served.adapter_affinity_steps == 9


def test_defaults_agree(tiny_llama):
    """Everything the two share defaults alike, the warm-up and the device included."""
    offline = LLM(tiny_llama, device="cpu").engine_args
    served = ServeArgs(model=str(tiny_llama), device="cpu")
    shared = {f.name for f in dataclasses.fields(EngineArgs)}
    differ = {name for name in shared if getattr(offline, name) != getattr(served, name)}
    assert differ == set()
    assert planner_policy(offline) == planner_policy(served)


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ([], (3, 2, 32)),  # overlapped: 3 plans, 2 while nothing waits and fewer than 256 / 8 run
        (["--no-overlap-schedule"], (2, None, 0)),
        (["--max-plans-in-flight", "2"], (2, None, 0)),  # an explicit depth is kept at every load
    ],
)
def test_plans_kept_at_the_worker(tiny_llama, tmp_path, flags, want):
    argv = ["--model", str(tiny_llama), "--device", "cpu", "--metrics-port", "-1", "--port", "0"]
    args = parse_serve_args([*argv, "--max-running-requests", "256", *flags])
    sched = stage_configs(args, validate(args), Endpoints.in_run_dir(tmp_path), "pool-x", 4096)["scheduler"]
    assert (sched.max_plans_in_flight, sched.light_plans_in_flight, sched.light_below) == want
    full, light, below = want
    assert plan_limit(sched, waiting=0, running=0) == (light or full)
    assert plan_limit(sched, waiting=0, running=max(below - 1, 0)) == (light or full)
    assert plan_limit(sched, waiting=0, running=below) == full  # a large batch keeps the full depth
    assert plan_limit(sched, waiting=1, running=0) == full  # a request waits: its plan goes at once
