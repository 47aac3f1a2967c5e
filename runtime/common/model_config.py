"""The base model's shape and options, read from a Hugging Face `config.json`; anything the runtime
cannot run exactly is refused here with an error that names it. Dtypes are held by name: reading a
config imports no torch (the launcher builds every stage's config before any of them imports it)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.common.quant_config import CheckpointQuant, QuantConfigError, checkpoint_quant

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the serving dtypes, by torch's name


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's, a DTYPE_BYTES name ("float32" when it names none of them)
    quantization: CheckpointQuant | None = None  # the checkpoint's own (its weights pre-quantized)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(
                f"{model_dir}: no config.json (expected a Hugging Face checkpoint directory)"
            ) from None
        except (OSError, ValueError) as e:
            raise ModelConfigError(f"{path}: unreadable config ({e})") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, c: dict) -> ModelConfig:
        archs = c.get("architectures") or []
        arch = archs[0] if archs else str(c.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"unsupported hidden_act {act!r} (only 'silu')")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        kv_heads = c.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelConfigError(
                f"num_attention_heads {heads} not a multiple of num_key_value_heads {kv_heads}"
            )
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen = arch == "Qwen2ForCausalLM"
        attention_bias = bool(c.get("attention_bias", False))
        window = c.get("sliding_window")
        if is_qwen and not c.get("use_sliding_window", False):
            window = None
        raw_dtype = c.get("dtype") or c.get("torch_dtype") or "float32"
        try:
            quantization = checkpoint_quant(c.get("quantization_config"))
        except QuantConfigError as e:
            raise ModelConfigError(str(e)) from None
        return cls(
            architecture=arch,
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=c["vocab_size"],
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(c),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen or attention_bias,
            o_bias=attention_bias and not is_qwen,
            mlp_bias=bool(c.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=_known_dtype(str(raw_dtype).replace("torch.", "")),
            quantization=quantization,
        )


def _rope_config(c: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`.
    params = dict(c.get("rope_parameters") or {})
    scaling = dict(c.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta, kind="default")
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ModelConfigError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _known_dtype(name: str) -> str:
    return name if name in DTYPE_BYTES else "float32"


def dtype_name(dtype: torch.dtype | str) -> str:
    """A dtype by torch's name ("bfloat16"), as configs and the wire messages carry it."""
    return str(dtype).removeprefix("torch.")


def serving_dtype_name(name: str | torch.dtype | None, default: str | torch.dtype) -> str:
    """The serving dtype's name ("auto"/None: `default`); ValueError naming the choices otherwise."""
    if name is None or name == "auto":
        name = default
    text = name if isinstance(name, str) else dtype_name(name)
    if text in DTYPE_BYTES:
        return text
    if isinstance(name, str):
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPE_BYTES)}")
    raise ValueError(f"unsupported dtype {name}")


def parse_dtype(name: str | torch.dtype | None, default: str | torch.dtype) -> torch.dtype:
    """The serving dtype as a torch dtype (imports torch: the stages' call, not the launcher's)."""
    import torch

    return getattr(torch, serving_dtype_name(name, default))


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse a model whose heads or MLP features do not split evenly over `size` tensor-parallel ranks."""
    for what, n in (
        ("num_attention_heads", cfg.num_heads),
        ("num_key_value_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if n % size:
            raise ModelConfigError(
                f"tensor_parallel_size {size} does not divide the model's {what} ({n}); "
                f"choose a size that divides {what}"
            )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with the checkpoint's scaling applied."""
    import torch

    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exps)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind != "llama3":
        return inv_freq
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
