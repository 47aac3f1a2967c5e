"""The header-planned, segmented reader packs exactly what a float64 reference built with the safetensors
library's own loader packs (A rows, B^T, zeros elsewhere) for mixed ranks, rank/alpha patterns, rsLoRA,
every source/serving dtype pair and any tensor order in the file; a segment's parts may run in any
order on several threads, stale bytes in a reused block are overwritten, and bad values are refused
wherever they are checked (per part, or per run when a part mixes dtypes)."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.common.lora_layout import TARGET_MODULES, LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.synthetic.adapters import make_adapters
from stages.loader.adapter_config import AdapterError
from stages.loader.adapter_plan import ReadLimits
from stages.loader.adapter_reader import plan_adapter, read_adapter
from stages.loader.block_writer import SegmentBuffer, prepare, write_all, write_part, zero_gaps

MAX_RANK = 16
KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def base(tiny_llama) -> tuple[ModelConfig, LoraLayout]:
    cfg = ModelConfig.from_dir(tiny_llama)
    return cfg, LoraLayout.for_model(cfg, MAX_RANK)


def reference(path: Path, layout: LoraLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block [L, R, row] float64, ranks, scalings) from the file as the safetensors library loads it and
    the config as PEFT documents it: rank and alpha from the first matching pattern key, else r/lora_alpha."""
    tensors = load_file(path / "adapter_model.safetensors")
    conf = json.loads((path / "adapter_config.json").read_text())
    rank = max(t.shape[0] for k, t in tensors.items() if k.endswith("lora_A.weight"))
    block = torch.zeros(layout.num_layers, rank, layout.row_elems, dtype=torch.float64)
    ranks = torch.zeros(layout.num_layers, len(TARGET_MODULES), dtype=torch.int32)
    scalings = torch.zeros(layout.num_layers, len(TARGET_MODULES), dtype=torch.float32)
    for key, t in tensors.items():
        layer, module, ab = KEY.fullmatch(key).groups()
        layer = int(layer)
        g, s = layout.module_slot(module)
        if ab == "A":
            r = t.shape[0]
            LoraLayout.a_view(block, layer, g)[:r, s] = t.double()
            path_ = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            r_conf = _pattern(conf.get("rank_pattern") or {}, path_, conf["r"])
            alpha = _pattern(conf.get("alpha_pattern") or {}, path_, conf["lora_alpha"])
            assert r_conf == r
            ranks[layer, TARGET_MODULES.index(module)] = r
            scale = alpha / (math.sqrt(r) if conf["use_rslora"] else r)
            scalings[layer, TARGET_MODULES.index(module)] = scale
        else:
            off, width = g.out_offsets[s], g.out_dims[s]
            LoraLayout.b_view(block, layer, g)[: t.shape[1], off : off + width] = t.double().t()
    return block, ranks, scalings


def _pattern(pattern: dict, module_path: str, default):
    for key, value in pattern.items():
        if module_path == key or module_path.endswith("." + key):
            return value
    return default


def assert_packs_like_reference(base, path: Path, dtype: torch.dtype, block: torch.Tensor, plan) -> None:
    want, ranks, scalings = reference(path, base[1])
    assert torch.equal(block, want.to(dtype)), "packed block differs from the reference"
    assert torch.equal(plan.ranks, ranks)
    assert torch.allclose(plan.scalings, scalings, rtol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_mixed_adapters_equal_the_reference(base, llama_adapters, dtype):
    for name, path in llama_adapters.items():
        packed = read_adapter(name, path, *base, dtype)
        with plan_adapter(name, path, *base, dtype) as plan:
            assert_packs_like_reference(base, path, dtype, packed.block, plan)


@pytest.mark.parametrize("source", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("serving", ["bfloat16", "float16", "float32"])
def test_every_source_dtype_into_every_serving_dtype(base, tiny_llama, tmp_path, source, serving):
    (path,) = make_adapters(tiny_llama, tmp_path, n=1, ranks=(7,), dtype=source, seed=5, prefix="d")
    packed = read_adapter("d", path, *base, DTYPES[serving])
    with plan_adapter("d", path, *base, DTYPES[serving]) as plan:
        assert_packs_like_reference(base, path, DTYPES[serving], packed.block, plan)


def _pattern_adapter(model: ModelConfig, out: Path, rslora: bool) -> Path:
    """Rank and alpha patterns (a module name, a full path), layers_to_transform, mixed source dtypes."""
    dims = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64)}
    dims |= {"gate_proj": (64, 160), "up_proj": (64, 160), "down_proj": (160, 64)}
    rank_pattern = {"q_proj": 2, "model.layers.1.mlp.down_proj": 11}
    conf = {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": rslora, "target_modules": list(dims),
        "rank_pattern": rank_pattern, "alpha_pattern": {"v_proj": 3, "layers.0.mlp.gate_proj": 20},
    }  # fmt: skip
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for layer in range(model.num_layers):
        for i, (module, (fan_in, fan_out)) in enumerate(dims.items()):
            path = f"model.layers.{layer}.{'mlp' if i >= 4 else 'self_attn'}.{module}"
            r = _pattern(rank_pattern, path, 4)
            dtype = (torch.float32, torch.bfloat16, torch.float16)[(layer + i) % 3]
            tensors[f"base_model.model.{path}.lora_A.weight"] = torch.randn(r, fan_in, generator=g).to(dtype)
            tensors[f"base_model.model.{path}.lora_B.weight"] = torch.randn(fan_out, r, generator=g).to(dtype)
    out.mkdir()
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(conf))
    return out


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_rank_and_alpha_patterns(base, tmp_path, rslora):
    path = _pattern_adapter(base[0], tmp_path / "patterns", rslora)
    packed = read_adapter("p", path, *base, torch.bfloat16)
    assert packed.rank == 11
    with plan_adapter("p", path, *base, torch.bfloat16) as plan:
        assert_packs_like_reference(base, path, torch.bfloat16, packed.block, plan)


