"""The fused pointwise kernels (RMSNorm with and without the residual add, rotary + K/V write, SiLU-mul)
against float64 torch computations: widths that are no power of two, rows with a gap between them, one
and zero rows, head dims whose half is no power of two, GQA, NaN-filled caches whose untouched rows must
stay NaN; then a tiny model's logits with the kernels on against the torch ops."""

from __future__ import annotations

import pytest
import torch

from kernels.rms_norm import add_rms_norm, rms_norm
from kernels.rotary import rope_kv_write
from kernels.silu_mul import silu_mul
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput
from tests.kernels.conftest import TOL, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5


def rows_with_gap(gen, n: int, width: int, dtype, device, scale: float = 1.0) -> torch.Tensor:
    """[n, width] whose rows are `width + 3` elements apart (a column slice of a wider tensor)."""
    wide = torch.randn((n, width + 3), generator=gen, dtype=torch.float64) * scale
    return wide.to(dtype).to(device)[:, 1 : width + 1]


def norm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(7, 40), (1, 37), (0, 16), (5, 2048), (3, 300)])
def test_rms_norm(device, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = rows_with_gap(gen, rows, width, dtype, device, scale=3.0)
    w = (torch.rand(width, generator=gen, dtype=torch.float64) + 0.5).to(dtype).to(device)
    before = x.clone()
    got = rms_norm(x, w, EPS)
    assert got.shape == (rows, width) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(x, before)
    if rows:
        assert rel_err(got.cpu(), norm_ref(x.cpu(), w.cpu())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(6, 40), (1, 2048), (0, 8), (4, 513)])
def test_add_rms_norm(device, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * 7 + width)
    h = rows_with_gap(gen, rows, width, dtype, device, scale=2.0)
    d = torch.randn((rows, width), generator=gen, dtype=torch.float64).to(dtype).to(device)
    w = (torch.rand(width, generator=gen, dtype=torch.float64) + 0.5).to(dtype).to(device)
    h0, d0 = h.clone(), d.clone()
    total, normed = add_rms_norm(h, d, w, EPS)
    assert torch.equal(h, h0) and torch.equal(d, d0)  # inputs are not written
    assert total.shape == normed.shape == (rows, width)
    if rows:
        want_total = h.cpu().double() + d.cpu().double()
        # one rounding to the dtype (the interpreter truncates where the GPU rounds to nearest)
        assert rel_err(total.cpu(), want_total) < TOL[dtype] / 2
        assert rel_err(normed.cpu(), norm_ref(want_total, w.cpu())) < TOL[dtype]


def test_norm_rejects_bad_operands(device):
    x = torch.randn((3, 8), device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(9, device=device), EPS)
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm(x.t(), torch.ones(3, device=device), EPS)
    with pytest.raises(ValueError, match="addend"):
        add_rms_norm(x, torch.randn((2, 8), device=device), torch.ones(8, device=device), EPS)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D], float64."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, tokens",
    [(4, 2, 64, 9), (3, 3, 6, 5), (8, 1, 80, 4), (2, 2, 16, 1), (4, 2, 8, 0)],
)
def test_rope_kv_write(device, dtype, heads, kv_heads, head_dim, tokens):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim + tokens)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = rows_with_gap(gen, tokens, width, dtype, device)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(positions.double(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    num_rows = 3 * tokens + 5
    rows = torch.randperm(num_rows, generator=gen)[:tokens]
    k_cache = torch.full((num_rows, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    q = rope_kv_write(
        qkv,
        cos.to(device)[:, None],
        sin.to(device)[:, None],
        rows.to(device),
        k_cache,
        v_cache,
        heads,
        kv_heads,
    )
    assert q.shape == (tokens, heads, head_dim) and q.is_contiguous()
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[rows] = False
    assert torch.isnan(k_cache.cpu()[untouched]).all() and torch.isnan(v_cache.cpu()[untouched]).all()
    if not tokens:
        return
    x = qkv.cpu().double()
    q_ref = rotate_ref(x[:, : heads * head_dim].view(tokens, heads, head_dim), cos.double(), sin.double())
    k_in = x[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    k_ref = rotate_ref(k_in, cos.double(), sin.double())
    v_in = qkv.cpu()[:, (heads + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim)
    assert rel_err(q.cpu(), q_ref) < TOL[dtype]
    assert rel_err(k_cache.cpu()[rows], k_ref) < TOL[dtype]
    assert torch.equal(v_cache.cpu()[rows], v_in)


def test_rope_rejects_bad_operands(device):
    cache = torch.zeros((4, 2, 8), device=device)
    cos = torch.ones((3, 1, 8), device=device)
    rows = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="qkv"):
        rope_kv_write(torch.zeros((3, 40), device=device), cos, cos, rows, cache, cache, 4, 2)
    with pytest.raises(ValueError, match="even head dim"):
        odd = torch.zeros((4, 2, 7), device=device)
        rope_kv_write(torch.zeros((3, 56), device=device), cos, cos, rows, odd, odd, 4, 2)
    with pytest.raises(ValueError, match="k_cache"):
        rope_kv_write(torch.zeros((3, 64), device=device), cos, cos, rows, cache[:, :1], cache, 4, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(5, 37), (2, 1100), (1, 8), (0, 4)])
def test_silu_mul(device, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = rows_with_gap(gen, rows, 2 * inter, dtype, device, scale=3.0)
    got = silu_mul(gate_up)
    assert got.shape == (rows, inter) and got.dtype == dtype
    if rows:
        x = gate_up.cpu().double()
        ref = torch.nn.functional.silu(x[:, :inter]) * x[:, inter:]
        assert rel_err(got.cpu(), ref) < TOL[dtype]
    with pytest.raises(ValueError, match="silu_mul"):
        silu_mul(torch.zeros((2, 3), device=device))


def runner_steps(model_dir, device, backend: str) -> list[torch.Tensor]:
    cfg = RunnerConfig(
        model_dir=str(model_dir), device=str(device), page_size=4, num_pages=32, pointwise_backend=backend
    )
    runner = ModelRunner(cfg)
    assert runner.model.pointwise_backend == backend
    pages = torch.randperm(32, generator=torch.Generator().manual_seed(3)).tolist()
    a, b, c = pages[:6], pages[6:12], pages[12:18]
    tok = lambda n, s: [(5 * i + s) % 50 + 2 for i in range(n)]
    steps = [
        [SeqInput(tok(11, 1), 0, a, -1), SeqInput(tok(5, 2), 0, b, -1)],
        [SeqInput(tok(1, 3), 11, a, -1), SeqInput(tok(9, 4), 5, b, -1), SeqInput(tok(3, 5), 0, c, -1)],
        [SeqInput(tok(1, 6), 12, a, -1), SeqInput(tok(1, 7), 14, b, -1), SeqInput(tok(1, 8), 3, c, -1)],
    ]
    return [runner.execute(s).cpu() for s in steps]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_mistral"])
def test_model_logits_fused_vs_torch(model, request, device):
    """The forward with the fused kernels (the interpreter on the CPU) against the torch ops, fp32, over
    prefill, chunked prefill and decode steps that read the K/V the kernels wrote."""
    model_dir = request.getfixturevalue(model)
    got = runner_steps(model_dir, device, "triton")
    ref = runner_steps(model_dir, device, "torch")
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) < 1e-4
