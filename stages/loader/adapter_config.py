"""Reads and checks a PEFT `adapter_config.json` (a regular file, size-capped, read with a deadline):
every option the runtime cannot honour exactly, and every rank or scaling out of range, is refused with
an `AdapterError` naming the adapter and the reason; `check_delta_magnitude` bounds the effective delta."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.common.lora_layout import TARGET_MODULES
from stages.loader.files import FileRefused, read_regular

if TYPE_CHECKING:  # reading the config needs none; the value checks below import it
    import torch

MAX_CONFIG_BYTES = 1 << 20  # PEFT configs are a few KiB; rank/alpha patterns of large models stay far below
CONFIG_DEADLINE_S = 10.0
MAX_PATTERN_KEYS = 4096
MAX_DELTA_ENTRY = 1e4  # LoRA deltas correct weights of order 1: anything near this is not a trained adapter

# Module paths (as PEFT sees them in a *ForCausalLM) of the targets the runtime cannot serve.
_UNSUPPORTED_TARGETS = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
_ONLY = f"only {', '.join(TARGET_MODULES)}"
# PEFT options that change what the adapter computes in ways the runtime does not implement (field → reason).
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA adapters (use_dora=true) are not supported",
    "lora_bias": "lora_bias=true is not supported",
    "fan_in_fan_out": "fan_in_fan_out=true is not supported for Llama-family linear layers",
    "target_parameters": "target_parameters is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported (it changes the embedding)",
    "layer_replication": "layer_replication is not supported (it changes the base model's layers)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QALoRA adapters (use_qalora=true) are not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA adapters (kasa_config) are not supported",
    "monteclora_config": "MonteCLoRA adapters (monteclora_config) are not supported",
}
# init_lora_weights values whose adapters only work on base weights PEFT rewrites at load.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "lora_ga")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message starts with the adapter's name."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"adapter {name!r}: {reason}")
        self.adapter = name
        self.reason = reason


class LoaderFault(AdapterError):
    """The loader, not the adapter, failed it (a read past its deadline, a writer process that died):
    the adapter may be tried again, so it is answered as the loader's fault."""


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: tuple[str, ...] | str  # a list of names, or a regex over module paths
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None = None
    exclude_modules: tuple[str, ...] | str | None = None

    def rank_and_scaling(self, module_path: str) -> tuple[int, float]:
        """PEFT's rule: the first pattern key matching the end of the module's dotted path wins."""
        r = _match(self.rank_pattern, module_path, self.r)
        alpha = _match(self.alpha_pattern, module_path, self.alpha)
        return r, (alpha / r**0.5 if self.use_rslora else alpha / r)

    def targets(self, module_path: str) -> bool:
        """Whether PEFT puts a LoRA layer on `module_path` (its `check_target_module_exists` rule)."""
        ex = self.exclude_modules
        if isinstance(ex, str) and re.fullmatch(ex, module_path):
            return False
        if isinstance(ex, tuple) and any(_ends_with(module_path, k) for k in ex):
            return False
        if isinstance(self.target_modules, str):
            if self.target_modules.lower() == "all-linear":
                return module_path.rsplit(".", 1)[-1] in TARGET_MODULES
            return re.fullmatch(self.target_modules, module_path) is not None
        if not any(_ends_with(module_path, t) for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        return _layer_index(module_path, self.layers_pattern) in self.layers_to_transform


def _ends_with(module_path: str, key: str) -> bool:
    return module_path == key or module_path.endswith(f".{key}")


def _layer_index(module_path: str, layers_pattern: tuple[str, ...] | None) -> int | None:
    # Lazy `.*?` so the first numbered segment is the layer index, as in PEFT.
    patterns = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in layers_pattern or ()]
    patterns = patterns or [r".*?\.[^.]*\.(?P<idx>\d+)\."]
    for p in patterns:
        if m := re.match(p, module_path):
            return int(m["idx"])
    return None


def _match(pattern: dict, module_path: str, default):
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def read_adapter_config(
    name: str,
    adapter_dir: Path,
    *,
    max_bytes: int = MAX_CONFIG_BYTES,
    deadline_s: float = CONFIG_DEADLINE_S,
) -> AdapterConfig:
    path = adapter_dir / "adapter_config.json"
    if not adapter_dir.is_dir():
        raise AdapterError(name, f"{adapter_dir} is not a directory")
    try:
        c = json.loads(read_regular(path, max_bytes, deadline_s))
    except FileNotFoundError:
        raise AdapterError(name, f"no adapter_config.json in {adapter_dir}") from None
    except FileRefused as e:
        raise AdapterError(name, str(e)) from None
    except (OSError, ValueError, RecursionError) as e:
        raise AdapterError(name, f"unreadable adapter_config.json ({type(e).__name__}: {e})"[:500]) from None
    if not isinstance(c, dict):
        raise AdapterError(name, "adapter_config.json is not a JSON object")

    peft_type = c.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(name, f"peft_type {peft_type!r} is not supported (only LORA)")
    for option, reason in _UNSUPPORTED_OPTIONS.items():
        if c.get(option):
            raise AdapterError(name, reason)
    if c.get("modules_to_save"):
        raise AdapterError(name, f"modules_to_save {c['modules_to_save']!r} is not supported")
    if c.get("bias", "none") != "none":
        raise AdapterError(name, f"bias={c['bias']!r} is not supported (only 'none')")
    init = str(c.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_REWRITING_INITS):
        raise AdapterError(
            name,
            f"init_lora_weights={c['init_lora_weights']!r} rewrites the base weights, so the adapter cannot "
            "share the base model; convert it to plain LoRA (path_initial_model_for_weight_conversion)",
        )
    targets = c.get("target_modules")
    _check_targets(name, targets)

    r = _rank(name, "r", c.get("r"))
    alpha = _alpha(name, "lora_alpha", c.get("lora_alpha", 8))
    rank_pattern = _pattern(name, "rank_pattern", c.get("rank_pattern"), _rank)
    alpha_pattern = _pattern(name, "alpha_pattern", c.get("alpha_pattern"), _alpha)
    return AdapterConfig(
        r=r,
        alpha=alpha,
        use_rslora=bool(c.get("use_rslora", False)),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        target_modules=targets if isinstance(targets, str) else tuple(targets),
        layers_to_transform=_layers(name, c.get("layers_to_transform")),
        layers_pattern=_names(name, "layers_pattern", c.get("layers_pattern")),
        exclude_modules=_exclude(name, c.get("exclude_modules")),
    )


