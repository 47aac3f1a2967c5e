"""Every engine knob is defined once, in `EngineArgs`, and keeps its name and default all the way down:
the `serve` flags, `LLM(**kwargs)`, the planner's policy and the configs derived for the stages. A layer
that gives a knob another default, or carries it under another name, fails here."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from runtime.common.model_config import ModelConfig
from runtime.engine_args import EngineArgs, planner_policy, runner_config
from runtime.offline import LLM
from runtime.serve_args import _RENAMED, add_serve_arguments, from_namespace
from stages.scheduler.planner_config import PlannerConfig, PlannerPolicy
from stages.worker.runner import RunnerConfig

KNOBS = {f.name: f for f in dataclasses.fields(EngineArgs)}
DEFAULTS = EngineArgs(model="m")

# A distinct value per numeric knob: a lower config holding one of them under another name renamed it.
SENTINELS = dict(
    max_loras_per_batch=3,
    lora_gpu_memory_gb=0.0123,
    max_adapter_bypass=17,
    adapter_affinity_steps=201,
    max_lora_rank=24,
    max_running_requests=40,
    max_tokens_per_step=2000,
    max_model_len=300,
    page_size=8,
    num_pages=77,
    prefetch_depth=9,
    overlap_min_mb=3.5,
    cuda_graph_max_batch=5,
    cuda_graph_max_tokens=33,
    seed=11,
    max_plans_in_flight=4,
)


# Defaults the worker's and the planner's configs still hold for their unit tests, which build them
# without the engine (the engine always sets every one of these from EngineArgs). Exactly these: a new
# disagreement fails, and so does one that was fixed without being taken off this list.
KNOWN_DRIFT = {
    ("RunnerConfig", "device"),
    ("RunnerConfig", "warmup"),
    ("RunnerConfig", "dtype"),  # None: the checkpoint's, as "auto"
    ("PlannerConfig", "max_model_len"),
    ("RunnerConfig", "cuda_graph_max_batch"),
    ("RunnerConfig", "cuda_graph_max_tokens"),
    ("PlannerConfig", "max_loras_per_batch"),  # the policy's None resolved against the pool's ids
}


def _defaults(cls) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def test_llm_takes_the_engine_args_names_without_relisting_them():
    params = inspect.signature(LLM.__init__).parameters
    knobs_listed = set(params) & set(KNOBS) - {"model"}
    assert knobs_listed == set(), f"LLM relists engine knobs by hand: {sorted(knobs_listed)}"
    assert any(p.kind is p.VAR_KEYWORD for p in params.values())
    with pytest.raises(TypeError, match="frobnicate"):  # refused before any model is read
        LLM("no-such-model", frobnicate=1)


def test_serve_flags_take_every_engine_default_under_its_name():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    dests = {_RENAMED.get(a.dest, a.dest) for a in parser._actions}
    assert set(KNOBS) <= dests, f"engine knobs with no `serve` flag of their name: {set(KNOBS) - dests}"
    served = from_namespace(parser.parse_args(["--model", "m"]))
    differ = {
        k: (getattr(served, k), getattr(DEFAULTS, k))
        for k in KNOBS
        if getattr(served, k) != getattr(DEFAULTS, k)
    }
    assert differ == {}, f"`serve` defaults (flag, EngineArgs) that disagree: {differ}"


def test_planner_policy_is_the_engine_knobs_of_its_names():
    fields = set(PlannerPolicy.__struct_fields__)
    assert fields <= set(KNOBS), f"PlannerPolicy fields that are no engine knob: {fields - set(KNOBS)}"
    assert {k: getattr(PlannerPolicy(), k) for k in fields} == {k: getattr(DEFAULTS, k) for k in fields}
    policy = planner_policy(EngineArgs(model="m", **SENTINELS))
    assert {k: getattr(policy, k) for k in fields & set(SENTINELS)} == {
        k: SENTINELS[k] for k in fields & set(SENTINELS)
    }


def _derived(tiny_llama) -> dict[str, object]:
    """The stage configs the engine derives from knobs set to SENTINELS, by class name."""
    args = EngineArgs(model=str(tiny_llama), device="cpu", **SENTINELS)
    policy = planner_policy(args)
    planner = PlannerConfig.from_policy(
        policy, num_pages=77, page_size=8, pool_rows=64, pool_ids=6, pool_row_bytes=1, max_lora_rank=24,
        max_model_len=300,
    )  # fmt: skip
    return {"RunnerConfig": runner_config(args, ModelConfig.from_dir(tiny_llama)), "PlannerConfig": planner}


def test_no_knob_is_renamed_on_the_way_down(tiny_llama):
    by_value = {v: k for k, v in SENTINELS.items()}
    assert len(by_value) == len(SENTINELS), "sentinels must be distinct"
    renamed = {}
    for cls_name, cfg in _derived(tiny_llama).items():
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            knob = (
                by_value.get(value)
                if isinstance(value, int | float) and not isinstance(value, bool)
                else None
            )
            if knob is not None and knob != f.name:
                renamed[f"{cls_name}.{f.name}"] = knob
    assert renamed == {}, f"knobs carried under another name (field: knob): {renamed}"


def test_lower_configs_default_like_the_engine():
    drift = set()
    for cls in (RunnerConfig, PlannerConfig):
        for name, default in _defaults(cls).items():
            if name not in KNOBS:
                continue
            want = getattr(DEFAULTS, name)
            if default != want:
                drift.add((cls.__name__, name))
    assert drift == KNOWN_DRIFT, (
        f"new: {drift - KNOWN_DRIFT}; fixed (take off KNOWN_DRIFT): {KNOWN_DRIFT - drift}"
    )


def test_the_lora_dtype_flag_offers_what_the_pool_takes():
    from stages.worker.lora.pool import LORA_DTYPES

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    (action,) = [a for a in p._actions if a.dest == "lora_dtype"]
    assert tuple(action.choices) == LORA_DTYPES
