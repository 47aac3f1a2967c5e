"""Loads a Hugging Face checkpoint's safetensors (single file or sharded with an index) into the fused
per-layer tensors the forward uses (q/k/v and gate/up stacked), checking nothing is missing or extra.
A projection stored in fp8 (e4m3 `weight` + `weight_scale`, a scalar or one per output row) stays fp8
(`linear.Fp8Weight`); with `quantize` every projection is made fp8, one scale per output row."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.common.model_config import ModelConfig, ModelConfigError
from stages.worker.model.linear import FP8, Fp8Weight, Weight, cat_weights


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Weight  # [q_size + 2 * kv_size, H]; each projection a tensor or an Fp8Weight
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o: Weight  # [H, q_size]
    o_bias: torch.Tensor | None  # [H]
    post_norm: torch.Tensor  # [H]
    gate_up: Weight  # [2 * I, H]
    gate_up_bias: torch.Tensor | None  # [2 * I]
    down: Weight  # [H, I]
    down_bias: torch.Tensor | None  # [H]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    if any(model_dir.glob("*.bin")):
        raise ModelConfigError(f"{model_dir}: only .bin (pickle) weights found; convert them to safetensors")
    raise ModelConfigError(f"{model_dir}: no *.safetensors weights found")


def load_weights(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, quantize: bool = False
) -> ModelWeights:
    model_dir = Path(model_dir)
    handles = {}
    where: dict[str, Path] = {}
    for f in _checkpoint_files(model_dir):
        h = safe_open(str(f), framework="pt", device="cpu")
        handles[f] = h
        for k in h.keys():
            where[k] = f
    used: set[str] = set()

    def raw(name: str) -> torch.Tensor:
        if name not in where:
            raise ModelConfigError(f"{model_dir}: checkpoint is missing tensor {name!r}")
        used.add(name)
        return handles[where[name]].get_tensor(name)

    def get(name: str) -> torch.Tensor:
        t = raw(name)
        if t.dtype.itemsize == 1 and t.is_floating_point():
            raise ModelConfigError(f"{model_dir}: {name} is {t.dtype}; only linear projections may be fp8")
        return t.to(device=device, dtype=dtype)

    def projection(module: str) -> Weight:
        """`module`.weight as stored: fp8 codes with their scales, or a tensor in `dtype`."""
        t = raw(module + ".weight")
        if t.is_floating_point() and t.dtype.itemsize > 1:
            return t.to(device=device, dtype=dtype)
        if t.dtype != FP8:
            raise ModelConfigError(
                f"{model_dir}: {module}.weight is {t.dtype}; quantized weights must be float8_e4m3fn"
            )
        for unused in (".input_scale", ".input_scale_ub"):  # static activation scales: per token instead
            used.add(module + unused)
        for zero in (".weight_zero_point", ".input_zero_point"):  # symmetric schemes may store zeros
            if module + zero in where and raw(module + zero).any():
                raise ModelConfigError(f"{model_dir}: {module}{zero} is not zero; only symmetric fp8 runs")
        scale = fp8_scale(raw(module + ".weight_scale"), t.shape[0], module)
        return Fp8Weight(t.to(device).contiguous(), scale.to(device))

    def fp8_scale(s: torch.Tensor, rows: int, module: str) -> torch.Tensor:
        s = s.to(torch.float32).reshape(-1)
        if s.numel() not in (1, rows):
            raise ModelConfigError(
                f"{model_dir}: {module}.weight_scale has {s.numel()} values for {rows} output rows; "
                f"only per-tensor or per-channel fp8 scales are supported"
            )
        return s.expand(rows).contiguous()  # [N]: a per-tensor scale repeated per row

    def maybe(name: str, present: bool) -> torch.Tensor | None:
        return get(name) if present else None

    def cat(names: list[str]) -> torch.Tensor:
        return torch.cat([get(n) for n in names], dim=0)

    def fused(modules: list[str]) -> Weight:
        return cat_weights([projection(m) for m in modules], quantize)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        att = [p + f"self_attn.{m}_proj" for m in "qkv"]
        mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=fused(att),
                qkv_bias=cat([n + ".bias" for n in att]) if cfg.qkv_bias else None,
                o=fused([p + "self_attn.o_proj"]),
                o_bias=maybe(p + "self_attn.o_proj.bias", cfg.o_bias),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=fused(mlp),
                gate_up_bias=cat([n + ".bias" for n in mlp]) if cfg.mlp_bias else None,
                down=fused([p + "mlp.down_proj"]),
                down_bias=maybe(p + "mlp.down_proj.bias", cfg.mlp_bias),
            )
        )
    embed = get("model.embed_tokens.weight")
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in where
    weights = ModelWeights(
        embed=embed,
        layers=layers,
        norm=get("model.norm.weight"),
        lm_head=embed if tied else get("lm_head.weight"),
    )
    extra = sorted(k for k in where if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ModelConfigError(f"{model_dir}: unexpected tensors in checkpoint: {', '.join(extra[:5])}")
    _check_shapes(weights, cfg, model_dir)
    return weights


def _check_shapes(w: ModelWeights, cfg: ModelConfig, model_dir: Path) -> None:
    h, i = cfg.hidden_size, cfg.intermediate_size
    expect = {
        "embed": (w.embed, (cfg.vocab_size, h)),
        "lm_head": (w.lm_head, (cfg.vocab_size, h)),
        "layer0.qkv": (w.layers[0].qkv, (cfg.q_size + 2 * cfg.kv_size, h)),
        "layer0.o": (w.layers[0].o, (h, cfg.q_size)),
        "layer0.gate_up": (w.layers[0].gate_up, (2 * i, h)),
        "layer0.down": (w.layers[0].down, (h, i)),
    }
    for name, (t, shape) in expect.items():
        if tuple(t.shape) != shape:
            raise ModelConfigError(f"{model_dir}: {name} has shape {tuple(t.shape)}, config implies {shape}")
