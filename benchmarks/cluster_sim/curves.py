"""The measured curves one simulated replica follows, read from benchmarks/cluster_curves.json (every value
there cites its docs/benchmarks.md table): decode step time by batch size and distinct adapters, prefill
cost per token, adapter bytes by rank, disk→host and host→GPU rates, pool and host-cache capacity."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_FILE = Path(__file__).resolve().parents[1] / "cluster_curves.json"
GIB = 2**30  # the server's --lora-gpu-memory-gb / --cpu-lora-cache-gb are GiB


class CurveError(ValueError):
    """The curve file is missing a value or a citation; the message names the key."""


def _lerp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Curves:
    decode_points: tuple[tuple[int, int, float], ...]  # (batch, distinct adapters, step ms)
    prefill_ms_per_token_base: float
    prefill_ms_per_token_lora: float
    adapter_bytes_by_rank: dict[int, float]
    disk_to_host_bytes_s: float
    host_to_gpu_bytes_s: float
    gpu_pool_bytes: float
    host_cache_bytes: float
    max_running: int
    max_tokens_per_step: int

    @classmethod
    def load(cls, path: str | Path = DEFAULT_FILE, loader: str = "serving") -> Curves:
        """`loader`: "serving" (the disk→host rate the server reached) or "bench" (bench_loader's)."""
        raw = json.loads(Path(path).read_text())
        for key, entry in raw.items():
            if isinstance(entry, dict) and not str(entry.get("source", "")).startswith("docs/benchmarks.md"):
                raise CurveError(f"{path}: {key!r} cites no docs/benchmarks.md section")
        try:
            points = tuple(
                (p["batch"], p["distinct_adapters"], float(p["ms"])) for p in raw["decode_step_ms"]["points"]
            )
            prefill = raw["prefill_ms_per_2048_tokens"]
            disk = raw["disk_to_host" if loader == "serving" else "disk_to_host_bench"]
            h2d = raw["host_to_gpu"]
            return cls(
                decode_points=points,
                prefill_ms_per_token_base=prefill["base_only"] / 2048,
                prefill_ms_per_token_lora=prefill["with_adapters"] / 2048,
                adapter_bytes_by_rank={
                    int(r): mb * 1e6 for r, mb in raw["adapter_bytes"]["mb_by_rank"].items()
                },
                disk_to_host_bytes_s=disk["gb_s"] * 1e9,
                host_to_gpu_bytes_s=h2d["peak_gb_s"] * 1e9 * h2d["ratio"],
                gpu_pool_bytes=raw["gpu_pool"]["gb"] * GIB,
                host_cache_bytes=raw["host_cache"]["gb"] * GIB,
                max_running=int(raw["max_running_requests"]["value"]),
                max_tokens_per_step=int(raw["max_tokens_per_step"]["value"]),
            )
        except KeyError as exc:
            raise CurveError(f"{path}: missing {exc}") from None

    def decode_ms(self, batch: int, distinct: int) -> float:
        """Step time of a decode batch: linear in distinct adapters between the measured counts (flat
        beyond the largest: measured, the curve levels off well before it), linear in batch between the
        measured sizes, flat outside."""
        batches = sorted({b for b, _, _ in self.decode_points})
        b = min(max(batch, batches[0]), batches[-1])
        lo = max(x for x in batches if x <= b)
        hi = min(x for x in batches if x >= b)
        at_lo, at_hi = self._by_adapters(lo, distinct), self._by_adapters(hi, distinct)
        return at_lo if lo == hi else _lerp(b, lo, hi, at_lo, at_hi)

    def _by_adapters(self, batch: int, distinct: int) -> float:
        pts = sorted((k, ms) for b, k, ms in self.decode_points if b == batch)
        if len(pts) == 1:
            return pts[0][1]
        for (k0, y0), (k1, y1) in zip(pts, pts[1:], strict=False):
            if distinct <= k1:
                return _lerp(distinct, k0, k1, y0, y1)
        return pts[-1][1]

    def prefill_ms(self, tokens: int, with_adapters: bool) -> float:
        per = self.prefill_ms_per_token_lora if with_adapters else self.prefill_ms_per_token_base
        return tokens * per

    def adapter_bytes(self, rank: int) -> float:
        if rank not in self.adapter_bytes_by_rank:
            raise CurveError(f"no adapter size for rank {rank} (have {sorted(self.adapter_bytes_by_rank)})")
        return self.adapter_bytes_by_rank[rank]
