"""Run by test_warmup_smem.py in a fresh process (the test session runs Triton's interpreter, which
compiles nothing): records the LoRA and attention launches of the warm-up plan of one configuration on
the CPU for an explicit CUDA target, compiles each distinct variant for it and writes, as JSON to argv[1],
one entry per variant with its kernel, constexprs, warps, stages and the shared memory it needs.

argv[2], argv[3]: the target's compute capability and SM count; argv[4]: JSON [{"dtype", "max_rank",
"tp"}]: the tiny llama preset's shapes as one rank of `tp` holds them (`shard_config`), a pool of the
most adapter ids, the engine's step and graph defaults; argv[5] "all": compile every distinct variant
(else those of the largest tiles, `largest_tiles`).
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from kernels import device_info  # noqa: E402
from runtime.common.lora_layout import LoraLayout  # noqa: E402
from runtime.common.model_config import ModelConfig  # noqa: E402
from runtime.engine_args import EngineArgs, graph_batch, graph_tokens  # noqa: E402
from runtime.synthetic.model import build_config  # noqa: E402
from stages.worker.compile_pool import Spec, TargetDriver, _child_init, recording  # noqa: E402
from stages.worker.decode_graphs import batch_buckets  # noqa: E402
from stages.worker.lora.backend import PADDED_BLOCK_M  # noqa: E402
from stages.worker.lora.pool import MAX_IDS, LoraPool  # noqa: E402
from stages.worker.lora.triton_backend import TritonLoraBackend  # noqa: E402
from stages.worker.model.kv_cache import KVCache  # noqa: E402
from stages.worker.model.pointwise import pointwise_ops  # noqa: E402
from stages.worker.step_inputs import token_buckets  # noqa: E402
from stages.worker.tp.shard import shard_config  # noqa: E402
from stages.worker.warmup import _attention, _lora  # noqa: E402
from stages.worker.warmup_plan import attention_variants, lora_launches  # noqa: E402

WORKERS = 2  # compile processes (CI has two cores)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def runner_view(case: dict, cpu: torch.device) -> SimpleNamespace:
    """What the warm-up's launch helpers read of a runner, for the tiny llama shard of `case`: the real
    LoRA backend over a pool of the most adapter ids, and a real KV cache of a few pages."""
    dtype = DTYPES[case["dtype"]]
    full = ModelConfig.from_dict(build_config("llama", "tiny", dtype=case["dtype"]))
    cfg = shard_config(full, case["tp"]) if case["tp"] > 1 else full
    engine = EngineArgs(model="tiny", max_lora_rank=case["max_rank"])
    layout = LoraLayout.for_model(cfg, engine.max_lora_rank)
    pool = LoraPool(layout, layout.max_rank, MAX_IDS, dtype, cpu)
    lora = TritonLoraBackend(pool, engine.max_tokens_per_step, engine.max_running_requests)
    kv = KVCache(
        num_layers=cfg.num_layers, num_pages=4, page_size=16, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=dtype, device=cpu,
    )  # fmt: skip
    model = SimpleNamespace(ops=pointwise_ops("triton"), scale=cfg.head_dim**-0.5)
    steps = tuple((b, PADDED_BLOCK_M) for b in token_buckets(graph_tokens(engine)))
    graphs = (*batch_buckets(graph_batch(engine)), *steps)  # the padded batches of both kinds of graph
    return SimpleNamespace(
        lora=lora, lora_layout=layout, dtype=dtype, device=cpu, model=model, model_cfg=cfg, kv=kv,
        graphs=graphs, engine=engine, max_context=cfg.max_position_embeddings,
    )  # fmt: skip


def record(case: dict) -> list:
    """The specializations the warm-up plan's LoRA and attention launches ask for, for `case`."""
    cpu = torch.device("cpu")
    r = runner_view(case, cpu)
    launches = lora_launches(r.lora, r.graphs)
    m = r.model_cfg
    attn = attention_variants(
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, max_tokens=r.engine.max_tokens_per_step,
        max_seqs=r.engine.max_running_requests, max_model_len=r.max_context, device=cpu,
    )  # fmt: skip
    with recording() as specs, torch.inference_mode():
        _lora(r, launches, None)
        _attention(r, attn, None)
    return specs


