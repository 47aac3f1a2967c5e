"""The "fold" LoRA design (stages/worker/lora/fold.py, kernels/lora_fold_*.py) under the Triton
interpreter: a whole padded decode step of a tiny random Llama against the "serial" design's (float32:
to float32 rounding; bf16 with an e4m3 pool: to bf16 rounding of the LoRA change), and each fold kernel
against a float64 torch computation. Adapters of rank 1, odd and mixed per-slice ranks (0 included),
ranks above 64 (block rank 128), an empty id, base-only and padding rows; every pool row past a rank, and
every free row, holds NaN (bf16 pools), which a read of it would show."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_lora_decode import PAGE, step_runner
from kernels.lora_fold_act import act_blocks, fold_silu_mul
from kernels.lora_fold_norm import fold_norm, fold_norm_ref
from kernels.lora_fold_rope import fold_rope_kv
from runtime.common.lora_layout import NUM_SLICES, TARGET_MODULES, LoraLayout
from runtime.common.model_config import ModelConfig
from runtime.common.packed import PackedAdapter
from runtime.synthetic.model import build_config
from stages.worker.lora.pool import LoraPool
from stages.worker.lora.triton_backend import TritonLoraBackend
from stages.worker.model.kv_cache import KVCache
from stages.worker.model.llama import LlamaModel
from stages.worker.model.weights import LayerWeights, ModelWeights
from stages.worker.seq_input import SeqInput
from tests.kernels.conftest import DEVICE, TOL, indptr_of, make_v, rel_err
from tests.kernels.test_triton_backend import _scattered_runs

# per id: the rank of each slice (q, k, v, o, gate, up, down); id 4 stays empty
SMALL = ([1] * 7, [7, 3, 0, 5, 7, 2, 6], [24, 13, 17, 24, 9, 24, 11], [16] * 7)
LARGE = ([1] * 7, [7, 3, 0, 5, 7, 2, 6], [80, 65, 1, 80, 33, 80, 71], [16] * 7)
# hidden 160: the norms' shrinks split K in two, the second ragged (norm_splits); heads of 32 (q: 128)
SHAPE = dict(hidden_size=160, intermediate_size=56, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def _cfg(dtype: str) -> ModelConfig:
    return ModelConfig.from_dict(build_config("llama", "tiny", dtype=dtype, overrides=SHAPE))


def _pool(cfg: ModelConfig, ranks_of, dtype: torch.dtype, lora_dtype: str, seed: int) -> LoraPool:
    layout = LoraLayout.for_model(cfg, max(max(r) for r in ranks_of))
    gen = torch.Generator().manual_seed(seed)
    tops = [max(r) for r in ranks_of]
    pool = LoraPool(layout, sum(tops) + 9, 6, dtype, DEVICE, lora_dtype)
    if lora_dtype == "auto":
        pool.mem.fill_(float("nan"))  # never-written rows: stale garbage
    for i, (per_slice, runs) in enumerate(
        zip(ranks_of, _scattered_runs(gen, pool.total_rows, tops), strict=True)
    ):
        L, r = layout.num_layers, tops[i]
        block = torch.randn((L, r, layout.row_elems), generator=gen) * 0.3
        ranks = torch.tensor([per_slice] * L, dtype=torch.int32)
        for sid, module in enumerate(TARGET_MODULES):  # rows past each module's rank: stale
            g, j = layout.module_slot(module)
            a0, b0 = g.a_offset + j * g.in_stride, g.b_offset + g.out_offsets[j]
            fill = float("nan") if lora_dtype == "auto" else 0.0
            block[:, per_slice[sid] :, a0 : a0 + g.in_dim] = fill
            block[:, per_slice[sid] :, b0 : b0 + g.out_dims[j]] = fill
        scalings = torch.rand((L, NUM_SLICES), generator=gen) + 0.5
        pool.load(i, PackedAdapter(f"a{i}", block.to(dtype), ranks, scalings), runs)
    return pool


def _model(cfg: ModelConfig, dtype: torch.dtype, seed: int) -> LlamaModel:
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.1).to(dtype)

    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    norm = lambda: (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)  # noqa: E731
    layers = [
        LayerWeights(norm(), w(q + 2 * kv, h), None, w(h, q), None, norm(), w(2 * i, h), None, w(h, i), None)
        for _ in range(cfg.num_layers)
    ]
    weights = ModelWeights(
        embed=w(cfg.vocab_size, h), layers=layers, norm=norm(), lm_head=w(cfg.vocab_size, h)
    )
    return LlamaModel(cfg, weights, None, attention_backend="triton", pointwise_backend="triton")


def _step(model, pool, cfg, dtype, design: str, slots: list[int], ctx: int = 8) -> torch.Tensor:
    pages = ctx // PAGE + 2
    kv = KVCache(
        num_layers=cfg.num_layers, num_pages=len(slots) * pages, page_size=PAGE,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype, device=DEVICE,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(7)  # the same context for every design
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    seqs = [SeqInput([5 + i], ctx, list(range(i * pages, (i + 1) * pages)), s) for i, s in enumerate(slots)]
    backend = None if design == "base" else TritonLoraBackend(pool, max_tokens=64, max_seqs=16, design=design)
    model.lora_layout = pool.layout
    logits = step_runner(model, kv, backend, seqs, ctx, False, design)[1]
    if design == "fold":
        assert backend.folds() is not None
    return logits


# ids sorted as the runner orders them; 7 sequences padded to the bucket of 8 (one padding row)
SLOTS = [-1, 0, 1, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "dtype,lora_dtype,ranks_of,tol",
    [(torch.float32, "auto", SMALL, 1e-4), (torch.float32, "auto", LARGE, 1e-4),
     (torch.bfloat16, "fp8", SMALL, 2 * TOL[torch.bfloat16])],
)  # fmt: skip
def test_fold_step_matches_serial(dtype, lora_dtype, ranks_of, tol):
    cfg = _cfg("float32" if dtype == torch.float32 else "bfloat16")
    model = _model(cfg, dtype, seed=1)
    pool = _pool(cfg, ranks_of, dtype, lora_dtype, seed=2)
    base = _step(model, pool, cfg, dtype, "base", [-1] * len(SLOTS))
    serial = _step(model, pool, cfg, dtype, "serial", SLOTS)
    fold = _step(model, pool, cfg, dtype, "fold", SLOTS)
    assert torch.isfinite(fold).all()
    assert torch.equal(fold[0], base[0]) or rel_err(fold[0], base[0]) < tol  # the base-only row
    assert (serial - base)[1:6].abs().amax(1).min() > 1e-2  # every row of a loaded adapter moves
    assert rel_err(fold - base, serial - base) < tol


def _dense(backend, layer: int, group: str, slot: int):
    """float64 [(A_j [r_j, in], B_j [r_j, d_j], scaling_j)] of id `slot`'s slices, dequantized."""
    pool, g = backend.pool, backend.layout.group(group)
    a, b, _, _ = backend._views[layer, group]
    a_sc, b_sc = backend._scales[layer, group]
    out = []
    for j in range(g.num_slices):
        r = int(pool.host_ranks[slot, layer, g.first_slice + j])
        idx = pool.host_rows[slot, :r].long()
        cols = slice(g.out_offsets[j], g.out_offsets[j] + g.out_dims[j])
        aj, bj = a[idx, j].double(), b[idx, cols].double()
        if a_sc is not None:
            aj, bj = aj * a_sc[idx, j, None].double(), bj * b_sc[idx, j, None].double()
        out.append((aj, bj, float(pool.host_scalings[slot, layer, g.first_slice + j])))
    return out


