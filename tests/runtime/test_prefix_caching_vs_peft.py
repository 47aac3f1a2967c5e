"""Prefix caching on the offline engine against transformers + PEFT: requests of several adapters and of
the base model share token prefixes (the same tokens under different adapters too); with the cache their
logits equal PEFT's run of each request alone and their greedy tokens equal those without it. The same
checks fail when the cache key leaves out the adapter or its load generation, or when a cached page's
KV is poisoned; shared pages are never written; eviction under KV pressure loses no request."""

from __future__ import annotations

import pytest
import torch

import stages.scheduler.planner as planner_module
from proto.sampling import SamplingParams
from runtime.offline import LLM
from stages.scheduler.prefix_cache import adapter_key, page_hashes
from tests.peft_reference import PeftReference

PAGE = 4
TOL = 1e-4
PREFIX = [37, 5, 92, 14, 250, 61, 8, 77, 130, 19, 44, 3, 201, 66]  # 3 full pages and 2 tokens
SAMPLING = SamplingParams(max_tokens=4, ignore_eos=True)


def _batch(names: list[str]) -> tuple[list[list[int]], list[str | None]]:
    """Prompts sharing PREFIX under every adapter and the base model, some identical across adapters,
    one ending exactly on a page boundary (its last page is recomputed, never written shared)."""
    a, b = names[0], names[1]
    prompts = [
        PREFIX + [7, 8, 9],
        PREFIX + [7, 8, 9],
        PREFIX + [7, 8, 9],
        PREFIX + [7, 8, 9, 10, 12, 99],
        PREFIX[:8],
        PREFIX + [11, 3],
        PREFIX[:12] + [5, 5, 5, 5, 5],
    ]
    return prompts, [a, b, None, a, b, None, names[2]]


def _llm(model_dir, adapters, **kw) -> LLM:
    base = dict(device="cpu", max_lora_rank=16, lora_backend="torch", page_size=PAGE, num_pages=64)
    return LLM(model_dir, adapters=adapters, **{**base, **kw})


def _run(llm: LLM, recorded, prompts, names):
    """Outputs and each request's recorded logits rows [steps, V] (request ids follow the engine's)."""
    recorded.clear()
    outs = llm.generate(prompts, adapters=names, sampling=SAMPLING)
    rids = sorted(recorded, key=lambda rid: int(rid[1:]))
    assert len(rids) == len(prompts)
    return outs, [torch.stack(recorded[rid]) for rid in rids]


def _errors(ref: PeftReference, outs, logits, names) -> list[float]:
    """Each request's worst relative logits error against PEFT, over its prefill and decode steps."""
    worst = []
    for out, got, name in zip(outs, logits, names, strict=True):
        full = out.prompt_token_ids + out.token_ids[:-1]
        want = ref.logits(full, name)[len(out.prompt_token_ids) - 1 :]
        worst.append(max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True)))
    return worst


@pytest.fixture(scope="module")
def peft_ref(tiny_llama, llama_adapters):
    return PeftReference(tiny_llama, llama_adapters)


def test_cached_outputs_equal_uncached_and_peft(tiny_llama, llama_adapters, recorded_logits, peft_ref):
    names = list(llama_adapters)
    prompts, mix = _batch(names)
    plain = _llm(tiny_llama, llama_adapters, prefix_caching=False)
    base_outs, _ = _run(plain, recorded_logits, prompts, mix)
    assert plain.kv_pages.stats.hits == 0
    # a small token budget admits the requests over several steps, so later ones hit earlier ones' pages
    llm = _llm(tiny_llama, llama_adapters, max_tokens_per_step=24, max_running_requests=4)
    first, first_logits = _run(llm, recorded_logits, prompts, mix)
    within = llm.kv_pages.stats.hits
    second, second_logits = _run(llm, recorded_logits, prompts, mix)  # every prefix is cached by now
    assert within > 0, "no request of one call reused another's pages"
    assert llm.kv_pages.stats.hits - within >= len(prompts) * PAGE, "the second call hit too little"
    for outs, logits in ((first, first_logits), (second, second_logits)):
        assert [o.token_ids for o in outs] == [o.token_ids for o in base_outs]
        errs = _errors(peft_ref, outs, logits, mix)
        assert max(errs) < TOL, f"relative errors against PEFT: {errs}"


