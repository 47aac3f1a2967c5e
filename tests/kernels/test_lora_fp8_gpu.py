"""On a GPU: the e4m3 and int8 quantization kernel against its torch reference (bit for bit: q and
scales), and the 8-bit pools' shrink, expand and fused expand + activation against float64, eager and as
padded (CUDA-graph) batches of every tile class. Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_quant import FP8
from kernels.lora_quant import NUM_SCALES, quantize_rows, quantize_rows_ref, segments
from runtime.common.lora_layout import LoraLayout
from tests.kernels.conftest import indptr_of, rel_err, small_layout
from tests.kernels.test_lora_fp8 import LENGTHS, SLOTS, check_backend, expected_delta, fp8_pool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("row_dtype", [FP8, torch.int8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_kernel_matches_torch(dtype, row_dtype):
    """Real 1B-shaped rows (segments of 512 to 8,192 elements), magnitudes over six decades, one all-zero
    row; rank rows scattered over the pool."""
    layout = LoraLayout.build(
        num_layers=3, hidden=2048, q_out=2048, kv_out=512, intermediate=8192, max_rank=64
    )
    gen = torch.Generator().manual_seed(0)
    r, total = 37, 100
    src = torch.randn((3, r, layout.row_elems), generator=gen) * 10 ** torch.empty((3, r, 1)).uniform_(-4, 2)
    src[1, 5] = 0
    src = src.to(dtype).to(CUDA)
    rows = torch.randperm(total, generator=gen)[:r].to(torch.int32)
    dst = torch.zeros((3, total, layout.row_elems), dtype=row_dtype, device=CUDA)
    scales = torch.zeros((3, total, NUM_SCALES), device=CUDA)
    segs = segments(layout)
    quantize_rows(src, dst, scales, rows.to(CUDA), torch.tensor(segs, dtype=torch.int32, device=CUDA))
    q, s = quantize_rows_ref(src.cpu(), segs, row_dtype)
    idx = rows.long()
    assert torch.equal(scales.cpu()[:, idx], s)
    got = dst.cpu()[:, idx]
    for off, n in segs:
        assert torch.equal(got[..., off : off + n].view(torch.uint8), q[..., off : off + n].view(torch.uint8))


@pytest.mark.parametrize("lora_dtype", ["fp8", "int8"])
def test_fp8_kernels_on_gpu(lora_dtype):
    pool = fp8_pool(small_layout(max_rank=24), [1, 7, 24, 16], CUDA, seed=3, lora_dtype=lora_dtype)
    check_backend(pool, indptr_of(LENGTHS), SLOTS, seed=1, max_seqs=4)
    check_backend(pool, indptr_of([1] * 6), [3, 0, -1, 1, 2, 4], seed=2, max_seqs=8)
    big = fp8_pool(small_layout(max_rank=80, num_layers=1), [65, 3, 80], CUDA, seed=4, lora_dtype=lora_dtype)
    check_backend(big, indptr_of([4, 2, 1, 36]), [2, 0, -1, 1], seed=5, max_seqs=2)


@pytest.mark.parametrize("lora_dtype", ["fp8", "int8"])
def test_fp8_padded_batches_every_tile_class(lora_dtype):
    """Decode-sized padded batches, as the CUDA graphs run them, for each tile class."""
    from stages.worker.lora.triton_backend import TritonLoraBackend

    pool = fp8_pool(small_layout(max_rank=24), [1, 7, 24, 16], CUDA, seed=8, lora_dtype=lora_dtype)
    backend = TritonLoraBackend(pool, max_tokens=128, max_seqs=64)
    indptr, slots = indptr_of([1] * 7), [3, 0, -1, 1, 2, 4, 0]
    gen = torch.Generator().manual_seed(3)
    for c in backend.tile_classes(16):
        backend.prepare(indptr, slots, pad_to=16, tile_class=c)
        for g in pool.layout.groups:
            x = torch.randn((16, g.in_dim), generator=gen).to(torch.bfloat16)
            got = torch.zeros((16, g.out_total), dtype=torch.bfloat16, device=CUDA)
            backend.apply(x.to(CUDA), got, 0, g)
            want = expected_delta(pool, x[:7], 0, g, indptr, slots)
            err = rel_err(got[:7].cpu(), want)
            assert err < 2e-2 and not got[7:].any(), (c, g.name, err)
