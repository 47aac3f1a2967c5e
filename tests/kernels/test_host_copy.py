"""kernels/host_copy: uploads of small step inputs by a kernel reading pinned host memory through its
device mapping. On the CPU the fallback (a plain copy) is checked; on CUDA the mapping itself, the
uploads of every dtype the worker stages, and the reason they exist: an upload queued after a gigabyte of
copy-engine transfers on another stream is done before they are."""

from __future__ import annotations

import pytest
import torch

from kernels.host_copy import IndexUploads, PinnedBuffer, mapped, upload
from stages.worker.decode_graphs import HostStaging

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_no_mapping_without_a_pinned_buffer():
    assert mapped(torch.arange(8)) is None  # pageable (and on a machine without CUDA, anything)
    buf = PinnedBuffer(6, torch.int64, pin=False)
    assert buf.device_view is None and buf.event is None


def test_fallback_upload_copies():
    src = torch.arange(10, dtype=torch.int32)
    dst = torch.zeros(10, dtype=torch.int32)
    upload(dst, src, None)
    assert torch.equal(dst, src)


def test_index_uploads_ring_and_overflow():
    up = IndexUploads(capacity=5, device=torch.device("cpu"), ring=2)
    cases = [[4, 0, 2], [1], [3, 3, 0, 1, 2], list(range(7))]  # the last: past capacity
    assert [up(values).tolist() for values in cases] == cases  # the ring wraps at the third


@needs_cuda
def test_mapping_aliases_the_host_buffer():
    host = torch.zeros(1000, dtype=torch.int64).pin_memory()
    view = mapped(host)
    assert view is not None and view.is_cuda and view.data_ptr() == host.data_ptr()
    host.copy_(torch.arange(1000) * 3)  # written after the mapping was made
    assert torch.equal(view.clone().cpu(), torch.arange(1000) * 3)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.bfloat16])
def test_upload_by_kernel_equals_the_host_data(dtype):
    g = torch.Generator().manual_seed(3)
    src = (torch.randn(4099, generator=g) * 1000).to(dtype).pin_memory()
    src_view = mapped(src)
    dst = torch.full((4099,), -1, dtype=dtype, device="cuda")
    upload(dst[:4001], src[:4001], src_view[:4001])
    torch.cuda.synchronize()
    assert torch.equal(dst[:4001].cpu(), src[:4001])
    assert (dst[4001:].cpu() == -1).all()  # nothing past the slice
    with pytest.raises(ValueError, match="upload of"):
        upload(dst[:10], src[:11], src_view[:11])


@needs_cuda
def test_index_uploads_on_the_device():
    up = IndexUploads(capacity=64, device=torch.device("cuda"), ring=3)
    for k in range(7):
        values = [(7 * i + k) % 50 for i in range(10 + k)]
        assert up(values).cpu().tolist() == values


@needs_cuda
def test_staging_upload_does_not_wait_for_copy_engine_transfers_on_another_stream():
    """What the uploads are for: 64 copies of 16 MiB from pinned memory (about 20 ms on a PCIe 5 link)
    are queued on a side stream, then a step's staging uploads on the compute stream. The uploads are done
    while the transfers are not (a cudaMemcpyAsync in their place finished only after the last of them)."""
    n, size = 64, 16 << 20
    src = torch.empty(n * size, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n * size, dtype=torch.uint8, device="cuda")
    staging = HostStaging(3 * 512, 40_000, pin=True)
    staging.i64.copy_(torch.arange(3 * 512))
    staging.i32.copy_(torch.arange(40_000, dtype=torch.int32) % 977)
    d64 = torch.zeros(3 * 512, dtype=torch.int64, device="cuda")
    d32 = torch.zeros(40_000, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for i in range(n):
            dst[i * size : (i + 1) * size].copy_(src[i * size : (i + 1) * size], non_blocking=True)
        transfers = torch.cuda.Event()
        transfers.record(side)
    staging.upload(d64, d32, 30_000)
    uploaded = torch.cuda.Event()
    uploaded.record()
    uploaded.synchronize()
    assert not transfers.query(), "the staging uploads waited for the other stream's transfers"
    transfers.synchronize()
    assert torch.equal(d64.cpu(), torch.arange(3 * 512))
    assert torch.equal(d32[:30_000].cpu(), torch.arange(30_000, dtype=torch.int32) % 977)
    assert (d32[30_000:].cpu() == 0).all()
