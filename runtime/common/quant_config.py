"""The base model's weight quantization: the checkpoint's own (config.json's `quantization_config`) and
the one asked for at load (`--quantization`). Only fp8 e4m3 weights with per-tensor or per-channel
scales run; any other scheme is refused here with one line naming it."""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZATIONS = ("fp8",)  # what --quantization may ask for: fp8 e4m3 weights, one scale per output channel
FP8_METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")  # checkpoint layouts read as fp8


class QuantConfigError(ValueError):
    pass


@dataclass(frozen=True)
class CheckpointQuant:
    """A pre-quantized checkpoint whose projections hold e4m3 weights and a `weight_scale` each (a
    scalar, or one per output row). Its static activation scales (`input_scale`, FBGEMM's
    `activation_scale_ub`) are not used: activations are scaled per token to their own maximum."""

    method: str  # one of FP8_METHODS


def _refuse(what: str) -> QuantConfigError:
    return QuantConfigError(
        f"checkpoint quantization {what} is not supported (supported: fp8 e4m3 weights with per-tensor or "
        f"per-channel scales in the {', '.join(FP8_METHODS)} layouts)"
    )


def checkpoint_quant(raw: dict | None) -> CheckpointQuant | None:
    """The scheme of config.json's `quantization_config` (None: an unquantized checkpoint)."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        _check_compressed_tensors(raw)
    elif method == "fp8":
        block = raw.get("weight_block_size")
        if block:
            raise _refuse(f"'fp8' with weight_block_size {block} (block-wise scales)")
        if str(raw.get("fmt", "e4m3")) != "e4m3":
            raise _refuse(f"'fp8' with fmt {raw['fmt']!r}")
        if raw.get("kv_cache_scheme") or raw.get("kv_cache_quant_targets"):
            raise _refuse("'fp8' with a quantized KV cache")
    elif method != "fbgemm_fp8":  # FBGEMM's layout is per-channel e4m3 throughout
        raise _refuse(repr(method))
    return CheckpointQuant(method=method)


def _check_compressed_tensors(raw: dict) -> None:
    top = raw.get("format")
    if top not in ("float-quantized", "naive-quantized", "mixed-precision", None):
        raise _refuse(f"'compressed-tensors' format {top!r}")
    if raw.get("kv_cache_scheme"):
        raise _refuse("'compressed-tensors' with a kv_cache_scheme (a quantized KV cache)")
    groups = raw.get("config_groups") or {}
    if not groups:
        raise _refuse("'compressed-tensors' without config_groups")
    for name, group in groups.items():
        fmt = group.get("format") or top  # a group's own format, where the file gives one
        if fmt not in ("float-quantized", "naive-quantized"):
            raise _refuse(f"'compressed-tensors' {name} format {fmt!r}")
        w = group.get("weights") or {}
        kind = f"{w.get('type')} {w.get('num_bits')}-bit"
        if (w.get("type"), w.get("num_bits")) != ("float", 8):
            raise _refuse(f"'compressed-tensors' {name} with {kind} weights")
        if w.get("strategy") not in ("tensor", "channel"):
            raise _refuse(f"'compressed-tensors' {name} with {w.get('strategy')!r}-strategy fp8 weights")
        if w.get("dynamic") or w.get("symmetric") is False:
            raise _refuse(f"'compressed-tensors' {name} with dynamic or asymmetric weight scales")
        act = group.get("input_activations")
        if act and (act.get("type"), act.get("num_bits")) != ("float", 8):
            raise _refuse(f"'compressed-tensors' {name} with {act.get('type')} {act.get('num_bits')}-bit "
                          f"activations")  # fmt: skip


def check_quantization(name: str | None) -> str | None:
    """`name` as asked for (--quantization), refused unless it is one of QUANTIZATIONS."""
    if name is not None and name not in QUANTIZATIONS:
        raise QuantConfigError(f"unknown quantization {name!r} (choose one of {', '.join(QUANTIZATIONS)})")
    return name


def fp8_device_problem(capability: tuple[int, int], dtype: str) -> str | None:
    """Why fp8 weights cannot run on a CUDA device of `capability` with activations of `dtype` (by
    torch's name), or None. Asked without torch: the launcher refuses with it before any stage starts,
    and the worker's `check_fp8_device` (which also runs one fp8 GEMM) with the same words."""
    if capability < (8, 9):
        major, minor = capability
        return f"fp8 weights need a GPU of compute capability 8.9 or more; this one is {major}.{minor}"
    if dtype != "bfloat16":
        return f"fp8 weights run with bfloat16 activations on CUDA; --dtype gives torch.{dtype}"
    return None
