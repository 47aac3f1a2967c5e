"""On a GPU: the offline engine in bfloat16 with the Triton LoRA backend against transformers + PEFT
in bfloat16 on the same files (bf16 tolerance), and a whole mixed-adapter forward with no host-device
synchronisation. Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from proto.sampling import SamplingParams
from runtime.offline import LLM
from stages.worker.runner import SeqInput
from tests.conftest import pool_gb
from tests.peft_reference import PeftReference
from tests.runtime.test_offline_vs_peft import PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _bf16_triton_llm(model, adapters, slots: int, max_running_requests: int = 64) -> LLM:
    return LLM(
        model,
        adapters=adapters,
        device="cuda",
        dtype="bfloat16",
        max_lora_rank=16,
        lora_backend="triton",
        num_pages=512,
        lora_gpu_memory_gb=pool_gb(model, slots * 16),
        max_loras_per_batch=slots,
        max_running_requests=max_running_requests,
    )


def _load_all(runner, llm: LLM, names) -> None:
    """Every adapter under id = its index, in consecutive pool rows (16 per adapter at most)."""
    for slot, name in enumerate(names):
        runner.load_adapter(slot, llm.adapters[name], [(16 * slot, llm.adapters[name].rank)])


@pytest.mark.parametrize("max_running", [64, 3])
def test_bf16_triton_engine_matches_peft_bf16(tiny_llama, llama_adapters, recorded_logits, max_running):
    """With 3 running requests a prefill step of the prompts longer than 3 tokens (all but "The") has more
    tokens than sequences, so its gate_up delta is fused into the activation (kernels/lora_expand_act.py);
    a decode step never is."""
    seen = recorded_logits
    names = list(llama_adapters)
    mix = [names[i % len(names)] if i % 3 != 2 else None for i in range(len(PROMPTS))]
    llm = _bf16_triton_llm(tiny_llama, llama_adapters, slots=2, max_running_requests=max_running)
    outs = llm.generate(PROMPTS, adapters=mix, sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    ref = PeftReference(tiny_llama, llama_adapters, dtype=torch.bfloat16)
    ref.model.to("cuda")
    for out, name, steps in zip(
        outs, mix, [seen[r] for r in sorted(seen, key=lambda r: int(r[1:]))], strict=True
    ):
        full = out.prompt_token_ids + out.token_ids[:-1]
        with torch.no_grad():
            ids = torch.tensor([full], device="cuda")
            if name is None:
                with ref.model.disable_adapter():
                    want = ref.model(input_ids=ids).logits[0].float().cpu()
            else:
                ref.model.set_adapter(name)
                want = ref.model(input_ids=ids).logits[0].float().cpu()
        want = want[len(out.prompt_token_ids) - 1 :]
        for step, (got, exp) in enumerate(zip(steps, want, strict=True)):
            err = ((got - exp).norm() / exp.norm()).item()
            assert err < 3e-2, f"adapter {name} step {step}: relative error {err:.2e}"
            top2 = exp.topk(2).values
            if top2[0] - top2[1] > 0.1:  # a clear winner: bf16 noise can't flip it
                assert int(got.argmax()) == int(exp.argmax()), (
                    f"adapter {name} step {step}: greedy token differs"
                )


def test_mixed_forward_has_no_host_device_sync(tiny_llama, llama_adapters):
    llm = _bf16_triton_llm(tiny_llama, llama_adapters, slots=4)
    r = llm.runner
    _load_all(r, llm, llama_adapters)
    seqs = [SeqInput([5, 6, 7, 8, 9][: 1 + i % 5], 0, [i], i % 5 - 1) for i in range(12)]
    seqs.sort(key=lambda s: s.slot)
    fb, seg_indptr, seg_slots = r._build_batch(seqs)
    torch.cuda.synchronize()
    r.lora.prepare(seg_indptr, seg_slots)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            logits = r.model.forward(fb, r.kv, r.lora)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(logits).all()


def _fp32_engine(model, adapters, graphs: int) -> LLM:
    return LLM(
        model,
        adapters=adapters,
        device="cuda",
        dtype="float32",
        max_lora_rank=16,
        lora_backend="triton",
        num_pages=512,
        lora_gpu_memory_gb=pool_gb(model, 20),  # 26 rows of adapters through 20: loads between
        max_loras_per_batch=2,  # graphed steps
        cuda_graph_max_batch=graphs,
        # steps with prefill tokens stay eager: every one here carries adapter copies (which always run
        # eagerly); tests/stages/worker/test_step_graphs_gpu.py replays those steps' graphs
        cuda_graph_max_tokens=0,
    )


def test_cuda_graph_decode_equals_eager(tiny_llama, llama_adapters, recorded_logits):
    """Decode steps replayed as CUDA graphs (padded buckets, adapter mixes changing step to step) give the
    eager engine's float32 logits and greedy tokens."""
    names = list(llama_adapters)
    mix = [names[i % len(names)] if i % 3 != 2 else None for i in range(len(PROMPTS))]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for graphs in (0, 64):
        recorded_logits.clear()
        llm = _fp32_engine(tiny_llama, llama_adapters, graphs)
        outs = llm.generate(PROMPTS, adapters=mix, sampling=sampling)
        g, steps = llm.runner.graphs, llm.runner.step_graphs
        if graphs:
            assert g is not None and g.replays > 0, "no decode step replayed a graph"
            assert steps is None, "steps with prefill tokens were graphed though not asked for"
        else:
            assert g is None and steps is None
        runs[graphs] = ([o.token_ids for o in outs], {k: list(v) for k, v in recorded_logits.items()})
    (eager_tokens, eager_logits), (graph_tokens, graph_logits) = runs[0], runs[64]
    assert graph_tokens == eager_tokens
    assert graph_logits.keys() == eager_logits.keys()
    for rid, rows in graph_logits.items():
        for step, (got, want) in enumerate(zip(rows, eager_logits[rid], strict=True)):
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-4, f"request {rid} step {step}: relative error {err:.2e}"


def test_graphed_decode_step_has_no_host_device_sync(tiny_llama, llama_adapters):
    llm = _bf16_triton_llm(tiny_llama, llama_adapters, slots=4)
    r = llm.runner
    _load_all(r, llm, llama_adapters)
    seqs = [SeqInput([5], 3 + i, [i], i % 5 - 1) for i in range(11)]  # bucket 16, every slot and none
    r.execute(seqs)
    replays = r.graphs.replays
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = r.execute(seqs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert r.graphs.replays == replays + 1
    assert torch.isfinite(logits).all()
