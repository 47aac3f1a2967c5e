"""The ITL-under-load workload file: long requests on resident adapters, all arriving at 0, plus short
requests on other adapters arriving later (Poisson, one adapter after another) so that their slot loads
happen while the long requests decode. `--as-resident` puts every short request on the resident adapters
instead (same prompts, lengths and times; nothing to load): the warm-up for the same shapes.
    python -m benchmarks.itl_workload --out FILE --resident A,B --loading C,D,E [--loading-rate 4]"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import msgspec

from tools.workload import (
    WorkloadRequest,
    WorkloadSpec,
    generate_workload,
    parse_span,
    sub_seed,
    workload_digest,
    write_workload,
)


def itl_workload(
    resident: Sequence[str],
    loading: Sequence[str],
    *,
    resident_requests: int = 8,
    resident_input: tuple[int, int] = (128, 128),
    resident_output: tuple[int, int] = (256, 256),
    loading_requests: int | None = None,
    loading_input: tuple[int, int] = (128, 128),
    loading_output: tuple[int, int] = (16, 16),
    loading_rate: float = 4.0,
    loading_start: float = 1.0,
    seed: int = 0,
    as_resident: bool = False,
) -> list[WorkloadRequest]:
    """Resident lines first (round robin over `resident`), then loading lines (round robin over
    `loading`, one request per adapter unless `loading_requests` says otherwise)."""
    if not resident or not loading:
        raise ValueError("need at least one resident and one loading adapter")
    if set(resident) & set(loading):
        raise ValueError(f"adapters both resident and loading: {sorted(set(resident) & set(loading))}")
    if loading_start < 0 or loading_rate <= 0:
        raise ValueError("need --loading-start >= 0 and --loading-rate > 0")
    long = generate_workload(
        WorkloadSpec(
            num_prompts=resident_requests,
            input_len=resident_input,
            output_len=resident_output,
            adapters=tuple(resident),
            distribution="distinct",
            seed=sub_seed(seed, "resident"),
        )
    )
    short = generate_workload(
        WorkloadSpec(
            num_prompts=len(loading) if loading_requests is None else loading_requests,
            request_rate=loading_rate,
            input_len=loading_input,
            output_len=loading_output,
            adapters=tuple(loading),
            distribution="distinct",
            seed=sub_seed(seed, "loading"),
        )
    )
    out = list(long)
    for i, req in enumerate(short):
        adapter = resident[i % len(resident)] if as_resident else req.adapter
        arrival = round(req.arrival + loading_start, 6)
        out.append(msgspec.structs.replace(req, arrival=arrival, adapter=adapter))
    return out


def _names(text: str) -> list[str]:
    return [a for a in text.split(",") if a]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.itl_workload", description=__doc__)
    p.add_argument("--out", required=True, metavar="FILE", help="workload JSONL to write")
    p.add_argument("--resident", required=True, metavar="A,B", help="adapters kept resident (pinned)")
    p.add_argument("--loading", required=True, metavar="C,D", help="adapters that must load during the run")
    p.add_argument("--resident-requests", type=int, default=8, metavar="N")
    p.add_argument("--resident-input-len", type=parse_span, default=(128, 128), metavar="N|LO:HI")
    p.add_argument("--resident-output-len", type=parse_span, default=(256, 256), metavar="N|LO:HI")
    p.add_argument("--loading-requests", type=int, default=None, metavar="N", help="default: one each")
    p.add_argument("--loading-input-len", type=parse_span, default=(128, 128), metavar="N|LO:HI")
    p.add_argument("--loading-output-len", type=parse_span, default=(16, 16), metavar="N|LO:HI")
    p.add_argument("--loading-rate", type=float, default=4.0, metavar="R", help="req/s, Poisson")
    p.add_argument("--loading-start", type=float, default=1.0, metavar="S", help="first short arrival")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--as-resident", action="store_true", help="short requests on resident adapters")
    ns = p.parse_args(argv)
    try:
        reqs = itl_workload(
            _names(ns.resident),
            _names(ns.loading),
            resident_requests=ns.resident_requests,
            resident_input=ns.resident_input_len,
            resident_output=ns.resident_output_len,
            loading_requests=ns.loading_requests,
            loading_input=ns.loading_input_len,
            loading_output=ns.loading_output_len,
            loading_rate=ns.loading_rate,
            loading_start=ns.loading_start,
            seed=ns.seed,
            as_resident=ns.as_resident,
        )
    except ValueError as exc:
        p.error(str(exc))
    write_workload(ns.out, reqs)
    last = max(r.arrival for r in reqs)
    digest = workload_digest(reqs)[:16]
    print(f"wrote {len(reqs)} requests (last arrival {last:.2f} s) to {ns.out}, sha256 {digest}")


if __name__ == "__main__":
    main()