def test_a_key_without_the_adapter_is_caught(
    tiny_llama, llama_adapters, recorded_logits, peft_ref, monkeypatch
):
    """The checks above can fail: with the adapter left out of the key, requests of one adapter read
    another's KV, and their logits leave PEFT's."""
    monkeypatch.setattr(planner_module, "adapter_key", lambda adapter, generation: b"shared")
    names = list(llama_adapters)
    prompts, mix = _batch(names)
    llm = _llm(tiny_llama, llama_adapters)
    _run(llm, recorded_logits, prompts[:1], mix[:1])  # adapter a's pages of PREFIX + [7, 8, 9]
    outs, logits = _run(llm, recorded_logits, prompts[1:3], mix[1:3])  # adapter b and base: same tokens
    assert min(_errors(peft_ref, outs, logits, mix[1:3])) > 10 * TOL


def _cached_rows(llm: LLM, prompt: list[int], adapter: str | None, generation: int = 1) -> torch.Tensor:
    """Flat KV rows of the cached pages of `prompt`'s prefix under `adapter`."""
    gen = generation if adapter is not None else 0
    pages = llm.kv_pages.lookup(page_hashes(adapter_key(adapter, gen), prompt, PAGE))
    assert pages, "nothing cached"
    return torch.tensor([p * PAGE + o for p in pages for o in range(PAGE)])


def test_shared_pages_are_never_written_and_are_read(tiny_llama, llama_adapters, recorded_logits, peft_ref):
    names = list(llama_adapters)
    prompts, mix = _batch(names)
    llm = _llm(tiny_llama, llama_adapters)
    _run(llm, recorded_logits, [PREFIX + [7, 8, 9]], [names[0]])
    rows = _cached_rows(llm, PREFIX, names[0])
    kv = llm.runner.kv
    k0, v0 = kv.k[:, rows].clone(), kv.v[:, rows].clone()
    # three running requests share those pages, through prefill chunks and decodes
    sharers = [PREFIX + [7, 8, 9], PREFIX + [7, 8, 9, 10, 12, 99], PREFIX + [40]]
    outs, logits = _run(llm, recorded_logits, sharers, [names[0]] * 3)
    assert torch.equal(kv.k[:, rows], k0) and torch.equal(kv.v[:, rows], v0), "a shared page was written"
    assert max(_errors(peft_ref, outs, logits, [names[0]] * 3)) < TOL
    # and what they read is those pages: poisoned, the same requests leave PEFT's logits
    kv.k[:, rows] = torch.randn_like(k0) * 10
    outs, logits = _run(llm, recorded_logits, sharers, [names[0]] * 3)
    assert min(_errors(peft_ref, outs, logits, [names[0]] * 3)) > 10 * TOL


@pytest.mark.parametrize("keyed_by_generation", [True, False])
def test_reloading_an_adapter_invalidates_its_pages(
    tiny_llama, llama_adapters, recorded_logits, peft_ref, monkeypatch, keyed_by_generation
):
    names = list(llama_adapters)
    a, b = names[0], names[1]
    if not keyed_by_generation:  # the check below must catch a key that leaves the generation out
        monkeypatch.setattr(
            planner_module, "adapter_key", lambda adapter, generation: adapter_key(adapter, 1)
        )
    llm = _llm(tiny_llama, {a: llama_adapters[a]})
    prompt = PREFIX + [7, 8, 9]
    _run(llm, recorded_logits, [prompt], [a])
    # the key alone must tell the weights apart: the replacement's drop of the old pages is disabled
    monkeypatch.setattr(llm.kv_pages, "drop_adapter", lambda name: 0)
    llm.add_adapter(a, llama_adapters[b])  # the same name, now with b's weights
    outs, logits = _run(llm, recorded_logits, [prompt], [a])
    (err,) = _errors(peft_ref, outs, logits, [b])
    assert (err < TOL) == keyed_by_generation, f"relative error against the new weights: {err:.2e}"


def test_eviction_under_pressure_loses_no_request(tiny_llama, llama_adapters, recorded_logits, peft_ref):
    names = list(llama_adapters)
    # 16 pages of 4 tokens for 10 distinct 18-token prompts (+ 4 outputs): cached pages are evicted
    # for room, and requests are preempted, yet each one finishes with PEFT's logits
    prompts = [[(7 * i + j) % 300 + 2 for j in range(18)] for i in range(10)]
    mix = [names[i % 3] if i % 4 else None for i in range(10)]
    llm = _llm(tiny_llama, llama_adapters, num_pages=16, max_model_len=64, max_running_requests=3)
    _run(llm, recorded_logits, prompts, mix)
    outs, logits = _run(llm, recorded_logits, prompts, mix)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in outs)
    assert llm.kv_pages.stats.evictions > 0, "no cached page was evicted"
    assert max(_errors(peft_ref, outs, logits, mix)) < TOL
    assert llm.kv_pages.num_free == llm.kv_pages.num_pages, "pages still referenced after the calls"