def _rank(name: str, field: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 16:
        raise AdapterError(name, f"{field}={value!r} must be a positive integer rank")
    return value


def _alpha(name: str, field: str, value) -> float:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise AdapterError(name, f"{field}={value!r} must be a finite positive number")
    return float(value)


def _pattern(name: str, field: str, value, check) -> dict:
    """A PEFT pattern: {module regex: value}, each key a valid regex and each value checked."""
    if not value:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_PATTERN_KEYS:
        raise AdapterError(name, f"{field} must be an object of at most {MAX_PATTERN_KEYS} entries")
    out = {}
    for key, v in value.items():
        if len(key) > 512:
            raise AdapterError(name, f"{field} key {key[:40]!r}... is longer than 512 characters")
        _compile(name, field, key)
        out[key] = check(name, f"{field}[{key!r}]", v)
    return out


def delta_limit(dtype: torch.dtype, in_dim: int) -> float:
    """The largest effective-delta entry accepted: MAX_DELTA_ENTRY, and for a narrow dtype what `in_dim`
    such entries may sum to without overflowing it."""
    import torch

    top = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
    return min(MAX_DELTA_ENTRY, top / max(in_dim, 1))


def check_delta_magnitude(
    name: str, where: str, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype
) -> None:
    """Refuse a module whose effective delta `scaling * B @ A` (A [r, in], B [out, r]) is not finite,
    whose weights do not fit `dtype`, or whose entries could exceed MAX_DELTA_ENTRY (and, for float16,
    what `in` such entries can sum to). No matmul: |(B @ A)[i, j]| <= ||B[i, :]|| * ||A[:, j]||."""
    import torch

    if not math.isfinite(scaling) or scaling <= 0:
        raise AdapterError(name, f"{where}: scaling {scaling!r} is not a finite positive number")
    top = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
    a_max, b_max = float(a.detach().abs().max()), float(b.detach().abs().max())
    if not (a_max <= top and b_max <= top):  # NaN compares false
        raise AdapterError(name, f"{where}: weights beyond the range of {str(dtype).removeprefix('torch.')}")
    if a_max == 0 or b_max == 0:
        return  # a zero delta (PEFT's init for B)
    # norms of the weights divided by their largest entry: float32 never overflows on them
    a_norm = float((a.detach().float() / a_max).norm(dim=0).max()) * a_max  # max over columns of A
    b_norm = float((b.detach().float() / b_max).norm(dim=1).max()) * b_max  # max over rows of B
    bound = scaling * b_norm * a_norm
    limit = delta_limit(dtype, a.shape[1])
    if not math.isfinite(bound) or bound > limit:
        raise AdapterError(
            name,
            f"{where}: the effective delta (scaling x B @ A) may reach {bound:.3g} per weight, more than the "
            f"{limit:.3g} this runtime accepts (weights or lora_alpha far out of range)",
        )


def _layers(name: str, layers) -> tuple[int, ...] | None:
    if layers is None or layers == []:  # PEFT treats an empty list as "every layer"
        return None
    layers = [layers] if isinstance(layers, int) else layers
    if not isinstance(layers, list) or not all(isinstance(i, int) and i >= 0 for i in layers):
        raise AdapterError(name, f"layers_to_transform={layers!r} must be layer indices")
    return tuple(layers)


def _names(name: str, field: str, value) -> tuple[str, ...] | None:
    if not value:
        return None
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterError(name, f"{field}={value!r} must be a string or a list of strings")
    return tuple(value)


def _exclude(name: str, value) -> tuple[str, ...] | str | None:
    if isinstance(value, str) and value:
        _compile(name, "exclude_modules", value)
        return value
    return _names(name, "exclude_modules", value)


def _compile(name: str, field: str, regex: str) -> re.Pattern:
    try:
        return re.compile(regex)
    except re.error as e:
        raise AdapterError(name, f"{field} regex {regex!r} is invalid ({e})") from None


def _check_targets(name: str, targets) -> None:
    if not targets:
        raise AdapterError(name, "adapter_config.json has no target_modules")
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            return
        # A regex PEFT full-matches against module paths: refuse it if it reaches a module we cannot serve.
        pattern = _compile(name, "target_modules", targets)
        for module, path in _UNSUPPORTED_TARGETS.items():
            if pattern.fullmatch(path):
                raise AdapterError(name, f"target {module} is not supported ({_ONLY})")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(name, f"target_modules={targets!r} must be a regex or a list of module names")
    for t in targets:
        # PEFT matches a list entry against the end of a module path, so "self_attn.q_proj" is q_proj.
        module = t.rsplit(".", 1)[-1]
        if module in _UNSUPPORTED_TARGETS:
            raise AdapterError(name, f"target {module} is not supported ({_ONLY})")
        if module not in TARGET_MODULES:
            raise AdapterError(name, f"target module {t!r} is not supported ({_ONLY})")