@pytest.mark.parametrize("seed", range(3))
def test_parts_in_any_order_on_threads_over_stale_bytes(base, llama_adapters, tmp_path, seed):
    """One part per tensor, shuffled with the gap zeroing on 4 threads, into a block that holds NaN bytes
    from a previous tenant: every byte of the block is the reference's."""
    path = _pattern_adapter(base[0], tmp_path / "patterns", rslora=False) if seed == 0 else None
    path = path or llama_adapters[("qv5", "mlp1")[seed - 1]]
    rng = random.Random(seed)
    limits = ReadLimits(read_bytes=1, tasks=1000, min_part_bytes=1)
    with plan_adapter("c", path, *base, torch.bfloat16, limits) as plan:
        (seg,) = plan.segments
        assert len(seg.parts) == len(load_file(path / "adapter_model.safetensors"))
        block = torch.full(plan.shape, float("nan"), dtype=torch.bfloat16)
        buf = SegmentBuffer()
        prepare(plan, 0, buf)
        calls = [lambda i=i: write_part(plan, 0, i, buf, block) for i in range(len(seg.parts))]
        calls.append(lambda: zero_gaps(plan, block))
        rng.shuffle(calls)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda call: call(), calls))
        assert_packs_like_reference(base, path, torch.bfloat16, block, plan)


@pytest.mark.parametrize("tasks", [1, 3, 8])
def test_parts_share_a_segment_evenly(base, llama_adapters, tasks):
    """A segment is cut into at most `tasks` parts of whole tensors that tile it in file order, none
    smaller than the floor unless it is the last, and each part's runs move exactly its own tensors."""
    path = llama_adapters["full8"]
    limits = ReadLimits(tasks=tasks, min_part_bytes=1)
    with plan_adapter("e", path, *base, torch.bfloat16, limits) as plan:
        (seg,) = plan.segments
        assert 1 <= len(seg.parts) <= tasks
        assert seg.parts[0].start == seg.start and seg.parts[-1].end == seg.end
        assert all(a.end == b.start for a, b in zip(seg.parts, seg.parts[1:], strict=False))
        share = -(-(seg.end - seg.start) // tasks)
        assert all(p.end - p.start >= share for p in seg.parts[:-1])
        for part in seg.parts:
            moved = sorted(p.entry.start for r in part.runs for p in r.pieces)
            inside = sorted(p.entry.start for p in seg.pieces if part.start <= p.entry.start < part.end)
            assert moved == inside
        block = torch.full(plan.shape, float("nan"), dtype=torch.bfloat16)
        write_all(plan, block)
        assert_packs_like_reference(base, path, torch.bfloat16, block, plan)
    with plan_adapter("e", path, *base, torch.bfloat16, ReadLimits(tasks=tasks)) as plan:
        assert len(plan.segments[0].parts) == 1  # a small adapter is one part (the 1 MiB floor)


def test_segments_one_after_the_other_reuse_one_buffer(base, llama_adapters):
    path = llama_adapters["full8"]
    with plan_adapter("s", path, *base, torch.float16, ReadLimits(segment_bytes=1, read_bytes=1)) as plan:
        assert len(plan.segments) == len(load_file(path / "adapter_model.safetensors"))
        block = torch.full(plan.shape, float("inf"), dtype=torch.float16)
        write_all(plan, block, SegmentBuffer())
        assert_packs_like_reference(base, path, torch.float16, block, plan)


def _with_tensor(src: Path, tmp_path: Path, key: str, fill) -> Path:
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "adapter_model.safetensors")
    tensors[key] = fill(tensors[key].clone())
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def _one_row(value: float):
    return lambda t: t.index_fill_(0, torch.tensor([1]), value)


