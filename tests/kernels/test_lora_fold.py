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
from tests.kernels.conftest import DEVICE, TOL, rel_err
from tests.kernels.test_triton_backend import _scattered_runs

# per id: the rank of each slice (q, k, v, o, gate, up, down); id 4 stays empty
SMALL = ([1] * 7, [7, 3, 0, 5, 7, 2, 6], [24, 13, 17, 24, 9, 24, 11], [16] * 7)
LARGE = ([1] * 7, [7, 3, 0, 5, 7, 2, 6], [80, 65, 1, 80, 33, 80, 71], [16] * 7)
SHAPE = dict(hidden_size=64, intermediate_size=56, num_attention_heads=4, num_key_value_heads=2)


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
