"""Whether the compile cache already holds every kernel this runner's start-up loads: a marker file beside
the kernels, written once a start-up's warm-up and graph capture compiled nothing in the worker (so each
kernel they launched came from the cache). A start that finds it for its warm-up plan starts no compile
pool and records no launches: its launch pass only loads kernels, without sixteen processes importing
torch and Triton beside it. A kernel found missing after all is compiled in the worker, before ready,
and the marker is removed, so the next start uses the pool again.

The marker's name is a digest of what the kernels are chosen from: the runner's settings, the model's
shapes, the device's SM count and dependent-launch setting, and the heuristics' sources; the directory
itself is namespaced by GPU, Triton version and kernel sources (`compile_pool.namespace_cache`). Its
content names the warm-up plan it was written for (`plan_cache.fingerprint`), checked once the plan's
inputs (the KV cache's size among them) are known."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kernels import device_info
from stages.worker.plan_cache import sources_digest

if TYPE_CHECKING:
    import torch

    from runtime.common.model_config import ModelConfig
    from stages.worker.runner_config import RunnerConfig

log = logging.getLogger("lorapipe.worker")


class WarmMarker:
    """The marker of one runner's start-up in the compile cache (TRITON_CACHE_DIR when first asked)."""

    def __init__(self, cfg: RunnerConfig, model_cfg: ModelConfig, device: torch.device) -> None:
        parts = {
            "runner": dataclasses.asdict(cfg),
            "model": repr(model_cfg),
            "device": [device_info.num_sms(device), device_info.pdl(device)],
            "sources": sources_digest(),
        }
        self.digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
        self._path: Path | None = None

    @property
    def path(self) -> Path | None:
        """The marker file (None without TRITON_CACHE_DIR); fixed at the first call, so ask after the
        cache directory was namespaced."""
        if self._path is None and os.environ.get("TRITON_CACHE_DIR"):
            self._path = Path(os.environ["TRITON_CACHE_DIR"]) / f"lorapipe-warm-{self.digest}.json"
        return self._path

    def plan(self) -> str | None:
        """The warm-up plan the marker was written for; None without a readable marker."""
        path = self.path
        if path is None or not path.is_file():
            return None
        try:
            plan = json.loads(path.read_text())["plan"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("compile cache marker %s unreadable (%s): ignored", path, exc)
            return None
        return plan if isinstance(plan, str) else None

    def complete(self) -> bool:
        """Whether a marker is there (the plan it names is checked by `holds`, when known)."""
        return self.plan() is not None

    def holds(self, plan: str) -> bool:
        return self.plan() == plan

    def settle(self, plan: str, clean: bool) -> None:
        """After the warm-up and graph capture: `clean` (nothing compiled in the worker) writes the marker
        for `plan` (atomically); otherwise the marker is removed. A cache that cannot be written is left."""
        path = self.path
        if path is None:
            return
        try:
            if not clean:
                path.unlink(missing_ok=True)
            elif self.plan() != plan:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"plan": plan}))
                tmp.replace(path)  # a reader sees the whole file or none
        except OSError as exc:
            log.warning("compile cache marker %s not updated: %s", path, exc)
