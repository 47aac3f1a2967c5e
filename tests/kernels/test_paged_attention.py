"""paged_attention against a float64 computation: mixed chunked-prefill and decode batches, ragged contexts
on shuffled pages (every row no sequence owns is NaN), GQA 1/2/4, sliding window, key splits; and a tiny
model's logits with the kernel forced on against the torch path."""

from __future__ import annotations

import pytest
import torch

from kernels import device_info
from kernels.paged_attention import (
    AttentionConfig,
    choose_splits,
    paged_attention,
    paged_attention_ref,
    plan_attention,
    split_key_counts,
)
from stages.worker.model import attention
from stages.worker.model.forward_batch import ForwardBatch, SeqExtent
from stages.worker.model.kv_cache import KVCache
from stages.worker.runner import ModelRunner, RunnerConfig, SeqInput
from tests.kernels.conftest import TOL, rel_err

# (q_len, ctx_len): a chunk of a longer prompt, decodes, a first decode, whole prompts, a long decode.
MIXED = [(5, 23), (1, 17), (1, 1), (12, 12), (1, 40), (3, 3), (7, 30)]
TIGHT = {torch.float32: 1e-5, torch.bfloat16: TOL[torch.bfloat16], torch.float16: TOL[torch.float16]}


def make_case(gen, extents, *, num_kv_heads, group, head_dim, page_size, dtype, device):
    """q [T + 2, H, D] (2 tokens in no sequence), caches on a shuffled page order with NaN in every row no
    sequence owns, page_table [B, P] padded with 0, and the (q_start, q_len, ctx_len) extents."""
    num_heads = num_kv_heads * group
    need = [(c + page_size - 1) // page_size for _, c in extents]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()
    k = torch.full((num_pages * page_size, num_kv_heads, head_dim), float("nan"))  # [rows, KVH, D]
    v = torch.full_like(k, float("nan"))
    table = torch.zeros((len(extents), max(need) + 1), dtype=torch.int64)  # [B, P]
    seqs, rows, t = [], [], 0
    for b, ((q_len, ctx_len), n) in enumerate(zip(extents, need, strict=True)):
        pages, perm = perm[:n], perm[n:]
        table[b, :n] = torch.tensor(pages)
        rows.append([pages[p // page_size] * page_size + p % page_size for p in range(ctx_len)])
        seqs.append((t, q_len, ctx_len))
        t += q_len
    for r in rows:
        k[r] = torch.randn((len(r), num_kv_heads, head_dim), generator=gen)
        v[r] = torch.randn((len(r), num_kv_heads, head_dim), generator=gen)
    q = torch.randn((t + 2, num_heads, head_dim), generator=gen)  # [T, H, D]
    cast = lambda x: x.to(dtype).to(device)
    return cast(q), cast(k), cast(v), table.to(device), seqs, rows


def expected(q, k, v, seqs, rows, scale, window):
    """float64 [T, H * D]: softmax over each token's visible keys, gathered by row lists (not the table)."""
    q, k, v = q.cpu().double(), k.cpu().double(), v.cpu().double()
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=torch.float64)
    for (q_start, q_len, ctx_len), r in zip(seqs, rows, strict=True):
        kk = k[r].repeat_interleave(group, 1)  # [ctx, H, D]
        vv = v[r].repeat_interleave(group, 1)
        for i in range(q_len):
            pos = ctx_len - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            s = torch.einsum("hd,chd->hc", q[q_start + i], kk[lo : pos + 1]) * scale
            out[q_start + i] = torch.einsum("hc,chd->hd", s.softmax(-1), vv[lo : pos + 1])
    return out.reshape(num_tokens, num_heads * head_dim)


def run_case(device, *, dtype, group, head_dim, window, extents=MIXED, page_size=4, seed=0, **plan_kw):
    gen = torch.Generator().manual_seed(seed)
    config = plan_kw.pop("config", None)
    q, k, v, table, seqs, rows = make_case(
        gen, extents, num_kv_heads=2, group=group, head_dim=head_dim, page_size=page_size, dtype=dtype,
        device=device,
    )  # fmt: skip
    plan = plan_attention(
        *zip(*seqs, strict=True), num_heads=q.shape[1], num_kv_heads=2, device=device, **plan_kw
    )
    scale = head_dim**-0.5
    out = torch.full((q.shape[0], q.shape[1] * head_dim), float("nan"), dtype=dtype, device=device)
    paged_attention(
        q, k, v, table, plan, page_size=page_size, scale=scale, sliding_window=window, out=out, config=config
    )
    out = out.cpu()
    assert torch.isnan(out[-2:]).all(), "rows of tokens in no sequence were written"
    assert torch.isfinite(out[:-2]).all(), "an output element is missing or NaN"
    ref = expected(q, k, v, seqs, rows, scale, window)
    err = rel_err(out[:-2], ref[:-2])
    assert err < TIGHT[dtype], err
    plain = paged_attention_ref(q, k, v, table, seqs, page_size=page_size, scale=scale, sliding_window=window)
    assert rel_err(plain.cpu()[:-2], ref[:-2]) < TIGHT[dtype]
    return plan


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_fp32_mixed_batch(device, group, window):
    plan = run_case(device, dtype=torch.float32, group=group, head_dim=16, window=window, seed=group)
    assert plan.num_splits == 1


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("group", [1, 4])
def test_bf16_head_dim_64(device, group, window):
    run_case(device, dtype=torch.bfloat16, group=group, head_dim=64, window=window, page_size=16, seed=7)


def test_fp16_small_blocks(device):
    # block_m 16 splits the 12-token prompt (48 rows at group 4) over three programs.
    run_case(device, dtype=torch.float16, group=4, head_dim=32, window=None, block_m=16, seed=3)


@pytest.mark.parametrize("window", [None, 33])
def test_key_splits(device, window):
    """Flash-decoding: 4 programs share each block's keys (16 per step), merged by the second kernel;
    with the window some splits of the prefill blocks see no key at all."""
    extents = [(1, 100), (6, 70), (1, 2), (2, 45)]
    cfg = AttentionConfig(block_n=16, num_warps=4, num_stages=1)
    plan = run_case(
        device, dtype=torch.float32, group=2, head_dim=16, window=window, extents=extents, num_splits=4,
        config=cfg, seed=11,
    )  # fmt: skip
    assert plan.num_splits == 4


def test_plan_heuristics(monkeypatch):
    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)  # H100
    decode = plan_attention([0], [1], [4096], num_heads=32, num_kv_heads=8, device="cpu")
    assert decode.block_m == 16 and decode.num_splits > 1  # one long decode: keys split over programs
    many = plan_attention(range(64), [1] * 64, [512] * 64, num_heads=32, num_kv_heads=8, device="cpu")
    assert many.num_splits == 1 and many.meta.shape[0] == 64
    prefill = plan_attention([0, 2048], [2048, 1], [2048, 9], num_heads=32, num_kv_heads=8, device="cpu")
    assert prefill.block_m == 64 and prefill.meta.shape[0] == 2048 * 4 // 64 + 1
    assert prefill.meta[0, 4] == 2048 * 4 - 64  # the prefill's last (heaviest) block runs first
    with pytest.raises(ValueError, match="q_len <= ctx_len"):
        plan_attention([0], [5], [4], num_heads=4, num_kv_heads=2, device="cpu")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        plan_attention([0], [1], [4], num_heads=6, num_kv_heads=4, device="cpu")


@pytest.mark.parametrize("max_keys", [96, 512, 513, 2048, 2049, 32768])
def test_split_key_counts_reach_every_split_choice(monkeypatch, max_keys):
    """Graphs are captured for the splits of these key counts only: every context length up to max_keys,
    at any block count, must choose one of them."""
    monkeypatch.setattr(device_info, "num_sms", lambda device: 132)  # H100
    samples = split_key_counts(max_keys)
    assert min(samples) >= 1 and max(samples) == max_keys
    for blocks in (1, 3, 8, 20, 33, 64, 300):
        for kvh in (1, 8):
            reached = {choose_splits(blocks, kvh, n, "cpu") for n in samples}
            for n in range(1, max_keys + 1, max(1, max_keys // 4000)):
                assert choose_splits(blocks, kvh, n, "cpu") in reached, (blocks, kvh, n)


def test_wrapper_rejects_bad_inputs(device):
    gen = torch.Generator().manual_seed(0)
    q, k, v, table, seqs, _ = make_case(
        gen, [(2, 5)], num_kv_heads=2, group=2, head_dim=16, page_size=4, dtype=torch.float32, device=device
    )
    plan = plan_attention(*zip(*seqs, strict=True), num_heads=4, num_kv_heads=2, device=device)
    kw = dict(page_size=4, scale=0.25)
    for dim in (24, 512):
        bad = torch.zeros((q.shape[0], 4, dim), device=device)
        cache = torch.zeros((k.shape[0], 2, dim), device=device)
        with pytest.raises(ValueError, match="power of two in 16..256"):
            paged_attention(bad, cache, cache, table, plan, **kw)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(q, k.half(), v, table, plan, **kw)
    with pytest.raises(ValueError, match="page_table must be int64 or int32"):
        paged_attention(q, k, v, table.float(), plan, **kw)
    with pytest.raises(ValueError, match="plan was made for"):
        paged_attention(q[:, :2], k, v, table, plan, **kw)
    with pytest.raises(ValueError, match="contiguous in their last dim"):
        paged_attention(q.transpose(0, 2).contiguous().transpose(0, 2), k, v, table, plan, **kw)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, k, v, table, plan, sliding_window=0, **kw)


def test_backend_is_chosen_by_configuration():
    assert attention.resolve_backend(None, torch.device("cuda")) == "triton"
    assert attention.resolve_backend(None, torch.device("cpu")) == "torch"
    assert attention.resolve_backend("torch", torch.device("cuda")) == "torch"
    assert attention.resolve_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        attention.resolve_backend("flash", torch.device("cpu"))
    assert attention.attention_fn("torch") is attention.torch_paged_attention
    assert attention.attention_fn("triton") is attention.triton_paged_attention


def runner_steps(model_dir, device, backend: str) -> list[torch.Tensor]:
    """Three steps on shuffled pages: two prompts; a decode, a prompt's second chunk and a new prompt;
    three decodes. Returns each step's logits."""
    runner = ModelRunner(
        RunnerConfig(
            model_dir=str(model_dir), device=str(device), page_size=4, num_pages=32, attention_backend=backend
        )
    )
    pages = torch.randperm(32, generator=torch.Generator().manual_seed(5)).tolist()
    a, b, c = pages[:6], pages[6:12], pages[12:18]
    tok = lambda n, s: [(7 * i + s) % 50 + 2 for i in range(n)]
    steps = [
        [SeqInput(tok(11, 1), 0, a, -1), SeqInput(tok(5, 2), 0, b, -1)],
        [SeqInput(tok(1, 3), 11, a, -1), SeqInput(tok(9, 4), 5, b, -1), SeqInput(tok(3, 5), 0, c, -1)],
        [SeqInput(tok(1, 6), 12, a, -1), SeqInput(tok(1, 7), 14, b, -1), SeqInput(tok(1, 8), 3, c, -1)],
    ]
    return [runner.execute(s).cpu() for s in steps]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_mistral"])
def test_model_logits_kernel_vs_torch(model, request, device):
    """The offline engine's forward with the kernel forced on (interpreter on the CPU) against the torch
    path, fp32; tiny_mistral has a sliding window of 8 that the 14-token sequence crosses."""
    model_dir = request.getfixturevalue(model)
    got = runner_steps(model_dir, device, "triton")
    ref = runner_steps(model_dir, device, "torch")
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [128, 256])
def test_large_head_dims_on_gpu(head_dim):
    run_case(torch.device("cuda"), dtype=torch.bfloat16, group=4, head_dim=head_dim, window=None, seed=5)
    extents = [(1, 700), (3, 300)]
    run_case(torch.device("cuda"), dtype=torch.bfloat16, group=4, head_dim=head_dim, window=None,
             extents=extents, page_size=16, num_splits=4, seed=6)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path_never_syncs():
    """The Triton path on CUDA (one plan per forward, read by every layer) with sync debug on."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, table, seqs, _ = make_case(
        gen, MIXED, num_kv_heads=2, group=2, head_dim=16, page_size=4, dtype=torch.float32, device="cuda"
    )
    kv = KVCache(num_layers=2, num_pages=k.shape[0] // 4, page_size=4, num_kv_heads=2, head_dim=16,
                 dtype=torch.float32, device=torch.device("cuda"))  # fmt: skip
    kv.k[:, : k.shape[0]] = k  # the cache has one more (scratch) page
    kv.v[:, : v.shape[0]] = v
    extents = tuple(SeqExtent(*s) for s in seqs)
    make_fb = lambda: ForwardBatch(
        q, q, q, table, q, extents, attention.plan_for("triton", extents, 4, 2, q.device)
    )
    first = attention.triton_paged_attention(q, kv, 0, make_fb(), 0.25, None)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fb = make_fb()  # the plan's one host-to-device copy
        outs = [attention.triton_paged_attention(q, kv, layer, fb, 0.25, None) for layer in (0, 1)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for out in outs:  # both layers hold the same cache; the last 2 rows belong to no sequence
        assert torch.equal(out[:-2], first[:-2])
