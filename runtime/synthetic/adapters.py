"""Write N seeded random PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) for a model dir.

Shapes come from the model's config.json; no base weights are read.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.synthetic.model import DTYPES, seeded_generator, write_safetensors

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Each module's LoRA delta is sized to about this fraction of the base module's output: large enough that
# logits visibly move, small enough that stacking it over every layer and module cannot blow activations up.
DELTA_RATIO = 0.25


def module_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-targetable linear, from a HF config dict."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q_out = cfg["num_attention_heads"] * hd
    kv_out = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    return {
        "q_proj": (h, q_out),
        "k_proj": (h, kv_out),
        "v_proj": (h, kv_out),
        "o_proj": (q_out, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def lora_scaling(r: int, alpha: float, use_rslora: bool) -> float:
    """The factor PEFT multiplies B @ A by."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def lora_stds(fan_in: int, r: int, scaling: float, base_std: float) -> tuple[float, float]:
    """Stds for A [r, in] and B [out, r].

    A ~ N(0, 1/in) keeps |A x| about |x| per rank coordinate. The base output per element is about
    base_std * sqrt(in) * rms(x) and the delta about scaling * std_B * sqrt(r) * rms(x), so solving for
    delta = DELTA_RATIO * base gives std_B; the result is the same relative effect for any r, alpha or rsLoRA.
    """
    std_a = 1.0 / math.sqrt(fan_in)
    std_b = DELTA_RATIO * base_std * math.sqrt(fan_in) / (scaling * math.sqrt(r))
    return std_a, std_b


def adapter_config(model_dir: str, r: int, alpha: float, targets: Sequence[str], use_rslora: bool) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir,
        "inference_mode": True,
        "r": r,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def make_adapters(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    n: int = 4,
    ranks: Sequence[int] = (8,),
    targets: Sequence[str] = ALL_TARGETS,
    alpha: float | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    prefix: str = "adapter",
) -> list[Path]:
    """Write adapters out_dir/{prefix}{i} for i < n; ranks cycle; alpha defaults to 2 * r per adapter."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = module_shapes(cfg)
    bad = [t for t in targets if t not in shapes]
    if bad or not targets or not ranks or min(ranks) < 1:
        raise ValueError(f"bad targets {list(targets)} or ranks {list(ranks)}")
    base_std = cfg.get("initializer_range", 0.02)
    paths = []
    for i in range(n):
        r = int(ranks[i % len(ranks)])
        a = float(alpha) if alpha is not None else 2.0 * r
        # alpha is written as an int when it is one, as PEFT itself saves it.
        a_json: float | int = int(a) if a.is_integer() else a
        out = Path(out_dir) / f"{prefix}{i}"
        out.mkdir(parents=True, exist_ok=True)
        tensors = _adapter_tensors(cfg, shapes, targets, r, lora_scaling(r, a, use_rslora), base_std, seed, i)
        tensors = {k: v.to(DTYPES[dtype]) for k, v in sorted(tensors.items())}
        specs = [(k, tuple(v.shape)) for k, v in tensors.items()]
        write_safetensors(out / "adapter_model.safetensors", specs, DTYPES[dtype], iter(tensors.values()))
        conf = adapter_config(str(model_dir), r, a_json, targets, use_rslora)
        (out / "adapter_config.json").write_text(json.dumps(conf, indent=2) + "\n")
        paths.append(out)
    return paths


def _adapter_tensors(cfg, shapes, targets, r, scaling, base_std, seed, idx) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in targets:
            fan_in, fan_out = shapes[t]
            std_a, std_b = lora_stds(fan_in, r, scaling, base_std)
            sub = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{sub}.{t}"
            # Seed from (seed, adapter index, key) so each adapter and tensor draws an independent stream.
            ga = seeded_generator(seed, f"adapter{idx}:{key}.lora_A")
            gb = seeded_generator(seed, f"adapter{idx}:{key}.lora_B")
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=ga) * std_a  # [r, in]
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=gb) * std_b  # [out, r]
    return tensors


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--ranks", default="8", help="comma list, cycled over adapters, e.g. 8,16,5")
    ap.add_argument("--targets", default="all", help="comma list of module names, or 'all'")
    ap.add_argument("--alpha", type=float, default=None, help="default: 2 * r per adapter")
    ap.add_argument("--rslora", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--prefix", default="adapter")
    args = ap.parse_args(argv)
    targets = ALL_TARGETS if args.targets == "all" else tuple(s.strip() for s in args.targets.split(","))
    ranks = tuple(int(s) for s in args.ranks.split(","))
    paths = make_adapters(
        args.model_dir,
        args.out_dir,
        n=args.n,
        ranks=ranks,
        targets=targets,
        alpha=args.alpha,
        use_rslora=args.rslora,
        seed=args.seed,
        dtype=args.dtype,
        prefix=args.prefix,
    )
    print(f"{'adapter':<24} {'r':>4} {'alpha':>7}")
    for p in paths:
        conf = json.loads((p / "adapter_config.json").read_text())
        print(f"{p.name:<24} {conf['r']:>4} {conf['lora_alpha']:>7}")


if __name__ == "__main__":
    main()
