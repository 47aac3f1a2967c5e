"""On a GPU: the fp8 GEMM (up to MAX_M tokens weight-only, `kernels/fp8_gemm.py`; more tokens with the
per-token activation quantization by the Triton kernel and `torch._scaled_mm` with row-wise scales)
against float64 products of the dequantized weights, eagerly and replayed in a CUDA graph; then the
offline engine on an fp8 checkpoint with adapters against transformers + PEFT on its dequantized copy,
greedy. Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import MAX_M
from kernels.fp8_quant import quantize_per_token, quantize_per_token_ref
from proto.sampling import SamplingParams
from runtime.offline import LLM
from runtime.synthetic.fp8 import write_dequantized, write_fp8
from runtime.synthetic.model import make_model
from stages.worker.model.linear import Fp8Weight, fp8_linear, quantize_weight
from tests.conftest import mixed_adapters, pool_gb
from tests.peft_reference import PeftReference
from tests.runtime.test_offline_vs_peft import PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _gemm_input(x: torch.Tensor) -> torch.Tensor:
    """What the fp8 GEMM multiplies, float64: x itself up to MAX_M tokens, else its per-token e4m3 codes
    times their scales."""
    if x.shape[0] <= MAX_M:
        return x.double()
    xq, xs = quantize_per_token_ref(x)
    return xq.double() * xs.double()


@pytest.mark.parametrize("m", [1, MAX_M, MAX_M + 1, 64, 300])
@pytest.mark.parametrize("n, k", [(128, 64), (6144, 4096), (4096, 14336)])
def test_fp8_gemm_matches_float64_of_dequantized_weights(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    x = torch.randn((m, k), generator=gen, device="cuda").bfloat16()
    x[0, :3] *= 40  # an outlier feature: its token's scale grows, others keep theirs
    w = (torch.randn((n, k), generator=gen, device="cuda") * 0.02).bfloat16()
    bias = torch.randn(n, generator=gen, device="cuda").bfloat16()
    w8 = quantize_weight(w)
    got = fp8_linear(x, w8, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    want = _gemm_input(x) @ w8.dequantize().t() + bias.double()
    assert _rel(got, want) < 6e-3  # bf16 rounding of the output, fp32 accumulation
    exact = x.double() @ w.double().t() + bias.double()
    assert _rel(got, exact) < 6e-2  # fp8 codes: 3 mantissa bits, per row and per token scales


def test_quant_kernel_matches_reference():
    x = torch.randn((77, 5000), device="cuda").bfloat16() * 3
    x[5] = 0
    q, s = quantize_per_token(x)
    qr, sr = quantize_per_token_ref(x)
    assert torch.allclose(s, sr, rtol=1e-6, atol=0)
    same = (q.float() == qr.float()).float().mean().item()
    assert same > 0.999, f"{same:.5f} of the codes agree"  # a rare tie of the division's last bit
    assert ((q.float() * s - qr.float() * sr).abs() <= 2**-3 * x.float().abs() + 1e-30).all()


@pytest.mark.parametrize("m", [16, MAX_M + 16])
def test_fp8_gemm_replays_in_a_cuda_graph(m):
    x = torch.randn((m, 4096), device="cuda").bfloat16()
    w8 = quantize_weight(torch.randn((1024, 4096), device="cuda").bfloat16() * 0.02)
    eager = fp8_linear(x, w8)
    fp8_linear(x, w8)  # compile the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w8)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, fp8_linear(x, w8)) and not torch.equal(out, eager)


def test_per_tensor_scales_run_as_rows():
    w = torch.randn((256, 512), device="cuda").bfloat16()
    one = quantize_weight(w)
    per_tensor = Fp8Weight(one.q, one.scale.max().expand(256).contiguous())
    x = torch.randn((8, 512), device="cuda").bfloat16()
    for rows in (x, x.repeat(MAX_M // 8 + 1, 1)):  # weight-only, and with the input quantized
        want = _gemm_input(rows) @ per_tensor.dequantize().t()
        assert _rel(fp8_linear(rows, per_tensor), want) < 6e-3


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    bf16 = make_model(root / "bf16", preset="tiny", dtype="bfloat16", seed=5)
    fp8 = write_fp8(bf16, root / "fp8", "compressed-tensors", "channel")
    deq = write_dequantized(fp8, root / "dequantized")
    return fp8, deq, mixed_adapters(bf16, root / "adapters")


def test_engine_on_fp8_checkpoint_agrees_with_peft_on_dequantized_copy(fp8_model, recorded_logits):
    fp8, deq, adapters = fp8_model
    names = list(adapters)
    mix = [names[i % len(names)] if i % 3 != 2 else None for i in range(len(PROMPTS))]
    llm = LLM(fp8, adapters=adapters, device="cuda", max_lora_rank=16, num_pages=512,
              lora_gpu_memory_gb=pool_gb(fp8, 4 * 16))  # fmt: skip
    assert type(llm.runner.model.w.layers[0].qkv) is Fp8Weight
    outs = llm.generate(PROMPTS, adapters=mix, sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    ref = PeftReference(deq, adapters, dtype=torch.float32)
    seen = [recorded_logits[r] for r in sorted(recorded_logits, key=lambda r: int(r[1:]))]
    agree = total = 0
    for out, name, steps in zip(outs, mix, seen, strict=True):
        want = ref.logits(out.prompt_token_ids + out.token_ids[:-1], name)[len(out.prompt_token_ids) - 1 :]
        for step, (got, exp) in enumerate(zip(steps, want, strict=True)):
            assert _rel(got, exp) < 0.1, f"adapter {name} step {step}"
            top2 = exp.topk(2).values
            if top2[0] - top2[1] > 0.5:  # a clear winner: activation quantization can't flip it
                assert int(got.argmax()) == int(exp.argmax()), f"adapter {name} step {step}"
            agree += int(got.argmax()) == int(exp.argmax())
            total += 1
    assert agree >= 0.9 * total, f"greedy tokens agree at {agree} of {total} steps"
