"""What a base model and an adapter_config.json expect of the tensor file, worked out once per distinct
pair and then only looked up (adapters share a handful of configs, and the answer takes hundreds of
pattern matches): the modules the config targets, in (layer, module) order, with their tensors' keys
and shapes, ranks and scalings. Also PEFT's spelling of module paths and tensor keys."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache

from runtime.common.lora_layout import TARGET_MODULES
from runtime.common.model_config import ModelConfig
from stages.loader.adapter_config import AdapterConfig

PARENT = {m: ("mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn") for m in TARGET_MODULES}


def module_path(layer: int, module: str) -> str:
    """The module's dotted path inside the *ForCausalLM, as PEFT matches target and pattern keys."""
    return f"model.layers.{layer}.{PARENT[module]}.{module}"


def tensor_key(layer: int, module: str, ab: str) -> str:
    return f"base_model.model.{module_path(layer, module)}.lora_{ab}.weight"


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{module: (in_dim, out_dim)} of the base model's linear layers."""
    return _dims(cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size)


def _dims(h: int, i: int, q: int, kv: int) -> dict[str, tuple[int, int]]:
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass(frozen=True, eq=False)  # one object per distinct input (cached): compared and hashed by identity
class Expected:
    """The targeted modules, sorted by (layer, module), and what a valid file holds for each: lora_A
    [r, in] under `a_keys[i]` and lora_B [out, r] under `b_keys[i]`, exactly these keys (`keys`)."""

    modules: tuple[tuple[int, str], ...]
    keys: frozenset[str]
    a_keys: tuple[str, ...]
    b_keys: tuple[str, ...]
    a_shapes: tuple[tuple[int, int], ...]
    b_shapes: tuple[tuple[int, int], ...]
    rank_scaling: dict[tuple[int, str], tuple[int, float]]  # per targeted module; read-only


def expected(cfg: ModelConfig, acfg: AdapterConfig) -> Expected:
    """`Expected` for this model shape and config: computed on the first call for an equal pair."""
    model = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size)
    return _expected(model, tuple(_freeze(getattr(acfg, f.name)) for f in fields(acfg)))


class _Items(tuple):
    """A dict field of AdapterConfig as its (ordered) items, so the config can key a cache."""


def _freeze(value: object) -> object:
    return _Items(value.items()) if isinstance(value, dict) else value


@lru_cache(maxsize=256)
def _expected(model: tuple[int, ...], config: tuple) -> Expected:
    num_layers, *dims = model
    # rebuilt from the key alone, so that the answer cannot depend on anything the key leaves out
    acfg = AdapterConfig(*(dict(v) if type(v) is _Items else v for v in config))
    in_out = _dims(*dims)
    modules = sorted(
        (i, m) for i in range(num_layers) for m in TARGET_MODULES if acfg.targets(module_path(i, m))
    )
    rank_scaling = {(i, m): acfg.rank_and_scaling(module_path(i, m)) for i, m in modules}
    a_keys = tuple(tensor_key(i, m, "A") for i, m in modules)
    b_keys = tuple(tensor_key(i, m, "B") for i, m in modules)
    return Expected(
        modules=tuple(modules),
        keys=frozenset(a_keys + b_keys),
        a_keys=a_keys,
        b_keys=b_keys,
        a_shapes=tuple((rank_scaling[i, m][0], in_out[m][0]) for i, m in modules),
        b_shapes=tuple((in_out[m][1], rank_scaling[i, m][0]) for i, m in modules),
        rank_scaling=rank_scaling,
    )