def distinct(recorded: list) -> list[dict]:
    """One entry per distinct variant (kernel, constexprs by name, signature, warps, stages) of the
    recorded specializations: another layer's or case's alignment of the same arguments has the same
    tiles and buffers."""
    out, seen = [], set()
    for case, spec in recorded:
        fn = getattr(importlib.import_module(spec.module), spec.name)
        data = json.loads(spec.data)
        names = [fn.arg_names[k[0]] for k in data["constant_keys"]]
        constants = dict(zip(names, data["constant_vals"], strict=True))
        opts = data["options"]
        key = json.dumps([spec.name, constants, data["signature"], opts["num_warps"], opts["num_stages"]])
        if key not in seen:
            seen.add(key)
            out.append(
                dict(spec=spec, case=case, name=spec.name, constants=constants, signature=data["signature"],
                     num_warps=opts["num_warps"], num_stages=opts["num_stages"])
            )  # fmt: skip
    return out


def largest_tiles(variants: list[dict]) -> list[dict]:
    """Of the variants that share a kernel, signature, warps, stages and every constexpr but the tile
    sizes (BLOCK_*) and PDL, one of each tile shape that no other one's covers in every dimension: a
    kernel's shared memory (pipelined tiles, layout conversions) grows with each tile dimension along
    one code path, and PDL only adds the dependent launch's wait and signal, which take none."""

    def tiles(v: dict) -> dict:
        return {k: x for k, x in v["constants"].items() if k.startswith("BLOCK_")}

    groups: dict[str, list[dict]] = {}
    for v in variants:
        rest = {k: x for k, x in v["constants"].items() if not k.startswith("BLOCK_") and k != "PDL"}
        key = json.dumps([v["name"], rest, v["signature"], v["num_warps"], v["num_stages"]], sort_keys=True)
        groups.setdefault(key, []).append(v)
    out = []
    for group in groups.values():
        kept: dict[str, dict] = {}
        for v in group:
            t = tiles(v)
            if not any(tiles(u) != t and all(tiles(u)[k] >= t[k] for k in t) for u in group):
                kept.setdefault(json.dumps(t, sort_keys=True), v)
        out.extend(kept.values())
    return out


def shared_bytes(spec: Spec) -> int:
    """Compile one recorded specialization for the active target: the shared memory a program needs."""
    return getattr(importlib.import_module(spec.module), spec.name).preload(spec.data).metadata.shared


def main(out_path: str, arch: int, sms: int, cases: list[dict], every: bool = False) -> None:
    """Record `cases` for the target, compile the variants of the largest tiles (`every`: all of them)
    and write what each needs."""
    driver.set_active(TargetDriver(GPUTarget("cuda", arch, 32)))
    # the heuristics ask the device of their tensors (the CPU here): answer as the target GPU would
    device_info.num_sms = lambda _device: sms
    device_info.pdl = lambda _device: arch >= 90
    # every case recorded before anything compiles: a preloaded kernel would be launched, not recorded
    recorded = [(case, spec) for case in cases for spec in record(case)]
    variants = distinct(recorded)
    chosen = variants if every else largest_tiles(variants)
    target = (driver.active.target.backend, arch, 32)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(WORKERS, spawn, _child_init, (target, ())) as pool:
        needs = list(pool.map(shared_bytes, [v.pop("spec") for v in chosen]))
    out = [dict(v, shared=n) for v, n in zip(chosen, needs, strict=True)]
    with open(out_path, "w") as f:
        json.dump({"specs": len(recorded), "distinct": len(variants), "variants": out}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5:] == ["all"])
