"""Penalties, logit bias and min-p in the sampler, step after step, against a plain reference written
token by token over Python counts (float64): greedy tokens equal the reference's argmax of the adjusted
logits, batch-mates without adjustments keep their plain argmax and cost no state, and min-p never
yields a token less likely than min_p × the likeliest."""

from __future__ import annotations

import pytest
import torch

from proto.sampling import SamplingParams
from stages.worker.sampler import Sampler
from tests.sampling_reference import argmax as _argmax
from tests.sampling_reference import reference_adjust

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
VOCAB = 1_001


PARAMS = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, presence_penalty=-0.4),
    SamplingParams(logit_bias={5: 4.0, 17: -100.0, VOCAB + 3: 50.0}),  # an id past the vocabulary: ignored
    SamplingParams(),  # a batch-mate without adjustments
    SamplingParams(frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={9: 2.5}, top_k=1),
]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_equal_the_reference_step_after_step(device):
    g = torch.Generator().manual_seed(3)
    # a few tokens stand far above the rest in every step, so unadjusted decoding repeats them
    base = torch.randn(VOCAB, generator=g, dtype=torch.float64)
    base[[5, 9, 17, 40, 77]] = torch.tensor([6.0, 5.6, 6.3, 5.9, 4.0], dtype=torch.float64)
    # repetition changes the order only between tokens seen (prompt or output) and unseen ones
    prompts = [[40, 3, 3, 8], [1, 2], [17, 40, 9, 5], [5], [2], [7], [9, 9, 5]]
    sampler = Sampler(torch.device(device))
    ids = [f"r{i}" for i in range(len(PARAMS))]
    outputs: list[list[int]] = [[] for _ in PARAMS]
    expected: list[list[int]] = [[] for _ in PARAMS]
    plain: list[list[int]] = [[] for _ in PARAMS]  # the unadjusted argmax
    for _ in range(12):
        noise = torch.randn(len(PARAMS), VOCAB, generator=g, dtype=torch.float64) * 0.3
        step = base + noise  # [B, V]
        for i, p in enumerate(PARAMS):
            row = step[i].tolist()
            expected[i].append(_argmax(reference_adjust(row, prompts[i], expected[i], p)))
            plain[i].append(_argmax(row))
        tokens, failed = sampler.issue(
            step.float().to(device), ids, PARAMS, prompts=lambda k: prompts[k]
        ).result()
        assert failed == {}
        for i, t in enumerate(tokens):
            outputs[i].append(t)
    assert outputs == expected
    adjusted = [p.adjusts_logits for p in PARAMS]
    assert [out != ref for out, ref in zip(outputs, plain, strict=True)] == adjusted  # the premise
    assert set(sampler._adjusters) == {rid for rid, p in zip(ids, PARAMS, strict=True) if p.adjusts_logits}
    for rid in ids:
        sampler.forget(rid)
    assert not sampler._adjusters


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_without_adjustments_keeps_no_state(device):
    sampler = Sampler(torch.device(device))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=1), SamplingParams(min_p=0.2, seed=2)]
    tokens, _ = sampler.issue(logits, ["a", "b", "c"], params).result()
    assert tokens[0] == int(logits[0].argmax()) and not sampler._adjusters


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_never_yields_a_token_below_its_share_of_the_likeliest(device):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(1, VOCAB, generator=g) * 1.5).to(device)
    probs = torch.softmax(logits[0].double().cpu(), dim=-1)
    floor = 0.3 * float(probs.max())
    assert int((probs >= floor).sum()) >= 2  # the premise: more than the likeliest survives
    sampler = Sampler(torch.device(device))
    params = [SamplingParams(temperature=1.0, min_p=0.3, seed=11)]
    drawn = {sampler.issue(logits, ["r"], params).result()[0][0] for _ in range(200)}
    assert all(float(probs[t]) >= floor for t in drawn) and len(drawn) >= 2
    unfiltered = [SamplingParams(temperature=1.0, seed=11)]
    free = {Sampler(torch.device(device)).issue(logits, ["r"], unfiltered).result()[0][0] for _ in range(200)}
    assert any(float(probs[t]) < floor for t in free)  # premise: without min_p such tokens are drawn


def test_sampling_values_are_checked_by_name():
    for bad, name in [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={1: 101.0}), "logit_bias"),
        (SamplingParams(logit_bias=dict.fromkeys(range(2000), 1.0)), "logit_bias"),
    ]:
        with pytest.raises(ValueError, match=name):
            bad.validate()
