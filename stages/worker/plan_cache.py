"""The warm-up plan (`warmup_plan.py`), kept as a JSON file beside the compiled kernels it lists: a start
on a filled compile cache (a restart, or a cache made by `lorapipe warmup`) reads it instead of computing
it again, and so knows that the graphs' kernels are in the cache too (`warmup.py` then skips their dry
runs, seconds of host time).

The file's name is a digest of everything the plan is computed from: the backend's sizes and choices,
the device's SM count and dependent-launch setting, the graphs' padded sizes, the attention sizes, and
the source of every module whose heuristics pick a variant. Any change makes another name, so a stale
plan is never read; an unreadable file is computed again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kernels import device_info
from stages.worker.compile_pool import sources_hash
from stages.worker.warmup_plan import LoraLaunch

log = logging.getLogger("lorapipe.worker")
ROOT = Path(__file__).resolve().parents[2]
# where the heuristics that choose a variant live (any edit there may change the plan)
SOURCES = ("kernels", "stages/worker/lora", "stages/worker/warmup_plan.py", "stages/worker/plan_cache.py")

Plan = tuple[list[LoraLaunch], list[tuple[int, int]]]


def sources_digest() -> str:
    return sources_hash([ROOT / name for name in SOURCES], ROOT)


def fingerprint(backend, padded: Sequence, attention: dict) -> str:
    """Digest of the plan's inputs. `backend`: the Triton LoRA backend (None: no LoRA plan);
    `attention`: attention_variants' arguments (empty: no attention plan)."""
    parts: dict = {
        "sources": sources_digest(),
        "padded": [list(p) if isinstance(p, tuple) else p for p in padded],
    }
    if backend is not None:
        dev = backend.pool.device
        parts["lora"] = [
            repr(backend.layout), backend.max_tokens, backend.max_seqs, backend.fuse_act, backend.design,
            backend.pool.num_ids, str(backend.pool.mem.dtype), device_info.num_sms(dev),
            device_info.pdl(dev), device_info.PDL_MAX_TILES,
        ]  # fmt: skip
    parts["attention"] = {k: str(v) for k, v in sorted(attention.items())}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cached_plan(cache_dir: str | None, key: str, compute: Callable[[], Plan]) -> tuple[Plan, bool]:
    """The plan from `cache_dir` when a file for `key` is there, else `compute()` (then written there,
    atomically). Returns (plan, whether it was read)."""
    path = Path(cache_dir) / f"lorapipe-warmup-plan-{key}.json" if cache_dir else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text())
            lora = [LoraLaunch(g, t, n, bm, br, tuple(k)) for g, t, n, bm, br, k in data["lora"]]
            return (lora, [(bm, s) for bm, s in data["attention"]]), True
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("warm-up plan %s unreadable (%s): computing it again", path, exc)
    plan = compute()
    if path is not None:  # written before the kernels are: the warm-up then fills the cache it names
        lora, attention = plan
        data = {
            "lora": [
                [
                    x.group,
                    x.num_tokens,
                    x.num_tiles,
                    x.block_m,
                    x.block_rank,
                    [v if isinstance(v, int) else str(v) for v in x.key],
                ]
                for x in lora
            ],
            "attention": [list(a) for a in attention],
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(path)  # a reader sees the whole file or none
        except OSError as exc:
            log.warning("warm-up plan not kept in %s: %s", path.parent, exc)
    return plan, False
