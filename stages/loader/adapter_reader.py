"""Reads a PEFT LoRA adapter directory, validates every tensor against the base model, and packs it
into the slot layout (`PackedAdapter`) in the model dtype, ready for one copy per layer."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.common.lora_layout import NUM_SLICES, TARGET_MODULES, LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.common.packed import PackedAdapter
from stages.loader.adapter_config import (
    AdapterConfig,
    AdapterError,
    check_delta_magnitude,
    read_adapter_config,
)
from stages.loader.files import FileRefused, open_regular

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_PARENT = {m: ("mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn") for m in TARGET_MODULES}


def read_adapter(
    name: str,
    path: str | Path,
    cfg: ModelConfig,
    layout: LoraLayout,
    dtype: torch.dtype,
    pin_memory: bool = False,
) -> PackedAdapter:
    adapter_dir = Path(path)
    acfg = read_adapter_config(name, adapter_dir)
    tensors = _read_tensors(name, adapter_dir, max_file_bytes(layout))
    pairs = _group_pairs(name, tensors, cfg, acfg)
    for (layer, module), (a, b) in pairs.items():
        scaling = acfg.rank_and_scaling(_path(layer, module))[1]
        check_delta_magnitude(name, f"{module} of layer {layer}", a, b, scaling, dtype)
    return _pack(name, pairs, acfg, layout, dtype, pin_memory)


def max_file_bytes(layout: LoraLayout) -> int:
    """The largest adapter_model.safetensors a servable adapter can need: every module at max rank in
    float64, plus room for the header."""
    return layout.num_layers * layout.max_rank * layout.row_elems * 8 + (1 << 20)


def _read_tensors(name: str, adapter_dir: Path, max_bytes: int) -> dict[str, torch.Tensor]:
    file = adapter_dir / "adapter_model.safetensors"
    if not file.exists():
        if (adapter_dir / "adapter_model.bin").exists():
            raise AdapterError(name, "adapter_model.bin (a pickle) is not supported; save it as safetensors")
        raise AdapterError(name, f"no adapter_model.safetensors in {adapter_dir}")
    try:
        open_regular(file, max_bytes).close()  # never hand a FIFO, a device or a huge file to safe_open
    except FileRefused as e:
        raise AdapterError(name, str(e)) from None
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise AdapterError(name, f"unreadable adapter_model.safetensors ({type(e).__name__}: {e})") from None


def _group_pairs(name, tensors, cfg: ModelConfig, acfg: AdapterConfig) -> dict:
    """{(layer, module): (A [r, in], B [out, r])}, after checking names, pairs and shapes."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(name, _explain_key(key))
        layer, parent, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in TARGET_MODULES or _PARENT[module] != parent:
            raise AdapterError(name, f"target module {parent}.{module} is not supported (tensor {key})")
        if layer >= cfg.num_layers:
            why = f"the base model has {cfg.num_layers} layers (made for another model?)"
            raise AdapterError(name, f"tensor {key} is for layer {layer}, but {why}")
        if not t.is_floating_point():
            raise AdapterError(name, f"tensor {key} has non-float dtype {t.dtype}")
        if t.dim() != 2:
            raise AdapterError(name, f"tensor {key} has shape {tuple(t.shape)}; LoRA weights are 2-D")
        found.setdefault((layer, module), {})[ab] = t
    if not found:
        raise AdapterError(name, "adapter_model.safetensors holds no LoRA tensors")
    for (layer, module), ab in sorted(found.items()):
        for missing in sorted({"A", "B"} - ab.keys()):
            raise AdapterError(name, f"missing tensor {_key(layer, module, missing)}")
    _check_targeted(name, found, cfg, acfg)

    dims = _module_dims(cfg)
    pairs = {}
    for (layer, module), ab in sorted(found.items()):
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        r, _ = acfg.rank_and_scaling(_path(layer, module))
        _check_shape(name, _key(layer, module, "A"), a, dims[module][0], 1, r)
        _check_shape(name, _key(layer, module, "B"), b, dims[module][1], 0, r)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(name, f"{module} of layer {layer} holds NaN or infinite values")
        pairs[(layer, module)] = (a, b)
    return pairs


