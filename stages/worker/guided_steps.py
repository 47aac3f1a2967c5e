"""Structured output inside a step (stages/worker/guided.py holds the matchers): the masks a launch hands
the sampler, and the grammar's verdict on the tokens a finish reads. Each feeds the matchers only the
tokens they have not taken (one or two a request), all in one call, so a step costs the step thread a
few look-ups a request whatever the outputs' lengths; the feeding and the masks of a launch run on the
masks thread while the step thread launches the forward."""

from __future__ import annotations

import torch

from kernels.token_bitmask import masked_logits
from proto.plan import RequestError
from stages.worker.guided import GuidedMasks, MaskJob
from stages.worker.sampler import Allowed, SampledTokens
from stages.worker.step_state import WorkerRequest


class StepMasks:
    """A launch's masks, started: `allowed` waits for them, copies them up and applies them."""

    def __init__(self, rows: list[int], job: MaskJob):
        """`rows`: the launch's sampled requests (indices into its `reqs`) whose masks the job computes."""
        self.rows, self.job = rows, job

    def allowed(self, logits: torch.Tensor, at: list[int]) -> Allowed:
        """The masked logits of the requests with a grammar: `at[k]` is sampled request k's logits row."""
        words, rows = self.job.upload([at[k] for k in self.rows])
        failed = {self.rows[j]: why for j, why in self.job.failed.items()}
        return Allowed(masked_logits(logits, rows, words), {k: j for j, k in enumerate(self.rows)}, failed)


def step_masks(
    guided: GuidedMasks, reqs: list[WorkerRequest], before: SampledTokens | None
) -> StepMasks | None:
    """The token masks of the requests `reqs` to sample, started before their forward is launched (None
    when none has a grammar). Each matcher is fed its request's outputs first: with overlapped
    scheduling the last may be the step before's token, still a placeholder here, which the masks
    thread waits for (the step thread does not: it goes on to launch the forward and to finish the step
    before) and reads; llguidance's pool then computes the masks while the forward runs, until
    `allowed`. A grammar that failed (now or before) allows nothing, and its request is named in
    `failed`."""
    rows = [k for k, r in enumerate(reqs) if r.request_id in guided]
    if not rows:
        return None
    asks = [reqs[k] for k in rows]
    known = (lambda: before.result()[0]) if before is not None else None
    feed = [(r.request_id, r.token_ids, r.prompt_len, len(r.token_ids)) for r in asks]
    return StepMasks(rows, guided.start([r.request_id for r in asks], feed=feed, known=known))


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
