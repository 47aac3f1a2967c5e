"""On a GPU: overlapped scheduling with real CUDA graphs (full with the Triton attention, piecewise with
the torch loop): the workload of test_overlap_schedule.py run serially and overlapped gives the same
tokens and results and float32 logits within the graphed paths' tolerance, placeholder tokens are
resolved in the graphs' input buffers, and launching a step never synchronises with the device (the
host issues step N+1 while step N runs). Runs only where CUDA is available (the GPU machine)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.conftest import record_logits
from tests.stages.worker.graph_tolerances import TOL
from tests.stages.worker.test_overlap_schedule import _runner, assert_same, drive, packed_adapters

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]


@contextlib.contextmanager
def no_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.fixture(scope="module", params=["triton", "torch"], ids=["full", "piecewise"])
def engine(request, tiny_llama, llama_adapters):
    runner = _runner(tiny_llama, graphed=True, device="cuda", attention=request.param)
    assert runner.step_graphs is not None and runner.step_graphs.num_graphs > 0
    assert (runner.graphs is not None) == (request.param == "triton")
    return runner, packed_adapters(runner, llama_adapters)


def _run(engine, overlap: bool, ahead: int = 2, guard=contextlib.nullcontext):
    runner, packed = engine
    with pytest.MonkeyPatch.context() as mp:
        recorded = record_logits(mp) if guard is contextlib.nullcontext else {}
        replays = runner.step_graphs.replays + (runner.graphs.replays if runner.graphs is not None else 0)
        run = drive(runner, packed, recorded, overlap=overlap, ahead=ahead, guard=guard)
        after = runner.step_graphs.replays + (runner.graphs.replays if runner.graphs is not None else 0)
        run.graph_runs = {"replays": after - replays}
        torch.cuda.synchronize()
        return run


@pytest.mark.parametrize("ahead", [2, 3])
def test_overlapped_equals_serial_with_cuda_graphs(engine, ahead):
    serial = _run(engine, overlap=False, ahead=ahead)
    overlapped = _run(engine, overlap=True, ahead=ahead)
    assert overlapped.graph_runs["replays"] > 10 and overlapped.overlapped_launches > 10
    assert overlapped.executor.dropped_rows > 0
    assert_same(overlapped, serial, atol=TOL)


def test_launching_a_step_never_waits_for_the_device(engine):
    """Every overlapped launch of a plan without slot copies (apply the plan, stage the inputs, resolve
    placeholders, replay, sample, start the tokens' copy to pinned memory) issues no synchronising call."""
    serial = _run(engine, overlap=False)
    checked = _run(engine, overlap=True, guard=no_sync)
    assert checked.tokens == serial.tokens and checked.reasons == serial.reasons