def _delta(backend, layer, group, v, slots, inv=None):
    """float64 [T, out_total]: each row's delta from v [P, T, slices, R] (times inv [T])."""
    g = backend.layout.group(group)
    vs = v.double().sum(0) * (inv.double()[:, None, None] if inv is not None else 1)
    delta = torch.zeros((len(slots), g.out_total), dtype=torch.float64)
    for t, slot in enumerate(slots):
        for j, (_, bj, sc) in enumerate(_dense(backend, layer, group, slot) if slot >= 0 else ()):
            o = g.out_offsets[j]
            delta[t, o : o + g.out_dims[j]] = sc * vs[t, j, : bj.shape[0]] @ bj
    return delta


def _check_shrink(backend, layer, group, got, x_ref, slots, tol):
    """got [T, slices, R] (the partials summed, the norm's factor applied) against x_ref @ A^T, and zeros
    from each rank up to its 16-column group."""
    refs, gots = [], []
    for t, slot in enumerate(slots):
        for j, (aj, _, _) in enumerate(_dense(backend, layer, group, slot) if slot >= 0 else ()):
            r = aj.shape[0]
            refs.append(aj @ x_ref[t])
            gots.append(got[t, j, :r])
            assert (got[t, j, r : (r + 15) // 16 * 16] == 0).all()
    assert rel_err(torch.cat(gots), torch.cat(refs)) < tol


def _rotate64(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("lora_dtype,ranks_of", [("auto", SMALL), ("fp8", LARGE)])
def test_fold_kernels_against_float64(lora_dtype, ranks_of):
    """Each fold kernel on bf16 rows, its operands made by the backend's fold steps (their views of the
    pool), against float64: the post-attention norm (o's expand, gate/up's shrink), rotary + K/V write
    (q/k/v's expand), the activation (gate/up's expand, down's shrink)."""
    dt, cfg = torch.bfloat16, _cfg("bfloat16")
    # Each kernel rounds to bf16 up to four times in a row (as the unfused ops do); the interpreter rounds
    # towards zero (-0.3 % on average each time), so the bound is twice the one of a single rounding. The
    # float32 step test above catches errors of 1 % in any delta.
    tol = 2 * TOL[dt]
    pool = _pool(cfg, ranks_of, dt, lora_dtype, seed=3)
    backend = TritonLoraBackend(pool, max_tokens=64, max_seqs=32, design="fold")
    lengths, seg_slots = [2, 3, 1, 4, 2, 1], [-1, 0, 1, 2, 3, 4]
    indptr = indptr_of(lengths)
    backend.prepare(indptr, seg_slots)
    fold, info, rows = backend.folds(), backend.batch_info, backend.rows
    slots = [s for n, s in zip(lengths, seg_slots, strict=True) for _ in range(n)]
    T, H, gen = len(slots), cfg.hidden_size, torch.Generator().manual_seed(4)

    def rnd(*shape):
        return torch.randn(shape, generator=gen).to(dt)

    def v_of(layer, group, parts):
        g = pool.layout.group(group)
        ranks = pool.host_ranks[:, layer, g.first_slice : g.first_slice + g.num_slices]
        return make_v(gen, indptr, seg_slots, ranks, parts, info.block_rank)

    # the post-attention norm of layer 0: h + o + o's delta, its norm, gate/up's shrink of layer 1
    h, o, w, v_o = rnd(T, H), rnd(T, H), rnd(H), v_of(0, "o", 3)
    shrink = fold._norm_shrink(1, "gate_up", fold._v_gu, fold._inv_post)
    total, x = fold_norm(h, w, 1e-5, info, rows, d=o, expand=fold._expand(0, "o", v_o), shrink=shrink)
    s_ref, x_ref, _ = fold_norm_ref(h, w, 1e-5, d=o, delta=_delta(backend, 0, "o", v_o, slots))
    assert rel_err(total, s_ref) < tol and rel_err(x, x_ref) < tol
    _check_shrink(backend, 1, "gate_up", shrink.v.sum(0) * shrink.inv[:, None, None], x_ref, slots, tol)

    # rotary + K/V write with q/k/v's delta (v of a norm: times each row's factor)
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv, v_qkv, inv = rnd(T, (nh + 2 * nkv) * d), v_of(0, "qkv", 2), torch.rand(T, generator=gen) + 0.5
    angle = torch.rand((T, d // 2), generator=gen) * 6
    cos, sin = (f(torch.cat((angle, angle), -1)).to(dt)[:, None] for f in (torch.cos, torch.sin))
    kc, vc = torch.zeros((3 * T, nkv, d), dtype=dt), torch.zeros((3 * T, nkv, d), dtype=dt)
    kv_rows = torch.randperm(3 * T, generator=gen)[:T]
    q = fold_rope_kv(qkv, cos, sin, kv_rows, kc, vc, nh, nkv, fold._expand(0, "qkv", v_qkv, inv), info, rows)
    ref = qkv.double() + _delta(backend, 0, "qkv", v_qkv, slots, inv)
    rq, rk, rv = ref.split([nh * d, nkv * d, nkv * d], dim=-1)
    c64, s64 = cos.double(), sin.double()
    assert rel_err(q, _rotate64(rq.view(T, nh, d), c64, s64)) < tol
    assert rel_err(kc[kv_rows], _rotate64(rk.view(T, nkv, d), c64, s64)) < tol
    assert rel_err(vc[kv_rows], rv.view(T, nkv, d)) < tol

    # the activation of layer 1 with gate/up's delta, and down's shrink of it
    inter = cfg.intermediate_size
    gu, v_gu = rnd(T, 2 * inter), v_of(1, "gate_up", 2)
    _, _, groups = act_blocks(inter, info.block_rank)
    down = fold._shrink(1, "down", fold._v_down, groups, None)
    act = fold_silu_mul(gu, fold._expand(1, "gate_up", v_gu, inv), info, rows, down)
    g, u = (gu.double() + _delta(backend, 1, "gate_up", v_gu, slots, inv)).chunk(2, dim=-1)
    act_ref = torch.nn.functional.silu(g) * u
    assert rel_err(act, act_ref) < tol
    _check_shrink(backend, 1, "down", down.v.sum(0), act_ref, slots, tol)
