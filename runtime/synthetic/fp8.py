"""Write an fp8 copy of a checkpoint in one of the Hugging Face fp8 layouts the worker reads, and a
dequantized copy of an fp8 checkpoint (the same weights in bf16, for transformers and PEFT):

    python -m runtime.synthetic.fp8 SRC DST --layout compressed-tensors --strategy channel [--dequantized DIR]

Layouts: `compressed-tensors` (llm-compressor's float-quantized: `weight_scale` [N, 1] per channel or
[1] per tensor, in the source dtype; dynamic per-token activations), `fbgemm_fp8` (per channel [N, 1]
float32, with `input_scale_ub`) and `fp8` (vLLM/AutoFP8: a scalar `weight_scale` and a static
`input_scale`). Only the decoder layers' linear projections are quantized; the LM head stays as is."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_quant import FP8, FP8_MAX

LAYOUTS = ("compressed-tensors", "fbgemm_fp8", "fp8")
PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def quant_config(layout: str, strategy: str) -> dict:
    """config.json's `quantization_config` for `layout`."""
    if layout == "compressed-tensors":
        weights = dict(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
        acts = dict(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
        group = dict(targets=["Linear"], weights=weights, input_activations=acts)
        return dict(
            quant_method="compressed-tensors",
            format="float-quantized",
            quantization_status="compressed",
            config_groups={"group_0": group},
            ignore=["lm_head"],
        )
    if layout == "fbgemm_fp8":
        return dict(quant_method="fbgemm_fp8", activation_scale_ub=1200.0, modules_to_not_convert=["lm_head"])
    if layout == "fp8":
        return dict(quant_method="fp8", activation_scheme="static", ignored_layers=["lm_head"])
    raise ValueError(f"unknown layout {layout!r} (choose one of {', '.join(LAYOUTS)})")


def quantize(
    w: torch.Tensor, per_channel: bool, scale_dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [N, K], scale [N, 1] or [1] in `scale_dtype`) with w ≈ codes * scale."""
    wf = w.double()
    amax = wf.abs().amax(dim=1, keepdim=True) if per_channel else wf.abs().amax().reshape(1)
    scale = (amax.clamp(min=1e-12) / FP8_MAX).to(scale_dtype)
    codes = (wf / scale.double()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def _quantized(name: str, w: torch.Tensor, layout: str, strategy: str) -> dict[str, torch.Tensor]:
    module = name.removesuffix(".weight")
    if layout == "fp8":
        codes, scale = quantize(w, per_channel=False)
        scales = {".weight_scale": scale.reshape(()), ".input_scale": torch.tensor(1.0)}
    elif layout == "fbgemm_fp8":
        codes, scale = quantize(w, per_channel=True)
        scales = {".weight_scale": scale, ".input_scale_ub": torch.tensor([1200.0])}
    else:  # compressed-tensors keeps its scales in the weights' own dtype
        codes, scale = quantize(w, per_channel=strategy == "channel", scale_dtype=w.dtype)
        scales = {".weight_scale": scale}
    return {name: codes, **{module + suffix: t for suffix, t in scales.items()}}


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _copy_dir(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)


def write_fp8(src: str | Path, dst: str | Path, layout: str, strategy: str = "channel") -> Path:
    """An fp8 copy of the checkpoint `src` in `dst` (strategy: "channel" or "tensor"; compressed-tensors)."""
    src, dst = Path(src), Path(dst)
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"unknown strategy {strategy!r}")
    cfg = quant_config(layout, strategy)
    _copy_dir(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in _tensors(src).items():
        out.update(_quantized(name, t, layout, strategy) if PROJECTION.match(name) else {name: t})
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": cfg}, indent=2) + "\n")
    return dst


def write_dequantized(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The fp8 checkpoint `src` with every projection dequantized (codes * scale, rounded once to
    `dtype`) and no quantization_config: what its fp8 weights stand for, readable by transformers."""
    src, dst = Path(src), Path(dst)
    _copy_dir(src, dst)
    tensors = _tensors(src)
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".input_scale", ".input_scale_ub")):
            continue
        if t.dtype == FP8:
            scale = tensors[name.removesuffix(".weight") + ".weight_scale"].double()
            t = t.double() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
        out[name] = t.to(dtype)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--layout", choices=LAYOUTS, default="compressed-tensors")
    p.add_argument("--strategy", choices=("channel", "tensor"), default="channel")
    p.add_argument("--dequantized", help="also write the dequantized bf16 copy here")
    a = p.parse_args(argv)
    write_fp8(a.src, a.dst, a.layout, a.strategy)
    if a.dequantized:
        write_dequantized(a.dst, a.dequantized)


if __name__ == "__main__":
    main()
