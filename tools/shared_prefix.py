"""Multi-tenant prefix workloads (`tools.workload --shared-prefix N [--turns T]`): every adapter, and the
base model, has its own system prompt of N synthetic tokens, and each request is its adapter's system
prompt followed by a user suffix (--input-len tokens). With T turns, requests form chat sessions of T
turns: turn k resends the system prompt and the session's earlier user suffixes and replies (a reply is
synthetic, as long as that turn's --output-len draw), then its own suffix. Session s's turn k is request
k * sessions + s, so a session's turns arrive in order, spread over the run."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.workload import WorkloadRequest, WorkloadSpec


def system_prompt(adapter: str | None, n: int, seed: int) -> list[int]:
    """The N-token system prompt of `adapter` (None: the base model's), the same for every request."""
    from tools.workload import sub_seed, synth_prompt

    return synth_prompt(n, sub_seed(seed, "system", "" if adapter is None else adapter))


def shared_prefix_requests(
    spec: WorkloadSpec, arrivals: Sequence[float], adapters: Sequence[str | None], base_rng: random.Random
) -> list[WorkloadRequest]:
    """The requests of `spec` (shared_prefix > 0), at `arrivals`; session s uses adapters[s] (or the
    base model, a `base_rng` draw of base_share)."""
    from tools.workload import WorkloadRequest, _draw, sub_seed, synth_prompt

    n, turns, seed = spec.num_prompts, spec.turns, spec.seed
    sessions = math.ceil(n / turns)
    names = [
        None if base_rng.random() < spec.base_share or not spec.adapters else adapters[s]
        for s in range(sessions)
    ]
    systems = {name: system_prompt(name, spec.shared_prefix, seed) for name in dict.fromkeys(names)}
    history: list[list[int]] = [list(systems[name]) for name in names]
    out = []
    for i in range(n):
        s, turn = i % sessions, i // sessions
        rng = random.Random(sub_seed(seed, "turn", s, turn))
        user = synth_prompt(_draw(rng, spec.input_len), sub_seed(seed, "user", s, turn))
        max_tokens = _draw(rng, spec.output_len)
        prompt = history[s] + user
        # the next turn resends this one with a reply of the length this turn asked for
        history[s] = prompt + synth_prompt(max_tokens, sub_seed(seed, "reply", s, turn))
        req = WorkloadRequest(
            arrival=arrivals[i],
            adapter=names[s],
            max_tokens=max_tokens,
            prompt_ids=prompt,
            sampling=dict(spec.sampling),
        )
        req.check()
        out.append(req)
    return out
