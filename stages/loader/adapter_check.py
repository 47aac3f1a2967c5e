"""Checks a PEFT LoRA adapter directory against the base model from adapter_config.json and the
safetensors header alone, and places its tensors in the slot layout. Imports no torch: `lorapipe serve`
checks every --adapter with this code before it spawns the stages (runtime/serve_checks.py)."""

from __future__ import annotations

import os
import re
from operator import attrgetter
from pathlib import Path

from runtime.common.lora_layout import TARGET_MODULES, LoraLayout
from runtime.common.model_config import ModelConfig
from stages.loader.adapter_config import AdapterConfig, AdapterError, read_adapter_config
from stages.loader.adapter_modules import PARENT as _PARENT
from stages.loader.adapter_modules import Expected, expected
from stages.loader.adapter_modules import module_dims as _module_dims
from stages.loader.adapter_modules import module_path as _path
from stages.loader.adapter_modules import tensor_key as _key
from stages.loader.adapter_plan import ReadLimits, deadline_after
from stages.loader.placement import Placed, place_expected, place_pairs
from stages.loader.safetensors_format import FLOAT_TYPES
from stages.loader.safetensors_reader import FormatError, TensorEntry, open_regular, read_header

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
TENSORS_FILE = "adapter_model.safetensors"


def max_file_bytes(layout: LoraLayout) -> int:
    """The largest adapter_model.safetensors a servable adapter can need: every module at max rank in
    float64, plus room for the header."""
    return layout.num_layers * layout.max_rank * layout.row_elems * 8 + (1 << 20)


def open_placed(
    name: str, path: str | Path, cfg: ModelConfig, layout: LoraLayout, limits: ReadLimits
) -> tuple[int, int, Placed, float]:
    """(fd, size, placement, deadline): every check a load makes before a byte of tensor data is read,
    and where each tensor goes; the tensor file left open (the caller closes `fd`)."""
    adapter_dir = Path(path)
    acfg = read_adapter_config(name, adapter_dir)
    deadline = deadline_after(limits)
    fd, size, entries = _open_tensors(name, adapter_dir, limits, deadline)
    try:
        exp = expected(cfg, acfg)
        found = _fast_pairs(entries, exp)
        if found is not None:
            placed = place_expected(*found, exp, layout)
        else:  # the reference checks, which word any refusal
            placed = place_pairs(_group_pairs(name, entries, cfg, acfg), exp, layout)
        if placed.rank > layout.max_rank:
            raise AdapterError(name, f"rank {placed.rank} exceeds max_lora_rank {layout.max_rank}")
        return fd, size, placed, deadline
    except BaseException:
        os.close(fd)
        raise


def check_adapter(name: str, path: str | Path, cfg: ModelConfig, layout: LoraLayout) -> int:
    """The adapter's rank, after the checks of `open_placed` (an AdapterError names the first failing)."""
    fd, _, placed, _ = open_placed(name, path, cfg, layout, ReadLimits(max_file_bytes=max_file_bytes(layout)))
    os.close(fd)
    return placed.rank


def _open_tensors(name: str, adapter_dir: Path, limits: ReadLimits, deadline: float):
    """(fd, size, header entries) of adapter_model.safetensors; every refusal is an AdapterError."""
    file = adapter_dir / TENSORS_FILE
    if not file.exists() and (adapter_dir / "adapter_model.bin").exists():
        raise AdapterError(name, "adapter_model.bin (a pickle) is not supported; save it as safetensors")
    if not file.exists():
        raise AdapterError(name, f"no {TENSORS_FILE} in {adapter_dir}")
    try:
        fd, size = open_regular(file, limits.max_file_bytes)
    except FormatError as e:
        raise AdapterError(name, str(e)) from None
    try:
        return fd, size, read_header(fd, size, deadline)
    except FormatError as e:
        os.close(fd)
        raise AdapterError(name, f"unreadable {TENSORS_FILE} ({e})") from None


_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("shape")


def _fast_pairs(entries: dict[str, TensorEntry], exp: Expected) -> tuple[list, list] | None:
    """For a file holding exactly the expected tensors, float and of the expected shapes (found by
    whole-set comparisons): the A and B entries in `exp.modules` order, which is `_group_pairs`'s answer
    (`test_pairs_fast`). None for any other file: `_group_pairs` decides."""
    if not exp.keys or entries.keys() != exp.keys:  # no tensors at all: `_group_pairs` words it
        return None
    a = list(map(entries.__getitem__, exp.a_keys))
    b = list(map(entries.__getitem__, exp.b_keys))
    if not {*map(_DTYPE, a), *map(_DTYPE, b)} <= FLOAT_TYPES:
        return None
    if tuple(map(_SHAPE, a)) != exp.a_shapes or tuple(map(_SHAPE, b)) != exp.b_shapes:
        return None
    return a, b


def _group_pairs(name, entries: dict[str, TensorEntry], cfg: ModelConfig, acfg: AdapterConfig) -> dict:
    """{(layer, module): (A [r, in], B [out, r])} header entries, after checking names, pairs and shapes,
    in (layer, module) order. The reference path: every check in turn, the first failing one worded."""
    found: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for key, t in entries.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(name, _explain_key(key))
        layer, parent, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in TARGET_MODULES or _PARENT[module] != parent:
            raise AdapterError(name, f"target module {parent}.{module} is not supported (tensor {key})")
        if layer >= cfg.num_layers:
            why = f"the base model has {cfg.num_layers} layers (made for another model?)"
            raise AdapterError(name, f"tensor {key} is for layer {layer}, but {why}")
        if t.dtype not in FLOAT_TYPES:
            kinds = "F32, F16, BF16 or F64"
            raise AdapterError(name, f"tensor {key} has dtype {t.dtype}; LoRA weights must be {kinds}")
        if len(t.shape) != 2:
            raise AdapterError(name, f"tensor {key} has shape {t.shape}; LoRA weights are 2-D")
        found.setdefault((layer, module), {})[ab] = t
    if not found:
        raise AdapterError(name, f"{TENSORS_FILE} holds no LoRA tensors")
    for (layer, module), ab in sorted(found.items()):
        for missing in sorted({"A", "B"} - ab.keys()):
            raise AdapterError(name, f"missing tensor {_key(layer, module, missing)}")
    _check_targeted(name, found, cfg, acfg)

    dims = _module_dims(cfg)
    pairs = {}
    for (layer, module), ab in sorted(found.items()):
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        r, _ = acfg.rank_and_scaling(_path(layer, module))
        _check_shape(name, _key(layer, module, "A"), a.shape, dims[module][0], 1, r)
        _check_shape(name, _key(layer, module, "B"), b.shape, dims[module][1], 0, r)
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


def _check_shape(name: str, key: str, shape: tuple[int, ...], dim: int, axis: int, r: int) -> None:
    """`shape` must be [r, dim] (lora_A, axis 1) or [dim, r] (lora_B, axis 0)."""
    want = (r, dim) if axis == 1 else (dim, r)
    if shape[axis] != dim:
        why = f"the base model needs {want} (made for another model?)"
        raise AdapterError(name, f"{key} has shape {shape}; {why}")
    if shape[1 - axis] != r:
        raise AdapterError(name, f"{key} has rank {shape[1 - axis]} but adapter_config.json gives r={r}")


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