@pytest.mark.parametrize(
    ("key", "value", "dtype", "message"),
    [
        ("layers.1.mlp.down_proj.lora_B", float("nan"), torch.float32, "down_proj of layer 1 holds NaN"),
        ("layers.0.self_attn.k_proj.lora_A", -math.inf, torch.bfloat16, "k_proj of layer 0 holds NaN or inf"),
        ("layers.1.self_attn.o_proj.lora_B", 1e6, torch.float16, "o_proj of layer 1 holds values beyond"),
    ],
    ids=["nan-in-B", "inf-in-A", "fp16-overflow"],
)
def test_bad_values_are_refused_in_any_chunk(base, llama_adapters, tmp_path, key, value, dtype, message):
    full = f"base_model.model.model.{key}.weight"
    path = _with_tensor(llama_adapters["full8"], tmp_path, full, _one_row(value))
    for limits in (ReadLimits(), ReadLimits(segment_bytes=1, read_bytes=1)):
        with pytest.raises(AdapterError, match=message) as e:
            read_adapter("bad", path, *base, dtype, limits=limits)
        assert str(e.value).startswith("adapter 'bad': ")
        if value == 1e6:
            assert "the range of float16" in str(e.value)


def test_bad_values_in_a_mixed_dtype_segment_are_found_by_its_runs(base, tmp_path):
    path = _pattern_adapter(base[0], tmp_path / "patterns", rslora=False)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    tensors = load_file(path / "adapter_model.safetensors")
    tensors[key] = tensors[key].clone().fill_(float("inf"))
    save_file(tensors, path / "adapter_model.safetensors")
    with plan_adapter("mixed", path, *base, torch.bfloat16) as plan:
        assert all(part.dtype is None for seg in plan.segments for part in seg.parts)  # run by run
    with pytest.raises(AdapterError, match="v_proj of layer 1 holds NaN or infinite values"):
        read_adapter("mixed", path, *base, torch.bfloat16)


def test_a_finite_large_value_fits_bf16_but_not_the_delta_bound(base, llama_adapters, tmp_path):
    """1e6 is inside bfloat16's range, so packing passes; the effective-delta bound then refuses it."""
    full = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"
    path = _with_tensor(llama_adapters["full8"], tmp_path, full, _one_row(1e6))
    with pytest.raises(AdapterError, match="o_proj of layer 1: the effective delta"):
        read_adapter("big", path, *base, torch.bfloat16)


def _write_in_order(path: Path, tensors: dict[str, torch.Tensor], order: list[str]) -> None:
    """A safetensors file with its tensors laid out in `order` (the format allows any), written here."""
    header, data, offset = {}, [], 0
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    for key in order:
        t = tensors[key].contiguous()
        raw = t.flatten().view(torch.uint8).numpy().tobytes()  # little-endian, as the format says
        header[key] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        data.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (path / "adapter_model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + b"".join(data))


@pytest.mark.parametrize("order", ["by-name", "module-major", "layers-descending", "shuffled"])
def test_file_layouts_of_a_deeper_model(tiny_llama, tmp_path, order):
    """12 layers: the writer's name order puts layers 0, 1, 10, 11, 2, ... 9 one after the other; other
    writers may order by module or backwards. Every layout packs the same block."""
    deep = tmp_path / "deep"
    deep.mkdir()
    conf = json.loads((tiny_llama / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps({**conf, "num_hidden_layers": 12}))
    cfg = ModelConfig.from_dir(deep)
    layout = LoraLayout.for_model(cfg, MAX_RANK)
    (path,) = make_adapters(deep, tmp_path, n=1, ranks=(3,), seed=9, prefix="deep")
    tensors = load_file(path / "adapter_model.safetensors")
    keys = sorted(tensors)
    if order == "module-major":
        keys.sort(key=lambda k: (KEY.fullmatch(k)[2], KEY.fullmatch(k)[3], int(KEY.fullmatch(k)[1])))
    elif order == "layers-descending":
        keys.sort(key=lambda k: (-int(KEY.fullmatch(k)[1]), k))
    elif order == "shuffled":
        random.Random(0).shuffle(keys)
    _write_in_order(path, tensors, keys)
    for limits in (ReadLimits(), ReadLimits(segment_bytes=3000, read_bytes=1000, tasks=3, min_part_bytes=1)):
        with plan_adapter("deep", path, cfg, layout, torch.bfloat16, limits) as plan:
            block = torch.full(plan.shape, float("nan"), dtype=torch.bfloat16)
            write_all(plan, block)
            assert_packs_like_reference((cfg, layout), path, torch.bfloat16, block, plan)
            runs = [r for seg in plan.segments for part in seg.parts for r in part.runs]
            if order in ("by-name", "module-major") and limits.segment_bytes > 3000:
                assert len(runs) < len(tensors) / 2  # strided runs across layers
