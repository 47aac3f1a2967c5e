"""Structured output inside a step (stages/worker/guided.py holds the matchers): the masks a launch hands
the sampler, and the grammar's verdict on the tokens a finish reads. Each feeds the matchers only the
tokens they have not taken (one or two a request), all in one call, so a step costs the step thread a
few look-ups a request whatever the outputs' lengths."""

from __future__ import annotations

from proto.plan import RequestError
from stages.worker.guided import GuidedMasks, MaskJob
from stages.worker.sampler import Allowed, SampledTokens
from stages.worker.step_state import WorkerRequest


class StepMasks:
    """A launch's masks, started: `allowed` waits for them and puts them on the device for the sampler."""

    def __init__(self, rows: list[int], job: MaskJob):
        self.rows, self.job = rows, job

    def allowed(self, width: int) -> Allowed:
        masks = self.job.result(width)
        failed = {self.rows[j]: why for j, why in self.job.failed.items()}
        return Allowed(masks, {k: j for j, k in enumerate(self.rows)}, failed)


def step_masks(
    guided: GuidedMasks, reqs: list[WorkerRequest], before: SampledTokens | None, background: bool
) -> StepMasks | None:
    """The token masks of the requests with a grammar, started (None when none has one). Each matcher
    is fed its request's outputs first: with overlapped scheduling the last may be the step before's
    token, still a placeholder here, so the host waits for that step's tokens, which the device computed
    before this step's forward, queued already; the masks are then computed while it runs, `background`:
    on llguidance's threads while the step thread goes on (the step before's finish), until `allowed`.
    A grammar that failed (now or before) allows nothing, and its request is named in `failed`."""
    rows = [k for k, r in enumerate(reqs) if r.request_id in guided]
    if not rows:
        return None
    ids = [reqs[k].request_id for k in rows]
    known = (lambda: before.result()[0]) if before is not None else None
    guided.feed(
        [(r.request_id, r.token_ids, r.prompt_len, len(r.token_ids)) for r in map(reqs.__getitem__, rows)],
        known,
    )
    return StepMasks(rows, guided.start(ids, background))


def grammar_ends(
    guided: GuidedMasks, kept: list[tuple[int, WorkerRequest, int, str | None]], launch: int, errors: list
) -> list[tuple[int, WorkerRequest, int, str | None]]:
    """A finish's rows (row, request, where its new token is, why it stops or None) after their grammars'
    verdicts: a token that leaves its request's grammar fails the request (its row dropped, a
    RequestError appended to `errors`); a complete grammar stops it. The step launched after this one
    may have fed the matchers these tokens already."""
    asks = [i for i, (_, req, _, reason) in enumerate(kept) if reason is None and req.request_id in guided]
    if not asks:
        return kept
    guided.feed(
        [(r.request_id, r.token_ids, r.prompt_len, at + 1) for _, r, at, _ in map(kept.__getitem__, asks)]
    )
    failed = set()
    for i in asks:
        row, req, at, _ = kept[i]
        if (why := guided.error(req.request_id)) is not None:
            req.end(launch)
            del req.token_ids[at:]
            errors.append(RequestError(request_id=req.request_id, message=why))
            failed.add(i)
        elif guided.stopped(req.request_id):
            kept[i] = (row, req, at, "stop")
    return [k for i, k in enumerate(kept) if i not in failed] if failed else kept
