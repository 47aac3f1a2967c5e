"""`lorapipe serve` flags of adapter loading and admission (the "loading" help group): how adapters are
copied into the GPU pool beside running steps, how the waiting queue is ordered around them, and how many
loads and part-writer processes the loader runs."""

from __future__ import annotations

import argparse

from runtime.engine_args import EngineArgs


def add_loading_arguments(g: argparse._ArgumentGroup, d: EngineArgs) -> None:
    """Adapter loading and admission: overlap, prefetch, copy mode, the bypass and affinity bounds,
    and the loader's concurrency."""
    g.add_argument(
        "--overlap-loading",
        action=argparse.BooleanOptionalAction,
        default=d.overlap_loading,
        help="copy adapters into the pool beside steps that do not use them (off: the step waits)",
    )
    g.add_argument(
        "--prefetch-depth",
        type=int,
        metavar="N",
        default=d.prefetch_depth,
        help="waiting requests looked ahead at for pool loads (0: off)",
    )
    g.add_argument(
        "--overlap-min-mb",
        type=float,
        metavar="MB",
        default=d.overlap_min_mb,
        help="smaller adapters are not prefetched into the pool, only copied whole for the step that needs "
        "them (which keeps its CUDA graph); larger ones are prefetched and copied layer by layer "
        "(0: prefetch all)",
    )
    g.add_argument(
        "--max-adapter-bypass",
        type=int,
        metavar="N",
        default=d.max_adapter_bypass,
        help="steps in which later requests may be admitted before one whose adapter is staged; then "
        "the scheduler reserves room for its adapter (bounds every adapter wait)",
    )
    g.add_argument(
        "--adapter-affinity-steps",
        type=int,
        metavar="N",
        default=d.adapter_affinity_steps,
        help="admit waiting requests whose adapter is already in the step before the others, each "
        "request passed for at most N steps after it was queued (fewer distinct adapters per running "
        "request; 0: queue order)",
    )
    g.add_argument(
        "--loader-threads",
        type=int,
        metavar="N",
        default=None,
        help="adapter loads at once; without writer processes, also the threads that read and pack them "
        "(default: cores / 2, 2 to 8)",
    )
    g.add_argument(
        "--loader-writers",
        type=int,
        metavar="N",
        default=None,
        help="processes that read and pack adapter files, one adapter's parts spread over all, each with its "
        "own interpreter (no shared GIL); 0: the loader's threads do it (default: cores / 2 up to 8 with 8 "
        "cores or more, else 0)",
    )
