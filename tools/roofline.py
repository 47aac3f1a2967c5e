"""Roofline accounting for the benchmarks: the bytes a run's steps must read (base weights once a step,
the distinct adapters' pool rows once a step, each request's KV once per token it produces), the time
those bytes take at the device's measured copy bandwidth, and the best ratio a run can reach against a
baseline that read fewer bytes. `python -m tools.roofline probe` measures the bandwidth (one line, GB/s).

The bound against a baseline: the run can at best take the baseline's measured time per output token
plus the time its extra bytes per output token take at full bandwidth; the measured ratio over that best
ratio is the run's "fraction of the bound"."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.common.model_config import DTYPE_BYTES, ModelConfig


@dataclass(frozen=True)
class ModelBytes:
    """What one step of a model reads regardless of its batch, and what one token's KV takes."""

    weight_bytes: int  # every decoder linear and the LM head (the embedding is gathered, not read)
    kv_token_bytes: int  # K and V of one token over all layers

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelBytes:
        elt = DTYPE_BYTES[cfg.dtype]
        h, inter = cfg.hidden_size, cfg.intermediate_size
        per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * inter
        linear = cfg.num_layers * per_layer + cfg.vocab_size * h  # LM head (the tied embedding too)
        return cls(weight_bytes=linear * elt, kv_token_bytes=2 * cfg.num_layers * cfg.kv_size * elt)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelBytes:
        return cls.from_config(ModelConfig.from_dir(model_dir))


def kv_tokens_read(prompt_tokens: int, output_tokens: int) -> int:
    """Tokens of KV one request's steps read: its prefill reads the prompt's KV once, and the decode step
    that makes output token t (t = 1 .. n-1; token 0 comes from the prefill) reads prompt + t - 1 tokens."""
    p, n = prompt_tokens, output_tokens
    if n <= 0:
        return 0
    return p + (n - 1) * p + (n - 1) * (n - 2) // 2


def run_bytes(
    model: ModelBytes, steps: int, adapter_bytes: int, kv_tokens: int, bandwidth: float | None
) -> dict[str, Any]:
    """The bytes of a run of `steps` forward steps whose distinct adapters' rows sum to `adapter_bytes`
    over all steps and whose requests read `kv_tokens` tokens of KV; with `bandwidth` (bytes/s) the
    time those bytes take (`floor_s`)."""
    weights = steps * model.weight_bytes
    kv = kv_tokens * model.kv_token_bytes
    total = weights + adapter_bytes + kv
    return {
        "steps": steps,
        "weight_bytes": weights,
        "adapter_bytes": adapter_bytes,
        "kv_bytes": kv,
        "total_bytes": total,
        "bandwidth_Bps": bandwidth,
        "floor_s": total / bandwidth if bandwidth else None,
    }


def bound_ratio(
    run: dict[str, Any], run_tokens: int, base: dict[str, Any], base_tokens: int, base_seconds: float
) -> float | None:
    """The best throughput ratio `run` can reach against the baseline: the baseline's measured seconds a
    token plus the run's extra bytes a token at the measured bandwidth (a run that reads fewer bytes a
    token than the baseline is bounded at the baseline's own pace: 1.0)."""
    bw = run.get("bandwidth_Bps") or base.get("bandwidth_Bps")
    if not bw or run_tokens <= 0 or base_tokens <= 0 or base_seconds <= 0:
        return None
    base_per_tok = base_seconds / base_tokens
    extra = max(run["total_bytes"] / run_tokens - base["total_bytes"] / base_tokens, 0.0)
    return base_per_tok / (base_per_tok + extra / bw)


def fraction_of_bound(measured_ratio: float | None, bound: float | None) -> float | None:
    return measured_ratio / bound if measured_ratio is not None and bound else None


def serving_roofline(
    model: ModelBytes,
    delta: dict[str, Any],
    records: Iterable[Any],
    duration: float,
    bandwidth: float | None,
) -> dict[str, Any] | None:
    """A served run's bytes from the server's counters over the run (`delta`: plans and the distinct
    adapters' pool-row bytes the plans read) and the completed requests' prompt and output lengths;
    None when the server does not count plans."""
    plans = delta.get("plans")
    if plans is None:
        return None
    kv = sum(kv_tokens_read(r.prompt_tokens, r.output_tokens) for r in records if r.ok)
    out = run_bytes(model, int(plans), int(delta.get("step_adapter_bytes") or 0), kv, bandwidth)
    out["adapter_bytes_counted"] = delta.get("step_adapter_bytes") is not None
    out["floor_fraction"] = out["floor_s"] / duration if out["floor_s"] and duration > 0 else None
    return out


def probe_bandwidth(device: str = "cuda", nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device copy bandwidth in bytes/s, counting what a copy reads and what it writes (2 x nbytes a copy):
    the median of `iters` timed device-to-device copies after two untimed ones."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.roofline", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    probe = sub.add_parser("probe", help="print the device's copy bandwidth in GB/s")
    probe.add_argument("--device", default="cuda")
    probe.add_argument("--mib", type=int, default=1024, help="bytes a copy moves (MiB)")
    ns = p.parse_args(argv)
    print(f"{probe_bandwidth(ns.device, ns.mib << 20) / 1e9:.1f}")


if __name__ == "__main__":
    main()
