"""On a GPU: a garbage collection that would run inside a CUDA graph capture waits until after it.

Each test drops an unreachable reference cycle holding a recorded graph inside a capture, then allocates
enough to pass the collector's youngest threshold. Collected there, the graph's reset would make a call a
capturing stream forbids and invalidate the capture ("operation failed due to a previous error during
capture"). First through `graph_capture.recording` itself, then through every capture site of a model
runner (step graphs in full and piecewise mode, decode graphs) as it captures at start-up, after which
its replayed steps must still give the plain path's logits. Runs only where CUDA is available."""

from __future__ import annotations

import gc
import traceback
import weakref

import pytest
import torch

from stages.loader.adapter_reader import read_adapter
from stages.worker.lora.torch_backend import TorchLoraBackend
from stages.worker.model.llama import LlamaModel
from stages.worker.runner import ModelRunner, RunnerConfig
from tests.stages.worker.test_step_graphs import BATCHES, PAGE, _batch, _reference, _rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = 2e-3  # the graphed Triton LoRA's TF32 dots against the torch reference (test_step_graphs_gpu.py)
SITES = ("_capture", "_capture_full", "_capture_pieces")  # decode graphs; full step graphs; step pieces


class _Cycle:
    """Unreachable once dropped, and freed only by the collector: it refers to itself."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph, self.me = graph, self


def _recorded_graph() -> torch.cuda.CUDAGraph:
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        x.add_(1)
    return graph


def _drop_and_allocate(spare: list) -> weakref.ref:
    """Move the last spare graph into a dropped cycle, then allocate past the youngest threshold (an
    automatic collection runs here unless it is off). Returns a weak reference to the cycle."""
    cycle = _Cycle(spare.pop())
    ref = weakref.ref(cycle)
    del cycle
    junk = [[] for _ in range(2 * gc.get_threshold()[0] + 100)]
    del junk
    return ref


def test_recording_defers_a_collection_until_the_capture_has_ended():
    from stages.worker.graph_capture import recording

    spare = [_recorded_graph()]
    y = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    gc.collect()
    assert gc.isenabled()
    with recording(graph):
        y.add_(1)
        ref = _drop_and_allocate(spare)
        alive = ref() is not None
        y.add_(2)
    assert alive, "the cycle was collected inside the capture"
    assert gc.isenabled()
    gc.collect()
    assert ref() is None, "the dropped cycle was never collected"
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), torch.full((4,), 6.0)), y


@pytest.fixture
def garbage_in_captures(monkeypatch):
    """The first capture of each site drops a cycle holding a graph recorded beforehand and allocates."""
    spare = [_recorded_graph() for _ in SITES]
    seen: dict[str, bool] = {}  # site -> the cycle outlived the capture's start
    refs: list[weakref.ref] = []
    begin = torch.cuda.graphs.CUDAGraph.capture_begin

    def capture_begin(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        site = next((f.name for f in reversed(traceback.extract_stack()) if f.name in SITES), None)
        if site is not None and site not in seen:
            refs.append(_drop_and_allocate(spare))
            seen[site] = refs[-1]() is not None

    gc.collect()
    monkeypatch.setattr(torch.cuda.graphs.CUDAGraph, "capture_begin", capture_begin)
    yield seen
    monkeypatch.undo()
    gc.collect()
    assert all(ref() is None for ref in refs), "a dropped cycle was never collected"


@pytest.mark.parametrize("attention", ["triton", "torch"], ids=["full", "piecewise"])
def test_start_up_captures_survive_a_collection(garbage_in_captures, tiny_llama, llama_adapters, attention):
    cfg = RunnerConfig(
        model_dir=str(tiny_llama), device="cuda", dtype="float32", max_lora_rank=16, lora_backend="triton",
        attention_backend=attention, page_size=PAGE, num_pages=400, max_tokens_per_step=128,
        max_model_len=96, max_running_requests=12, cuda_graph_max_batch=8, cuda_graph_max_tokens=64,
    )  # fmt: skip
    runner = ModelRunner(cfg)  # captures every graph here
    want_sites = {"_capture_pieces"} if attention == "torch" else {"_capture", "_capture_full"}
    assert set(garbage_in_captures) == want_sites
    assert all(garbage_in_captures.values()), f"collected inside a capture: {garbage_in_captures}"
    for slot, (name, path) in enumerate(llama_adapters.items()):
        packed = read_adapter(name, path, runner.model_cfg, runner.lora_layout, runner.dtype)
        runner.load_adapter(slot, packed, [(16 * slot, packed.rank)])
    torch_model = LlamaModel(runner.model_cfg, runner.model.w, runner.lora_layout, attention_backend="torch")
    torch_lora = TorchLoraBackend(runner.pool, cfg.max_tokens_per_step)
    # a prefill step (a step graph) and six decodes (a decode graph where there are decode graphs)
    decode6 = [(5 + i, 1, i % 5 - 1) for i in range(6)]
    for name, spec in (("mixed14", BATCHES["mixed14"]), ("decode6", decode6)):
        seqs = _batch(runner, spec, seed=len(name))
        want = _reference(runner, torch_model, torch_lora, seqs)
        replays = runner.step_graphs.replays + (runner.graphs.replays if runner.graphs is not None else 0)
        got = runner.execute(seqs)
        after = runner.step_graphs.replays + (runner.graphs.replays if runner.graphs is not None else 0)
        assert after == replays + 1, f"{name}: the step did not replay a graph"
        err = _rel_err(got, want)
        assert err < TOL, f"{name}: relative error {err:.2e}"


def test_captures_wait_for_no_device_and_replays_match_the_reference(tiny_llama, llama_adapters, monkeypatch):
    """Every key is captured once more with the device left busy (no synchronisation from capture to
    capture: the eager run before each overlaps the next recordings); the graphs replay the reference's
    logits, a prefill step and decodes with adapters alike."""
    cfg = RunnerConfig(
        model_dir=str(tiny_llama), device="cuda", dtype="float32", max_lora_rank=16, lora_backend="triton",
        attention_backend="triton", page_size=PAGE, num_pages=400, max_tokens_per_step=128,
        max_model_len=96, max_running_requests=12, cuda_graph_max_batch=8, cuda_graph_max_tokens=64,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    steps, decodes = runner.step_graphs, runner.graphs
    step_keys, decode_keys = set(steps.graph_keys()), set(decodes.graph_keys())
    assert len(steps.full) == len(step_keys) and len(decodes.graphs) == len(decode_keys)
    steps.full.clear()
    decodes.graphs.clear()
    # with every graph of their shared pool gone, torch's allocators keep that pool unused until their
    # caches are emptied and refuse a capture into it meanwhile: the new captures share a new pool, as
    # the runner's first ones do
    steps.pool = decodes.pool = torch.cuda.graph_pool_handle()
    waits: list[str] = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (waits.append("sync"), real(*a, **k))[1])
    with torch.inference_mode():
        assert steps.capture_all() == len(step_keys) and decodes.capture_all() == len(decode_keys)
    assert waits == [], "a capture waited for the device"
    monkeypatch.undo()
    for slot, (name, path) in enumerate(llama_adapters.items()):
        packed = read_adapter(name, path, runner.model_cfg, runner.lora_layout, runner.dtype)
        runner.load_adapter(slot, packed, [(16 * slot, packed.rank)])
    torch_model = LlamaModel(runner.model_cfg, runner.model.w, runner.lora_layout, attention_backend="torch")
    torch_lora = TorchLoraBackend(runner.pool, cfg.max_tokens_per_step)
    decode6 = [(5 + i, 1, i % 5 - 1) for i in range(6)]
    for name, spec in (("mixed14", BATCHES["mixed14"]), ("decode6", decode6)):
        seqs = _batch(runner, spec, seed=len(name))
        want = _reference(runner, torch_model, torch_lora, seqs)
        replays = steps.replays + decodes.replays
        got = runner.execute(seqs)
        assert steps.replays + decodes.replays == replays + 1, f"{name}: the step did not replay a graph"
        err = _rel_err(got, want)
        assert err < TOL, f"{name}: relative error {err:.2e}"
