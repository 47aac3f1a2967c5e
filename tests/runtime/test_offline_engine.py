"""Offline engine behaviour beyond logit parity: Mistral's sliding window, dtypes, sampling options,
stop conditions, sharded checkpoints and input validation."""

from __future__ import annotations

import pytest
import torch

from proto.sampling import SamplingParams
from runtime.offline import LLM
from runtime.synthetic.model import make_model
from stages.worker.runner import SeqInput
from tests.peft_reference import PeftReference

LONG = "The engine hummed while the train crossed the long bridge over the valley at dawn and dusk"


def _greedy_ref(ref: PeftReference, prompt_ids: list[int], n: int, adapter=None) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(ref.logits(ids, adapter)[-1].argmax()))
    return ids[len(prompt_ids) :]


def test_mistral_sliding_window_matches_transformers(tiny_mistral, tmp_path):
    from runtime.synthetic.adapters import make_adapters

    (ad,) = make_adapters(tiny_mistral, tmp_path, n=1, ranks=(4,), seed=7)
    llm = LLM(tiny_mistral, device="cpu", adapters={"a": ad}, max_lora_rank=8, page_size=4)
    prompt = llm.tokenizer.encode(LONG).ids
    assert len(prompt) > 3 * 8  # well past the window of 8
    outs = llm.generate(
        [prompt, prompt], adapters=["a", None], sampling=SamplingParams(max_tokens=5, ignore_eos=True)
    )
    ref = PeftReference(tiny_mistral, {"a": ad})
    assert outs[0].token_ids == _greedy_ref(ref, prompt, 5, "a")
    assert outs[1].token_ids == _greedy_ref(ref, prompt, 5, None)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_close_to_float32(tiny_llama, llama_adapters, dtype):
    ids = [[5, 17, 42, 99, 7, 3, 250]]
    params = SamplingParams(max_tokens=1)
    ref = LLM(tiny_llama, device="cpu", adapters=llama_adapters, max_lora_rank=16)
    half = LLM(tiny_llama, device="cpu", adapters=llama_adapters, max_lora_rank=16, dtype=dtype)
    assert half.runner.model.w.embed.dtype == getattr(torch, dtype)
    for name in [None, *llama_adapters]:
        a = ref.runner  # same prompt through both engines' runners, compare last-token logits
        b = half.runner
        seq = [SeqInput(ids[0], 0, list(range(1)), -1 if name is None else 0)]
        if name is not None:
            a.load_adapter(0, ref.adapters[name], [(0, ref.adapters[name].rank)])
            b.load_adapter(0, half.adapters[name], [(0, half.adapters[name].rank)])
        la, lb = a.execute(seq)[0], b.execute(seq)[0]
        assert ((la - lb).norm() / la.norm()).item() < 3e-2
    assert half.generate(ids, sampling=params)[0].finish_reason == "length"


def test_sharded_checkpoint_gives_identical_outputs(tmp_path):
    one = make_model(tmp_path / "one", preset="tiny", seed=11)
    sharded = make_model(tmp_path / "sharded", preset="tiny", seed=11, shard_size_mb=0.1)
    assert (sharded / "model.safetensors.index.json").exists()
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    a = LLM(one, device="cpu").generate(["Once upon a time"], sampling=p)[0]
    b = LLM(sharded, device="cpu").generate(["Once upon a time"], sampling=p)[0]
    assert a.token_ids == b.token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama, llama_adapters):
    llm = LLM(tiny_llama, device="cpu", adapters=llama_adapters, max_lora_rank=16)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(["A quiet morning"], adapters="full8", sampling=seeded)[0]
    other = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, ignore_eos=True)
    mixed = llm.generate(
        ["Stories begin", "A quiet morning", "The river"],
        adapters=["qv5", "full8", None],
        sampling=[other, seeded, other],
    )[1]
    assert alone.token_ids == mixed.token_ids
    different = llm.generate(
        ["A quiet morning"],
        adapters="full8",
        sampling=SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True),
    )[0]
    assert different.token_ids != alone.token_ids


def test_top_k_and_top_p_restrict_the_support(tiny_llama):
    llm = LLM(tiny_llama, device="cpu")
    prompt = [5, 17, 42, 99]
    logits = llm.runner.execute([SeqInput(prompt, 0, [0], -1)])[0]
    top3 = set(logits.topk(3).indices.tolist())
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[: int((sorted_p.cumsum(0) < 0.5).sum()) + 1].tolist())
    outs = llm.generate(
        [prompt] * 40,
        sampling=[SamplingParams(max_tokens=1, temperature=2.0, top_k=3, seed=s) for s in range(20)]
        + [SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5, seed=s) for s in range(20)],
    )
    k_tokens = {o.token_ids[0] for o in outs[:20]}
    p_tokens = {o.token_ids[0] for o in outs[20:]}
    assert k_tokens <= top3 and len(k_tokens) > 1
    assert p_tokens <= nucleus


def test_greedy_equals_top_k_1_and_temperature_0(tiny_llama):
    llm = LLM(tiny_llama, device="cpu")
    a = llm.generate(["The river"], sampling=SamplingParams(max_tokens=8, ignore_eos=True))[0]
    b = llm.generate(
        ["The river"], sampling=SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True)
    )[0]
    assert a.token_ids == b.token_ids


def test_stop_tokens_eos_and_max_tokens(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, device="cpu")
    free = llm.generate(["The river"], sampling=SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate(
        ["The river"], sampling=SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(stop_at,))
    )[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    # EOS: the same weights (same seed) with the model's own second token declared as EOS.
    same = make_model(tmp_path / "eos", preset="tiny", seed=1, overrides={"eos_token_id": free.token_ids[1]})
    ended = LLM(same, device="cpu").generate(["The river"], sampling=SamplingParams(max_tokens=10))[0]
    assert ended.finish_reason == "stop" and ended.token_ids == free.token_ids[:2]
    ignored = LLM(same, device="cpu").generate(
        ["The river"], sampling=SamplingParams(max_tokens=10, ignore_eos=True)
    )[0]
    assert ignored.token_ids == free.token_ids


def test_max_model_len_stops_with_length(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", max_model_len=12)
    out = llm.generate([[3, 4, 5, 6, 7, 8, 9, 10]], sampling=SamplingParams(max_tokens=100, ignore_eos=True))[
        0
    ]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 12


def test_bad_inputs_raise_clear_errors(tiny_llama, llama_adapters):
    llm = LLM(tiny_llama, device="cpu", adapters=llama_adapters, max_lora_rank=16)
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        llm.generate(["hi"], adapters="nope")
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi"], sampling=SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["hi"], sampling=SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10**6]])
    with pytest.raises(ValueError, match="limit is"):
        llm.generate([[1] * 600])
    with pytest.raises(ValueError, match="2 prompts but 3 adapters"):
        llm.generate(["a", "b"], adapters=[None, None, None])
    assert llm.generate(["still works"], sampling=SamplingParams(max_tokens=2))[0].finish_reason