def _check_targeted(name, found, cfg: ModelConfig, acfg: AdapterConfig) -> None:
    """The tensors must be exactly those of the modules PEFT would wrap, as PEFT's own load assumes."""
    modules = [(i, m) for i in range(cfg.num_layers) for m in TARGET_MODULES]
    expected = {(i, m) for i, m in modules if acfg.targets(_path(i, m))}
    for layer, module in sorted(expected - found.keys()):
        why = "adapter_config.json targets that module"
        raise AdapterError(name, f"missing tensor {_key(layer, module, 'A')} ({why})")
    for layer, module in sorted(found.keys() - expected):
        raise AdapterError(
            name,
            f"extra tensor {_key(layer, module, 'A')}: adapter_config.json does not target that module "
            "(see its target_modules, layers_to_transform and exclude_modules)",
        )


def _check_shape(name: str, key: str, t: torch.Tensor, dim: int, axis: int, r: int) -> None:
    """`t` must be [r, dim] (lora_A, axis 1) or [dim, r] (lora_B, axis 0)."""
    want = (r, dim) if axis == 1 else (dim, r)
    if t.shape[axis] != dim:
        why = f"the base model needs {want} (made for another model?)"
        raise AdapterError(name, f"{key} has shape {tuple(t.shape)}; {why}")
    if t.shape[1 - axis] != r:
        raise AdapterError(name, f"{key} has rank {t.shape[1 - axis]} but adapter_config.json gives r={r}")


def _explain_key(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key:
        return f"embedding targets are not supported (tensor {key})"
    if "lm_head" in key:
        return f"lm_head targets are not supported (tensor {key})"
    if "lora_magnitude_vector" in key:
        return f"DoRA tensors are not supported (tensor {key})"
    if ".bias" in key:
        return f"LoRA bias tensors are not supported (tensor {key})"
    return f"unexpected tensor {key}"


def _path(layer: int, module: str) -> str:
    """The module's dotted path inside the *ForCausalLM, as PEFT matches target and pattern keys."""
    return f"model.layers.{layer}.{_PARENT[module]}.{module}"


def _key(layer: int, module: str, ab: str) -> str:
    return f"base_model.model.{_path(layer, module)}.lora_{ab}.weight"


def _module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _pack(name, pairs, acfg: AdapterConfig, layout: LoraLayout, dtype, pin_memory: bool) -> PackedAdapter:
    rank = max(a.shape[0] for a, _ in pairs.values())
    if rank > layout.max_rank:
        raise AdapterError(name, f"rank {rank} exceeds max_lora_rank {layout.max_rank}")
    block = torch.zeros((layout.num_layers, rank, layout.row_elems), dtype=dtype)  # [L, r, row]
    ranks = torch.zeros((layout.num_layers, NUM_SLICES), dtype=torch.int32)
    scalings = torch.zeros((layout.num_layers, NUM_SLICES), dtype=torch.float32)
    for (layer, module), (a, b) in pairs.items():
        g, s = layout.module_slot(module)
        r = a.shape[0]
        a_cols = g.a_offset + s * g.in_stride
        block[layer, :r, a_cols : a_cols + g.in_dim] = a.to(dtype)
        b_cols = g.b_offset + g.out_offsets[s]
        block[layer, :r, b_cols : b_cols + g.out_dims[s]] = b.t().to(dtype)
        sid = TARGET_MODULES.index(module)
        ranks[layer, sid] = r
        scalings[layer, sid] = acfg.rank_and_scaling(_path(layer, module))[1]
    if pin_memory:
        block = block.pin_memory()
    return PackedAdapter(name=name, block=block, ranks=ranks, scalings=scalings)
