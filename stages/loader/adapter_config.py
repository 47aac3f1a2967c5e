"""Reads and checks a PEFT `adapter_config.json`: every option the runtime cannot honour exactly is
refused with an `AdapterError` naming the adapter and the reason."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from stages.worker.lora.layout import TARGET_MODULES

_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message starts with the adapter's name."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"adapter {name!r}: {reason}")
        self.adapter = name
        self.reason = reason


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: tuple[str, ...] | str  # a list of names, or a regex over module paths
    layers_to_transform: tuple[int, ...] | None

    def rank_and_scaling(self, module_path: str) -> tuple[int, float]:
        """PEFT's rule: the first pattern key matching the end of the module's dotted path wins."""
        r = _match(self.rank_pattern, module_path, self.r)
        alpha = _match(self.alpha_pattern, module_path, self.alpha)
        return r, (alpha / r**0.5 if self.use_rslora else alpha / r)


def _match(pattern: dict, module_path: str, default):
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def read_adapter_config(name: str, adapter_dir: Path) -> AdapterConfig:
    path = adapter_dir / "adapter_config.json"
    if not adapter_dir.is_dir():
        raise AdapterError(name, f"{adapter_dir} is not a directory")
    try:
        c = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(name, f"no adapter_config.json in {adapter_dir}") from None
    except (OSError, ValueError) as e:
        raise AdapterError(name, f"unreadable adapter_config.json ({e})") from None
    if not isinstance(c, dict):
        raise AdapterError(name, "adapter_config.json is not a JSON object")

    peft_type = c.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(name, f"peft_type {peft_type!r} is not supported (only LORA)")
    if c.get("use_dora"):
        raise AdapterError(name, "DoRA adapters (use_dora=true) are not supported")
    if c.get("modules_to_save"):
        raise AdapterError(name, f"modules_to_save {c['modules_to_save']!r} is not supported")
    if c.get("bias", "none") != "none":
        raise AdapterError(name, f"bias={c['bias']!r} is not supported (only 'none')")
    if c.get("lora_bias"):
        raise AdapterError(name, "lora_bias=true is not supported")
    if c.get("fan_in_fan_out"):
        raise AdapterError(name, "fan_in_fan_out=true is not supported for Llama-family linear layers")
    if c.get("target_parameters"):
        raise AdapterError(name, "target_parameters is not supported")
    targets = c.get("target_modules")
    _check_targets(name, targets)

    r = c.get("r")
    if not isinstance(r, int) or r < 1:
        raise AdapterError(name, f"rank r={r!r} must be a positive integer")
    alpha = c.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or alpha <= 0:
        raise AdapterError(name, f"lora_alpha={alpha!r} must be a positive number")
    return AdapterConfig(
        r=r,
        alpha=float(alpha),
        use_rslora=bool(c.get("use_rslora", False)),
        rank_pattern=dict(c.get("rank_pattern") or {}),
        alpha_pattern={k: float(v) for k, v in (c.get("alpha_pattern") or {}).items()},
        target_modules=targets if isinstance(targets, str) else tuple(targets),
        layers_to_transform=_layers(name, c.get("layers_to_transform")),
    )


def _layers(name: str, layers) -> tuple[int, ...] | None:
    if layers is None:
        return None
    layers = [layers] if isinstance(layers, int) else layers
    if not all(isinstance(i, int) and i >= 0 for i in layers):
        raise AdapterError(name, f"layers_to_transform={layers!r} must be layer indices")
    return tuple(layers)


def _check_targets(name: str, targets) -> None:
    if targets is None:
        raise AdapterError(name, "adapter_config.json has no target_modules")
    if isinstance(targets, str):
        # A regex over module paths: the tensors tell which modules it matched; checked there.
        for bad in _UNSUPPORTED_TARGETS:
            if re.search(bad, targets):
                raise AdapterError(name, f"target {bad} is not supported (only {', '.join(TARGET_MODULES)})")
        return
    for t in targets:
        if t in _UNSUPPORTED_TARGETS:
            raise AdapterError(name, f"target {t} is not supported (only {', '.join(TARGET_MODULES)})")
        if t not in TARGET_MODULES and t != "all-linear":
            raise AdapterError(name, f"target module {t!r} is not supported (only {', '.join(TARGET_MODULES)})")
