"""A request whose math goes wrong fails alone: its batch-mates keep exactly the tokens they get without
it (seeded sampling is per request), and very small temperatures sample greedily (vLLM's rule). Runs
the worker's executor and sampler through the offline engine on the tiny model."""

from __future__ import annotations

import dataclasses

import pytest

from proto.sampling import SamplingParams
from runtime.offline import LLM

PROMPTS = [[5, 17, 42, 99], [7, 3, 250, 11, 12], [1, 2, 3], [40, 41], [9, 8, 7, 6, 5], [100, 101, 102]]


@pytest.fixture(scope="module")
def llm(tiny_llama, llama_adapters) -> LLM:
    return LLM(tiny_llama, device="cpu", adapters=llama_adapters, max_lora_rank=16, max_loras_per_batch=4)


def _mates() -> tuple[list[list[int]], list[str | None], list[SamplingParams]]:
    adapters = [None, "full8", "qv5", None, "rs12", "mlp1"]
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, top_p=0.9, seed=i)
        for i in range(len(PROMPTS))
    ]
    return list(PROMPTS), adapters, params


def test_tiny_temperature_is_greedy_and_harms_nobody(llm: LLM):
    prompts, adapters, params = _mates()
    alone = llm.generate(prompts, adapters=adapters, sampling=params)
    tiny = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1e-300, seed=3)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = llm.generate([*prompts, [5, 6, 7]], adapters=[*adapters, "full8"], sampling=[*params, tiny])
    assert [o.token_ids for o in outs[:-1]] == [o.token_ids for o in alone]
    assert outs[-1].finish_reason == "length"
    assert outs[-1].token_ids == llm.generate([[5, 6, 7]], adapters="full8", sampling=greedy)[0].token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_adapter_with_absurd_scalings_fails_only_its_request(llm: LLM, temperature: float):
    """Bypass the load-time checks (as a bug or a corrupted block would): scalings of 1e30 make the
    adapter's logits overflow. Greedy or sampled, that request fails with a message; the rest do not."""
    good = llm.adapters["full8"]
    llm.adapters["absurd"] = dataclasses.replace(good, name="absurd", scalings=good.scalings * 1e30)
    try:
        prompts, adapters, params = _mates()
        alone = llm.generate(prompts, adapters=adapters, sampling=params)
        bad = SamplingParams(max_tokens=6, ignore_eos=True, temperature=temperature, seed=99)
        outs = llm.generate([*prompts, [5, 6, 7]], adapters=[*adapters, "absurd"], sampling=[*params, bad])
    finally:
        del llm.adapters["absurd"]
    assert [o.token_ids for o in outs[:-1]] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "length" for o in outs[:-1])
    assert outs[-1].finish_reason == "error" and "not finite" in (outs[-1].error or "")


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", -1e-9),
        ("top_p", 0.0),
        ("top_p", float("nan")),
        ("max_tokens", 2**64 + 1),
        ("max_tokens", 0),
        ("top_k", -1),
        ("seed", 2**63),
        ("stop_token_ids", (2**31,)),
    ],
)
def test_out_of_range_sampling_values_are_refused(field: str, value: object):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_greedy_threshold():
    assert SamplingParams(temperature=1e-6).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_a_failing_forward_runs_again_without_the_request_that_breaks_it(llm: LLM):
    """A plan naming a KV page the cache does not have makes the batch's forward raise. The executor
    runs the step again group by group: the good request gets exactly the token it gets alone."""
    from proto.base import TokenIds
    from proto.plan import BatchPlan, NewRequestData
    from stages.worker.executor import StepExecutor

    def new(rid: str, page: int) -> NewRequestData:
        return NewRequestData(
            request_id=rid,
            prompt_ids=TokenIds.of([5, 17, 42, 99]),
            sampling=SamplingParams(max_tokens=4),
            page_ids=[page],
            num_scheduled_tokens=4,
        )

    def executor() -> StepExecutor:
        return StepExecutor(llm.runner, lambda load: None, max_model_len=64)

    _, alone_tokens = executor().execute(BatchPlan(step=1, new_requests=[new("good", 0)]))
    ex = executor()
    result, tokens = ex.execute(
        BatchPlan(step=1, new_requests=[new("bad", llm.runner.num_pages + 7), new("good", 0)])
    )
    assert ex.retried_steps == 1
    assert [e.request_id for e in result.errors] == ["bad"] and "worker step failed" in result.errors[
        0
    ].message
    assert [(t.request_id, t.token_ids) for t in tokens.items] == [("good", alone_tokens.items[0].token_ids)]
    assert not ex.requests["bad"].active and ex.requests["good"].active
