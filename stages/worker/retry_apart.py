"""A step whose batched forward failed runs again one adapter at a time, so that only the requests of
the adapter that fails again are failed (`StepExecutor`, single-rank only: a tensor-parallel rank never
runs a forward on its own)."""

from __future__ import annotations

import torch

from proto.plan import RequestError
from stages.worker.runner import ModelRunner, SeqInput
from stages.worker.step_state import InFlightStep


def execute_apart(
    runner: ModelRunner,
    step: InFlightStep,
    seqs: list[SeqInput],
    layer_waits: list[list] | None,
    pending: torch.Tensor | None,
    exc: Exception,
) -> torch.Tensor:
    """The batch's forward failed (`exc`): run it again one adapter at a time (requests without one
    alone), so only the group that fails again is failed (and leaves `step.scheduled`); returns the
    logits of those kept, in their order, or raises `exc` when every group failed. Recomputing writes
    the same KV positions again, so the partial writes of the failed attempt are overwritten."""
    groups: dict[object, list[int]] = {}
    for i, (req, _) in enumerate(step.scheduled):
        groups.setdefault(req.slot if req.slot >= 0 else ("base", i), []).append(i)
    kept: list[int] = []
    parts: list[torch.Tensor] = []
    for rows in groups.values():
        try:
            parts.append(runner.execute([seqs[i] for i in rows], layer_waits, pending))
        except Exception as again:
            for i in rows:
                req = step.scheduled[i][0]
                req.end(step.launch)
                why = f"worker step failed: {type(again).__name__}: {again}"
                step.errors.append(RequestError(request_id=req.request_id, message=why[:2000]))
            continue
        kept.extend(rows)
    if not parts:
        raise exc
    step.scheduled = [step.scheduled[i] for i in kept]
    return torch.cat(parts)
