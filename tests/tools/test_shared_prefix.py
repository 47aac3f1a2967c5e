"""`tools.workload --shared-prefix N --turns T`: every prompt starts with its adapter's own N-token system
prompt, adapters (and the base model) never share one, each later turn of a session resends the earlier
turn whole, and the same spec gives the same file."""

from __future__ import annotations

import pytest

from tools.shared_prefix import system_prompt
from tools.workload import WorkloadSpec, dumps, generate_workload


def _spec(**kw) -> WorkloadSpec:
    base = dict(num_prompts=30, adapters=("x", "y", "z"), distribution="zipf:1.0", base_share=0.2,
                input_len=(3, 9), output_len=(2, 5), shared_prefix=16, seed=4)  # fmt: skip
    return WorkloadSpec(**{**base, **kw})


def test_each_prompt_starts_with_its_own_adapters_system_prompt():
    reqs = generate_workload(_spec())
    systems = {a: system_prompt(a, 16, 4) for a in ("x", "y", "z", None)}
    assert len({tuple(s) for s in systems.values()}) == 4
    assert {r.adapter for r in reqs} >= {"x", None}
    for r in reqs:
        assert r.prompt_ids[:16] == systems[r.adapter] and 3 <= len(r.prompt_ids) - 16 <= 9
    assert dumps(reqs) == dumps(generate_workload(_spec()))
    assert dumps(reqs) != dumps(generate_workload(_spec(seed=5)))


def test_turns_resend_the_session_history():
    reqs = generate_workload(_spec(turns=3))
    sessions = 10
    for i in range(sessions, len(reqs)):
        prev, cur = reqs[i - sessions], reqs[i]
        assert cur.adapter == prev.adapter
        # the earlier turn's prompt, its reply (as long as it asked for), then a new user suffix
        assert cur.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids
        assert 3 <= len(cur.prompt_ids) - len(prev.prompt_ids) - prev.max_tokens <= 9


def test_turns_need_a_shared_prefix():
    with pytest.raises(ValueError, match="--shared-prefix"):
        generate_workload(_spec(shared_prefix=0, turns=2))
